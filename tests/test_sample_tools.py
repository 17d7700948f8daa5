"""sample.py --tools: a call the model writes is run, shown and fed back, and the model answers from its result; the
history keeps each turn's calls and results in order; --max_turns bounds the turns; a checkpoint or a --tools that
cannot work is one error line. The model is scripted (its replies are fixed) so that what is tested is the loop."""
import dataclasses
import io
import json
import re
from types import SimpleNamespace

import pytest
import torch

import sample
import tokenizer as tk
from chat import GENERATION_PROMPT, encode_chat, encode_pieces, markup
from conftest import run_script
from errors import ConfigError
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer
from tools import load_toolbox


def call(name: str, arguments: dict) -> str:
    """A call as MiniMind's template writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def scripted(monkeypatch, tok, replies: list[str], limits: list | None = None) -> list[list[int]]:
    """sample.generate replaced by a model that writes replies[i] in its i-th turn (the last one from then on),
    token by token, then its end of turn. Returns the prompts it is given, one per turn; limits gets each turn's
    max_new_tokens."""
    fed = []

    def generate(model, prompts, max_new_tokens, sampling, eos_id):
        (ids,) = prompts
        fed.append(ids)
        if limits is not None:
            limits.append(max_new_tokens)
        reply = replies[min(len(fed), len(replies)) - 1]
        row = SimpleNamespace(tokens=[], finish_reason=None)
        for token in encode_pieces(tok, [markup(reply)])[0] + [eos_id]:  # <tool_call> as the added token it is
            row.tokens.append(token)
            row.finish_reason = "stop" if token == eos_id else None
            yield [row]

    monkeypatch.setattr(sample, "generate", generate)
    return fed


def lines(*said):
    """read() for chat_loop: a line per call, then EOFError (Ctrl-D)."""
    said = iter(said)

    def read(prompt):
        try:
            return next(said)
        except StopIteration:
            raise EOFError from None
    return read


def chat_args(**overrides):
    args = dict(temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0, max_new_tokens=64, system=None,
                max_turns=5)
    return SimpleNamespace(**{**args, **overrides})


def chat_model(max_seq_len: int = 1024, vocab_size: int = 6400) -> Transformer:
    """A random model: the scripted generation never runs it; its context sets the prompt's budget."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len,
                                   vocab_size=vocab_size)).eval()


def chat_checkpoint(path, tok, max_seq_len: int = 1024, stage: str = "sft", tokenizer_path=None) -> str:
    """A checkpoint as the training scripts write it, as far as sample.py reads one."""
    model = chat_model(max_seq_len, tok.vocab_size)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "stage": stage,
                "step": 0, "config": {"tokenizer_path": tokenizer_path, "batch_size": 1, "accum_steps": 1},
                "rng": [None], "tokenizer": {"path": tokenizer_path, "fingerprint": tok.fingerprint,
                                             "chat_template": tok.chat_template}}, path)
    return str(path)


def test_a_call_is_run_shown_and_fed_back_and_the_answer_follows_from_the_whole_history(monkeypatch):
    tok, toolbox = load_tokenizer(), load_toolbox("builtin")
    fed = scripted(monkeypatch, tok, [call("calculate_math", {"expression": "37*48"}), "37 times 48 is 1776.",
                                      "It is 4."])
    out = io.StringIO()
    history = sample.chat_loop(chat_model(), tok, chat_args(), chat=True, read=lines("What is 37 times 48?", "2+2?"),
                               out=out, toolbox=toolbox)

    result = json.dumps({"result": 37 * 48})  # Python's own product
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert history[1]["tool_calls"] == [{"name": "calculate_math", "arguments": {"expression": "37*48"}}]
    assert history[2] == {"role": "tool", "content": result}
    assert history[3]["content"] == "37 times 48 is 1776." and "tool_calls" not in history[3]
    shown = out.getvalue()
    assert f'[call] calculate_math({{"expression": "37*48"}})\n[result] {result}\n' in shown
    assert shown.index("[result]") < shown.index("37 times 48 is 1776.") < shown.index("It is 4.")
    # every turn is generated from the whole history, tools offered; the second one reads the result
    assert len(fed) == 3
    for ids, upto in zip(fed, (1, 3, 5)):
        assert ids == encode_chat(tok, history[:upto], tools=toolbox.schemas)[0]
    second = tok.decode(fed[1])
    assert '"name": "calculate_math"' in second.split("<|im_start|>user")[0]  # the tools block, in the system turn
    assert f"<tool_response>\n{result}\n</tool_response>" in second and second.endswith(GENERATION_PROMPT)


def test_max_turns_stops_a_model_that_keeps_calling_and_a_refused_expression_comes_back_as_an_error(monkeypatch):
    tok = load_tokenizer()
    fed = scripted(monkeypatch, tok, [call("calculate_math", {"expression": "__import__('os').getcwd()"})])
    out = io.StringIO()
    history = sample.chat_loop(chat_model(), tok, chat_args(max_turns=2), chat=True, read=lines("Where am I?"),
                               out=out, toolbox=load_toolbox("calculate_math"))
    assert len(fed) == 2  # two turns, both calling
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(history[2]["content"]).keys() == {"error"}  # the calculator refused; the model reads why
    assert history[3]["tool_calls"][0]["name"] == "calculate_math"
    shown = out.getvalue()
    assert shown.count("[call]") == 1 and "[stopped] 2 turns" in shown  # the last turn's call is not run


def test_a_malformed_call_is_not_run_and_stays_in_the_answer(monkeypatch):
    tok = load_tokenizer()
    broken = '<tool_call>\n{"name": "calculate_math", "arguments": {"expression": \n</tool_call>'
    fed = scripted(monkeypatch, tok, [broken, "never asked for"])
    out = io.StringIO()
    history = sample.chat_loop(chat_model(), tok, chat_args(), chat=True, read=lines("2*3?"), out=out,
                               toolbox=load_toolbox("builtin"))
    assert len(fed) == 1 and history[1] == {"role": "assistant", "content": broken}
    assert "[malformed] 1" in out.getvalue() and "[call]" not in out.getvalue()


def test_prompt_mode_runs_the_tools_too(tmp_path, monkeypatch, capsys):
    tok = load_tokenizer()
    ckpt = chat_checkpoint(tmp_path / "chat.pt", tok)
    scripted(monkeypatch, tok, [call("unit_converter", {"value": 5, "from_unit": "km", "to_unit": "m"}), "5000 m."])
    sample.main([f"--ckpt={ckpt}", "--tools=unit_converter", "--prompt=5 km in m?", "--temperature=0", "--device=cpu"])
    shown = capsys.readouterr().out
    assert '[result] {"result": 5000.0, "unit": "m"}' in shown and shown.rstrip().endswith("5000 m.")


def test_a_long_exchange_takes_what_the_context_has_left_and_tools_that_fill_it_are_an_error(tmp_path, monkeypatch):
    tok = load_tokenizer()
    args = [f"--ckpt={chat_checkpoint(tmp_path / 'short.pt', tok, max_seq_len=256)}", "--tools=builtin",
            "--prompt=hi", "--device=cpu"]
    with pytest.raises(ConfigError, match="tools' descriptions take .* whole context is 256"):
        sample.main(args)
    limits = []
    fed = scripted(monkeypatch, tok, [call("calculate_math", {"expression": "1+1"}) * 6], limits)
    out = io.StringIO()  # six calls and six results a turn: past the prompt's budget (500) from the second turn on
    history = sample.chat_loop(chat_model(1000), tok, chat_args(max_new_tokens=None, max_turns=10), chat=True,
                               read=lines("1+1?"), out=out, toolbox=load_toolbox("calculate_math"))
    assert [m["role"] for m in history] == ["user"] + (["assistant"] + ["tool"] * 6) * 3
    assert "[stopped] this message" in out.getvalue() and len(fed) == 3  # a fourth prompt would fill the context
    schemas = load_toolbox("calculate_math").schemas
    assert len(encode_chat(tok, history, tools=schemas)[0]) >= 1000
    for ids, upto, limit in zip(fed, (1, 8, 15), limits):  # never cut: the whole exchange, the rest of the context
        assert ids == encode_chat(tok, history[:upto], tools=schemas)[0] and limit == 1000 - len(ids)
    assert len(fed[0]) <= 500 < len(fed[1])


def test_tools_on_an_inst_checkpoint_a_pretrained_one_or_unknown_names_are_one_error_line(tmp_path):
    nanomind = load_tokenizer(tk.NANOMIND_DIR)
    inst = chat_checkpoint(tmp_path / "inst.pt", nanomind, tokenizer_path=str(tk.NANOMIND_DIR))
    with pytest.raises(ConfigError, match=r"llama2 chat template, which cannot show tools"):
        sample.main([f"--ckpt={inst}", "--tools=builtin", "--prompt=hi", "--device=cpu"])
    pretrained = chat_checkpoint(tmp_path / "pretrain.pt", load_tokenizer(), stage="pretrain")
    with pytest.raises(ConfigError, match="needs a chat checkpoint"):
        sample.main([f"--ckpt={pretrained}", "--tools=builtin", "--prompt=hi", "--device=cpu"])
    chat = chat_checkpoint(tmp_path / "chat.pt", load_tokenizer())
    result = run_script("sample.py", f"--ckpt={chat}", "--tools=calculate_math,web_search", "--prompt=hi",
                        "--device=cpu")
    assert result.returncode == 2 and result.stderr.startswith("error: tools: unknown tool 'web_search'")
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_tiny_tool_model_answers_from_the_calculators_result(tiny_tools, demo_dir, capsys):
    """End to end on a model trained on the demo's calculator conversations, asked 4 of their questions: each call
    it writes is run and shown, and it goes on to state the result."""
    with open(demo_dir / "tools_sft.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line)["conversations"][1]["content"] for line in list(f)[:4]]
    called = stated = 0
    for question in questions:
        sample.main([f"--ckpt={tiny_tools}", "--tools=calculate_math", "--system=You are a helpful assistant.",
                     f"--prompt={question}", "--temperature=0", "--max_new_tokens=48", "--device=cpu"])
        shown = capsys.readouterr().out
        made = re.search(r'\[call\] calculate_math\(\{"expression": "(\d+) ?\* ?(\d+)"\}\)\n\[result\] (.*)\n', shown)
        if made:
            called += 1
            product = int(made[1]) * int(made[2])
            assert made[3] == json.dumps({"result": product})  # the calculator's, on the model's numbers
            stated += re.findall(r"[\d,]+", shown[made.end():])[-1:] == [str(product)]  # the turn after it
    assert called >= 3 and stated >= 2
