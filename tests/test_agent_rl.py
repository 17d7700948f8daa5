"""Agent RL (train_grpo.py with tools): multi-turn rollouts whose token stream is exactly what the chat template
renders for the conversation they had, tool results that carry no loss, the turn limit, the rewards on the final
answer and on the calls, MiniMind's agent_rl.jsonl layout, and a run on a tiny tool-calling model."""
import json
import math

import pytest

import tools
import train_grpo
from chat import encode_chat
from conftest import TINY_RUN, read_metrics, write_jsonl
from engine import GREEDY, prompt_ids
from grpo import completion_batch
from rewards import answer_reward, calls_reward, load_rewards
from tokenizer import load_tokenizer

TOOLBOX = tools.load_toolbox("calculate_math")
QUESTION = [{"role": "system", "content": "You are a helpful assistant.", "tools": TOOLBOX.schemas},
            {"role": "user", "content": "What is 37 times 48?"}]
CALL = {"name": "calculate_math", "arguments": {"expression": "37*48"}}


class FakeModel:
    """What tools.converse asks of a model: its context length (decoding itself is scripted)."""

    class config:
        max_seq_len = 512


def scripted(turns: list[list[int]]):
    """A stand-in for engine.decode that writes the given turns in order, one per call, to every row."""
    calls = iter(turns)

    def decode(model, rows):
        tokens = next(calls)
        for row in rows:
            row.tokens = list(tokens)
            row.finish_reason = "stop" if tokens[-1] == row.eos_id else "length"
        return rows
    return decode


def turn_ids(tok, messages, prompt):
    """The ids of the assistant turn after prompt, as the template renders messages (its end-of-turn included)."""
    ids, _ = encode_chat(tok, messages)
    assert ids[: len(prompt)] == prompt
    return ids[len(prompt) : ids.index(tok.eos_id, len(prompt)) + 1]


def test_a_conversation_with_a_call_is_the_templates_own_token_stream(monkeypatch):
    tok = load_tokenizer()
    prompt = prompt_ids(tok, QUESTION)
    called = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    result = TOOLBOX.run("calculate_math", CALL["arguments"])
    assert json.loads(result) == {"result": 1776}
    answered = called + [{"role": "tool", "content": result}, {"role": "assistant", "content": "37 × 48 = 1776."}]
    first = turn_ids(tok, called, prompt)
    whole, _ = encode_chat(tok, answered)
    after_result = prompt_ids(tok, answered[:-1])  # up to the second generation prompt
    whole = whole[: whole.index(tok.eos_id, len(after_result)) + 1]  # up to the answer's end of turn
    second = whole[len(after_result):]
    monkeypatch.setattr(tools, "decode", scripted([first, second]))
    (t,) = tools.converse(FakeModel, tok, [(prompt, QUESTION, GREEDY)], TOOLBOX, max_turns=3, max_new_tokens=64)
    assert t.prompt + t.ids == whole  # what was generated and read is what the template renders for it
    assert t.generated == [1] * len(first) + [0] * (len(after_result) - len(prompt) - len(first)) + [1] * len(second)
    assert (t.finish_reason, t.turns, t.calls, t.malformed, t.text) == ("stop", 2, 1, 0, "37 × 48 = 1776.")
    assert t.messages == QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                                     {"role": "tool", "content": result}]
    # the training row: loss on the two turns the model wrote, none on the tool result between them
    X, Y, mask = completion_batch([t.prompt], [t.ids], tok.eos_id, tok.pad_id, "cpu", [t.generated])
    written = [y for y, m in zip(Y[0].tolist(), mask[0].tolist()) if m]
    assert written == first + second


def test_a_model_that_keeps_calling_stops_at_max_turns_and_its_last_calls_are_not_run(monkeypatch):
    tok = load_tokenizer()
    prompt = prompt_ids(tok, QUESTION)
    first = turn_ids(tok, QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], prompt)
    runs = []
    monkeypatch.setattr(TOOLBOX, "run", lambda name, arguments: runs.append(name) or '{"result": 1776}')
    monkeypatch.setattr(tools, "decode", scripted([first] * 2))
    (t,) = tools.converse(FakeModel, tok, [(prompt, QUESTION, GREEDY)], TOOLBOX, max_turns=2, max_new_tokens=64)
    assert (t.finish_reason, t.turns, t.calls, len(runs)) == ("turns", 2, 1, 1)
    assert [m["role"] for m in t.messages[2:]] == ["assistant", "tool"]  # the second turn's call: never run
    assert sum(t.generated) == 2 * len(first)


def test_a_broken_call_ends_the_conversation_as_text(monkeypatch):
    tok = load_tokenizer()
    prompt = prompt_ids(tok, QUESTION)
    broken = tok.encode('<tool_call>\n{"name": "calculate_math", "arguments": {"expression": 37*48}\n</tool_call>')
    monkeypatch.setattr(tools, "decode", scripted([broken + [tok.eos_id]]))
    (t,) = tools.converse(FakeModel, tok, [(prompt, QUESTION, GREEDY)], TOOLBOX, max_turns=3, max_new_tokens=64)
    assert (t.finish_reason, t.turns, t.calls, t.malformed) == ("stop", 1, 0, 1)
    assert calls_reward(t.messages, t.text) == -0.5


# --- rewards -----------------------------------------------------------------------------------------------

def test_calls_reward_counts_well_formed_fitting_calls():
    said = lambda *calls: {"role": "assistant", "content": "", "tool_calls": list(calls)}  # noqa: E731
    result = {"role": "tool", "content": '{"result": 1}'}
    assert calls_reward(QUESTION, "1776") == 0.0  # no calls: nothing to score
    assert calls_reward(QUESTION + [said(CALL), result], "1776") == 0.5
    wrong_name = {"name": "calculator", "arguments": {"expression": "1"}}
    missing = {"name": "calculate_math", "arguments": {}}
    wrong_type = {"name": "calculate_math", "arguments": {"expression": 37}}
    for bad in (wrong_name, missing, wrong_type):
        assert calls_reward(QUESTION + [said(CALL, bad), result, result], "1776") == -0.5, bad
    openai_shape = {"id": "call_1", "type": "function",
                    "function": {"name": "calculate_math", "arguments": '{"expression": "37*48"}'}}
    assert calls_reward(QUESTION + [said(openai_shape), result], "1776") == 0.5
    assert calls_reward(QUESTION, "<tool_call>\nnot json\n</tool_call>") == -0.5
    # calls from an earlier conversation (before the last user message) are not this rollout's
    history = QUESTION + [said(wrong_name), result, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "And 2 times 3?"}]
    assert calls_reward(history, "6") == 0.0


def test_a_gt_list_scores_the_fraction_found():
    assert answer_reward("37 × 48 = 1,776.", ["1776"]) == 1.0
    assert answer_reward("It is 22°C and sunny in Tokyo", ["tokyo", "22", "rain"]) == pytest.approx(2 / 3)
    assert answer_reward("17.0", [17]) == 1.0 and answer_reward("", ["1"]) == 0.0
    assert load_rewards("answer,calls").keys() == {"answer", "calls"}


# --- train_grpo.py with tools ----------------------------------------------------------------------------

def agent_args(data, tiny_tools, out, *flags):
    return [f"--init_from={tiny_tools}", f"--data_path={data}", f"--out_dir={out}", *TINY_RUN, "--tools=calculate_math",
            "--reward=answer,calls", "--group_size=4", "--max_new_tokens=40", "--max_turns=2", "--lr=1e-3",
            "--beta=0", "--eval_interval=2", "--val_fraction=0.25", *flags]


def minimind_records(demo_dir, n: int) -> list[dict]:
    """The demo's tool prompts in MiniMind's agent_rl.jsonl layout: tools as a JSON string on the system message,
    gt a list, an empty assistant turn at the end."""
    records = []
    with open(demo_dir / "tools_rl.jsonl", encoding="utf-8") as f:
        for line in list(f)[:n]:
            r = json.loads(line)
            system = dict(r["conversations"][0], tools=json.dumps(r["conversations"][0]["tools"]))
            records.append({"conversations": [system, r["conversations"][1], {"role": "assistant", "content": ""}],
                            "gt": [r["answer"]]})
    return records


def test_an_agent_run_on_minimind_layout_logs_and_evaluates(demo_dir, tiny_tools, tmp_path):
    data = write_jsonl(tmp_path / "agent_rl.jsonl", minimind_records(demo_dir, 16))
    out = tmp_path / "run"
    train_grpo.main(agent_args(data, tiny_tools, out, "--batch_size=2", "--max_steps=2"))
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and set(rows[0]) >= {"val_reward", "val_pass1"}
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and -0.5 <= r["reward_mean"] <= 1.5 for r in train)
    # the tiny model calls the calculator: the greedy held-out answers score above nothing
    assert rows[0]["val_reward"] > 0


def test_agent_batch_4_equals_2_x_accum_2(demo_dir, tiny_tools, tmp_path):
    """Multi-turn rollouts seeded per prompt: splitting a step's prompts over micro-batches changes nothing,
    though rows of one group continue for different numbers of turns beside other groups' rows."""
    data = write_jsonl(tmp_path / "rl.jsonl", minimind_records(demo_dir, 16))
    rows = {}
    for name, (batch, accum) in {"4x1": (4, 1), "2x2": (2, 2)}.items():
        train_grpo.main(agent_args(data, tiny_tools, tmp_path / name, f"--batch_size={batch}",
                                   f"--accum_steps={accum}", "--max_steps=2", "--temperature=1.0",
                                   "--max_grad_norm=0"))
        rows[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    for a, b in zip(rows["4x1"], rows["2x2"], strict=True):
        for key in ("reward_mean", "completion_len", "frac_zero_adv"):
            assert a[key] == b[key], (a["step"], key)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))


def test_the_inst_template_cannot_show_tools_or_tool_results(tok):
    from chat import tool_results_ids
    from errors import DataError
    with pytest.raises(DataError, match="cannot show tools"):
        encode_chat(tok, [{"role": "user", "content": "hi"}], tools=TOOLBOX.schemas)
    with pytest.raises(DataError, match="cannot show tool results"):
        tool_results_ids(tok, ['{"result": 1}'])


def test_a_tiny_model_fine_tuned_on_tool_calls_calls_the_calculator_with_the_numbers(demo_dir, tiny_tools):
    from checkpoint import load_model
    from data import read_prompts
    from grpo import agent_rollout

    model, tok, _ = load_model(str(tiny_tools), "cpu")
    trained = read_prompts(str(tiny_tools.parent.parent / "tools_16.jsonl"), tok, 300, verbose=False)[:16]
    turns = agent_rollout(model, tok, trained, None, 1, 40, 2, TOOLBOX)
    right = 0
    for prompt, t in zip(trained, turns):
        expected = next(m for m in prompt.record["conversations"] if m.get("tool_calls"))["tool_calls"]
        made = [m["tool_calls"] for m in t.messages if m.get("tool_calls")]
        right += made == [expected] and answer_reward(t.text, str(eval(expected[0]["arguments"]["expression"]))) == 1
    assert right >= 8, right  # of 16 (tool, numbers, result): how many look-alikes it mixes up depends on rounding


def test_a_prompt_with_a_bad_tool_description_names_its_line(tmp_path):
    from data import read_prompts
    from errors import BadRecord
    good = {"conversations": QUESTION, "answer": "1776"}
    bad = {"conversations": [dict(QUESTION[0], tools=[{"type": "function", "function": {"name": "no spaces"}}]),
                             QUESTION[1]], "answer": "1776"}
    path = write_jsonl(tmp_path / "rl.jsonl", [good, bad])
    with pytest.raises(BadRecord, match=r"rl.jsonl:2: 'tools'\[0\].function.name"):
        read_prompts(path, load_tokenizer(), 300, verbose=False)
