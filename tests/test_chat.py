"""Both chat templates and their loss masks: [INST] against a golden conversation, MiniMind's ChatML token for token
against transformers' apply_chat_template; each mask covers exactly what the assistant writes."""
import ast
import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from chat import encode_chat, show_mask
from conftest import CONVERSATION
from errors import BadRecord
from token_cache import encode_dpo, encode_sft, tokenize_file
from tokenizer import DEFAULT_DIR, load_tokenizer


# --- [INST]: nanomind's own tokenizer -----------------------------------------------------------

def runs(ids, mask):
    """Split a sequence into maximal runs of equal mask value: [(mask value, ids)]."""
    out = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def test_golden_chat_template_and_mask(tok):
    ids, mask = encode_chat(tok, CONVERSATION)
    assert tok.decode(ids) == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is the capital of France? [/INST]"
        " The capital of France is Paris. </s>"
        "<s>[INST] 法国在哪里？ [/INST] 法国位于欧洲。 </s>")
    # loss exactly on each assistant answer and its </s>; everything else (<s>, [INST], system, user, [/INST]) off
    learned = [tok.decode(r) for m, r in runs(ids, mask) if m == 1]
    assert learned == [" The capital of France is Paris. </s>", " 法国位于欧洲。 </s>"]
    assert [m for t, m in zip(ids, mask) if t == tok.eos_id] == [1, 1]
    specials = {tok.bos_id, *[t for name in ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>") for t in tok.chat_tokens[name]]}
    assert all(m == 0 for t, m in zip(ids, mask) if t in specials)


def test_chat_special_tokens_are_single_ids(tok):
    ids, _ = encode_chat(tok, CONVERSATION)
    for name in ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"):
        assert len(tok.chat_tokens[name]) == 1
    assert ids.count(tok.bos_id) == 2 and ids.count(tok.chat_tokens["<<SYS>>"][0]) == 1


def test_a_generation_prompt_ends_at_inst_close(tok):
    ids, mask = encode_chat(tok, CONVERSATION[:4])
    assert ids[-1] == tok.chat_tokens["[/INST]"][0]
    full, _ = encode_chat(tok, CONVERSATION)
    assert full[: len(ids)] == ids  # the prompt the chat CLI feeds is exactly what training saw


def test_too_long_drops_earliest_turns_and_keeps_the_system_prompt(tok):
    full, _ = encode_chat(tok, CONVERSATION)
    last_turn, _ = encode_chat(tok, [CONVERSATION[0]] + CONVERSATION[3:])
    ids, mask = encode_chat(tok, CONVERSATION, max_len=len(full) - 1)
    assert ids == last_turn and tok.decode(ids).startswith("<s>[INST] <<SYS>>\nYou are terse.")
    # a single turn that cannot fit is cut at the end; its answer loses the closing </s>
    one_turn, one_mask = encode_chat(tok, CONVERSATION[:3])
    ids, mask = encode_chat(tok, CONVERSATION[:3], max_len=len(one_turn) - 3)
    assert (ids, mask) == (one_turn[:-3], one_mask[:-3]) and ids[-1] != tok.eos_id and mask[-1] == 1


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "assistant", "content": "hi"}], "alternate"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}], "non-empty"),
    ([{"role": "robot", "content": "a"}], "unknown role"),
    ([], "non-empty list"),
])
def test_bad_conversations_are_rejected(tok, messages, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_chat(tok, messages)


def test_show_mask_marks_every_token(tok):
    ids, mask = encode_chat(tok, CONVERSATION[1:3])
    assert 0 < sum(mask) < len(mask)
    lines = show_mask(tok, ids, mask).splitlines()
    assert len(lines) == len(ids)
    for i, line in enumerate(lines):  # "position id mark 'text'": the text is the repr of the token's decoding
        position, token, mark, text = line.split(maxsplit=3)
        assert (int(position), int(token), mark) == (i, ids[i], "✓" if mask[i] else "✗"), line
        assert ast.literal_eval(text) == tok.decode([ids[i]]), line
    assert lines[0].split() == ["0", str(tok.bos_id), "✗", "'<s>'"]
    assert lines[-1].split() == [str(len(ids) - 1), str(tok.eos_id), "✓", "'</s>'"]


# --- ChatML: MiniMind's tokenizer and tokenizer_config.json ---------------------------------------

MINIMIND = DEFAULT_DIR  # MiniMind's, the default
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "查询城市天气",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "current time", "parameters": {}}}
TOOLS = json.dumps([WEATHER, CLOCK], ensure_ascii=False)

# MiniMind's record format: tools as a JSON string on the system message, tool_calls as a JSON string or a list
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！我是 minimind。"}],
    "system, several turns": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "(2 + 3) × 4 = 20 🎉"}],
    "reasoning_content": [
        {"role": "user", "content": "17 是质数吗？"},
        {"role": "assistant", "content": "是的。", "reasoning_content": "\n17 只能被 1 和 17 整除。\n"}],
    "think inside content": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 42."}],
    "tools, calls, results": [
        {"role": "system", "content": "你是一个助手。", "tools": TOOLS},
        {"role": "user", "content": "北京天气怎么样？现在几点？"},
        {"role": "assistant", "content": "",
         "tool_calls": json.dumps([{"name": "get_weather", "arguments": {"city": "北京"}},
                                   {"name": "now", "arguments": "{}"}], ensure_ascii=False)},
        {"role": "tool", "content": '{"weather": "晴", "temp": 21}'},
        {"role": "tool", "content": '{"time": "10:00"}'},
        {"role": "assistant", "content": "北京晴，21°C；现在 10:00。"}],
    "call with content, object arguments": [
        {"role": "system", "content": "", "tools": [WEATHER]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool said sunny."}],
    "code and whitespace": [
        {"role": "user", "content": "def f(x):\n    return x  # why?\n\n\n"},
        {"role": "assistant", "content": "\n\n  It returns x.\t \n"}],
    "generation prompt": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "再见 👋"}],
    "generation prompt after tool results": [
        {"role": "system", "content": "", "tools": TOOLS},
        {"role": "user", "content": "几点了"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "now", "arguments": {}}]},
        {"role": "tool", "content": "10:00"}],
    "system later in the conversation": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "system", "content": "Now answer in French."}, {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"}],
    "empty reasoning and content": [
        {"role": "user", "content": "?"}, {"role": "assistant", "content": "", "reasoning_content": ""}],
    "tools, assistant content a newline": [
        {"role": "system", "content": "Use tools.", "tools": TOOLS},
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "\n", "tool_calls": '[{"name": "now", "arguments": {}}]'},
        {"role": "tool", "content": "noon"}, {"role": "assistant", "content": "It is noon."}],
}


@pytest.fixture(scope="module")
def ours():
    tok = load_tokenizer(MINIMIND)
    assert tok.chat_template == "chatml"
    return tok


@pytest.fixture(scope="module")
def library():
    return AutoTokenizer.from_pretrained(str(MINIMIND))


def library_inputs(messages):
    """What MiniMind's SFTDataset hands apply_chat_template: tools from the system message, tool_calls parsed."""
    tools, parsed = None, []
    for m in messages:
        m = dict(m)
        if m.get("role") == "system" and m.get("tools"):
            tools = json.loads(m["tools"]) if isinstance(m["tools"], str) else m["tools"]
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
        parsed.append(m)
    return parsed, tools


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_ids_equal_apply_chat_template(ours, library, name):
    messages = CONVERSATIONS[name]
    parsed, tools = library_inputs(messages)
    generation = messages[-1]["role"] != "assistant"
    expected = library.apply_chat_template(parsed, tools=tools, tokenize=True, add_generation_prompt=generation,
                                           return_dict=False)
    ids, mask = encode_chat(ours, messages)
    assert ids == expected
    assert len(mask) == len(ids)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_loss_mask_is_what_the_assistant_writes(ours, library, name):
    """Each run of loss tokens decodes to one assistant turn as the library renders it, from <think> through
    <|im_end|>; nothing else (system, user, tool results, <|im_start|>assistant\\n, the \\n after) carries loss."""
    messages = CONVERSATIONS[name]
    parsed, tools = library_inputs(messages)
    text = library.apply_chat_template(parsed, tools=tools, tokenize=False,
                                       add_generation_prompt=messages[-1]["role"] != "assistant")
    expected = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, flags=re.S)
    ids, mask = encode_chat(ours, messages)
    runs, run = [], []
    for token, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(token)
        elif run:
            runs, run = runs + [ours.decode(run)], []
    assert runs == expected
    assert len(runs) == sum(m["role"] == "assistant" for m in messages)


def test_special_token_text_in_data_stays_text(ours):
    """A user who types <|im_end|> or <think> does not end the turn or open a think block (the library would
    match them: the one deliberate difference)."""
    ids, _ = encode_chat(ours, [{"role": "user", "content": "<|im_end|><think>"}, {"role": "assistant", "content": "ok"}])
    user = ids[ids.index(ours.added_tokens["<|im_start|>"]) + 1: ids.index(ours.added_tokens["<|im_end|>"])]
    assert ours.decode(user) == "user\n<|im_end|><think>"
    assert ours.added_tokens["<think>"] not in user and ours.added_tokens["<|im_end|>"] not in user


def test_too_long_drops_earliest_turns_and_keeps_the_system_block(ours):
    messages = CONVERSATIONS["tools, calls, results"] + [
        {"role": "user", "content": "谢谢"}, {"role": "assistant", "content": "不客气。"}]
    full, _ = encode_chat(ours, messages)
    last_turn, last_mask = encode_chat(ours, messages[:1] + messages[-2:])
    assert len(last_turn) < len(full)
    assert encode_chat(ours, messages, max_len=len(full) - 1) == (last_turn, last_mask)
    assert encode_chat(ours, messages, max_len=len(last_turn) - 3) == (last_turn[:-3], last_mask[:-3])


def test_sft_record_ends_at_the_last_im_end(ours):
    """encode_sft keeps the conversation up to the last <|im_end|>: the closing \\n carries no loss."""
    messages = CONVERSATIONS["system, several turns"]
    (ids, mask), notes = encode_sft(ours, {"conversations": messages})
    full, full_mask = encode_chat(ours, messages)
    assert list(ids) == full[:-1] and list(mask) == full_mask[:-1] and ids[-1] == ours.eos_id and notes == []


def test_dpo_answers_are_the_sft_answer_tokens(ours):
    """A DPO pair in MiniMind's message-list format: the prompt ends with <|im_start|>assistant\\n and each answer
    is exactly the loss tokens SFT would train on, think block and <|im_end|> included."""
    prompt = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hi"}]
    chosen, rejected = {"role": "assistant", "content": "Hi! 😊"}, {"role": "assistant", "content": "No."}
    (p, c, r), notes = encode_dpo(ours, {"chosen": prompt + [chosen], "rejected": prompt + [rejected]})
    for answer, ids in ((chosen, c), (rejected, r)):
        full, mask = encode_chat(ours, prompt + [answer])
        assert list(p) + list(ids) == full[:-1]
        assert [m for m in mask[:-1]] == [0] * len(p) + [1] * len(ids)
    assert ours.decode(list(p)).endswith("<|im_start|>assistant\n") and ours.decode(list(c)) == (
        "<think>\n\n</think>\n\nHi! 😊<|im_end|>")


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": "[{not json"}],
     "tool_calls' is not valid JSON"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "b"}],
     "no assistant message before it calls a tool"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}],
     "name, arguments"),
    ([{"role": "user", "content": "a", "tools": TOOLS}, {"role": "assistant", "content": "b"}],
     "'tools' belongs on the first message"),
    ([{"role": "system", "content": "s", "tools": "{oops"}, {"role": "user", "content": "a"}], "tools' is not valid"),
    ([{"role": "robot", "content": "a"}], "unknown role"),
    ([{"role": "user", "content": 3}], "'content' must be a string"),
])
def test_malformed_records_are_clear_errors(ours, messages, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_chat(ours, messages)


def test_file_line_of_a_malformed_record(ours, tmp_path):
    good = {"conversations": CONVERSATIONS["tools, calls, results"]}
    bad = {"conversations": [{"role": "user", "content": "a"}, {"role": "tool", "content": "r"},
                             {"role": "assistant", "content": "b"}]}
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in (good, good, bad)), encoding="utf-8")
    with pytest.raises(BadRecord, match=r"sft\.jsonl:3: .*no assistant message before it calls a tool"):
        tokenize_file(str(path), ours, "sft", processes=1, verbose=False)


@pytest.mark.parametrize("content, reason", [
    ("<think>a</think>b</think>c", "message 1: its content holds 2 </think>"),
    ("a<think>b</think>c", "message 1: its think block holds a <think> after its start"),
    ("<think><think>b</think>c", "message 1: its think block holds a <think> after its start"),
])
def test_a_reply_the_template_would_read_otherwise_than_reply_py_is_refused(ours, tmp_path, content, reason):
    """One grammar (reply.py): a think block ends at the first </think>, and only a <think> at its start opens it.
    The template's Jinja reads these contents otherwise, so ids equal to apply_chat_template's would mean something
    else to the CLI, the server and the rewards: the record is refused, naming its file:line. Beside
    reasoning_content the content is not split, and the record is taken."""
    record = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(BadRecord, match=rf"sft\.jsonl:1: {reason}"):
        tokenize_file(str(path), ours, "sft", processes=1, verbose=False)
    given = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content, "reasoning_content": "r"}]
    assert encode_chat(ours, given)[1]


def test_the_inst_template_names_chatml_for_tool_data(tok):
    assert tok.chat_template == "llama2"
    with pytest.raises(BadRecord, match="ChatML"):
        encode_chat(tok, CONVERSATIONS["tools, calls, results"][1:])
    with pytest.raises(BadRecord, match="reasoning_content.*ChatML"):
        encode_chat(tok, CONVERSATIONS["reasoning_content"])


def test_minimind_tokenizer_through_pretrain_sft_and_sample(demo_dir, tmp_path, library, monkeypatch):
    """Pretraining with MiniMind's tokenizer records it (and its ChatML template) in the checkpoint; SFT on
    tool-calling records finds it there without --tokenizer_path and refuses another; sample.py prompts in
    the library's generation prompt."""
    import sample
    import train_pretrain
    import train_sft
    from conftest import TINY_MODEL, TINY_RUN
    from tokenizer import TokenizerError

    pre, sft = tmp_path / "pretrain", tmp_path / "sft"
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={pre}", f"--tokenizer_path={MINIMIND}",
                         *TINY_MODEL, *TINY_RUN, "--batch_size=8", "--warmup_steps=2", "--max_steps=4",
                         "--eval_interval=4", "--max_seq_len=64"])
    data = tmp_path / "sft.jsonl"
    records = [{"conversations": c} for c in CONVERSATIONS.values() if c[-1]["role"] == "assistant"]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records * 4), encoding="utf-8")
    args = [f"--init_from={pre}/best.pt", f"--data_path={data}", *TINY_RUN, "--batch_size=4", "--max_steps=3",
            "--eval_interval=3", "--max_seq_len=64", "--val_fraction=0.25"]
    with pytest.raises(TokenizerError, match="not the one the checkpoint was trained with"):
        train_sft.main([*args, f"--out_dir={tmp_path / 'wrong'}", "--tokenizer_path=vocab/nanomind"])
    train_sft.main([*args, f"--out_dir={sft}"])
    state = torch.load(sft / "best.pt", weights_only=False)
    assert state["config"]["tokenizer_path"] == str(MINIMIND)
    assert state["tokenizer"]["chat_template"] == "chatml"

    fed = []
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, *rest: fed.append(ids) or "")
    sample.main([f"--ckpt={sft / 'best.pt'}", "--prompt=北京天气？", "--system=Be brief.", "--max_new_tokens=8"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "北京天气？"}]
    assert fed == [library.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)]
