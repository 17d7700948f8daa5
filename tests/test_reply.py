"""reply.py: one grammar of an assistant turn. The whole parse (parse_reply) and the streamed one (ReplyStream) give
the same reasoning, content, calls and malformed count however the text is cut into pieces, markers split at every
position included; and the grammar's rules hold: the first </think> ends the think block, a leading <think> is
dropped, a block is a call only when its JSON is one, an unclosed block is content and malformed."""
import json
import random
import re

import pytest

from reply import THINK_END, THINK_START, Reply, ReplyStream, call_text, parse_call, parse_reply, split_think

CALC = {"name": "calculate_math", "arguments": {"expression": "37*48"}}
CALL = call_text(CALC)
REPLIES = [
    "", "Hello.", "  \n Hello, world.\n ", "答案是1776。😀",  # plain
    "<think>\nhmm\n</think>\n\nIt is 7.", "hmm</think>7", "\n<think>\nx\n</think>y", "<think></think>", "</think>",
    "<think><think>x</think>y", "a</think>b</think> c ", "one < two </think> <thi", "<think",  # think blocks
    CALL, f"Let me compute.\n{CALL}", f"{CALL}\n{CALL}", f"Before {CALL} after", f"I should.\n</think>\n\n{CALL}",
    f"<think>\nmaybe {CALL}\n</think>\n\nNo.",  # calls
    "<tool_call>oops</tool_call>", f"<tool_call>oops</tool_call>{CALL}", '<tool_call>{"name": "a b"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', f"<tool_call>{CALL}",  # broken calls
    f'{CALL}\n<tool_call>\n{{"name": "calculate_math", "argum', "x <tool_call>", "ends with <tool_c", "</tool_call>",
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call> done', "a <b> <<tool_call>",  # and the rest
]


def naive(text: str) -> Reply:
    """The grammar by regex on the whole text: the oracle the stream is checked against."""
    reasoning = None
    if THINK_END in text:
        head, text = text.split(THINK_END, 1)
        head = head.lstrip("\n")
        reasoning = head.removeprefix(THINK_START).strip("\n")
    calls, kept, malformed, end = [], [], 0, 0
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        call = parse_call(match.group(1).strip())
        kept.append(text[end : match.start()] if call else text[end : match.end()])
        malformed += call is None
        calls += [call] if call else []
        end = match.end()
    malformed += "<tool_call>" in text[end:]
    return Reply(reasoning, ("".join(kept) + text[end:]).strip(), calls, malformed)


def streamed(text: str, pieces: list[str]) -> Reply:
    """text fed to a ReplyStream in pieces (the think block known as parse_reply knows it: a </think> in the text),
    its parts joined back into a Reply."""
    thinking = THINK_END in text
    stream = ReplyStream(thinking, calls=True)
    parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    joined = {kind: "".join(v for k, v in parts if k == kind) for kind in ("reasoning", "content")}
    calls = [{"name": v["name"], "arguments": json.loads(v["arguments"])} for k, v in parts if k == "call"]
    assert calls == stream.calls and [v["index"] for k, v in parts if k == "call"] == list(range(len(calls)))
    return Reply(joined["reasoning"] if thinking else None, joined["content"], calls, stream.malformed)


@pytest.mark.parametrize("text", REPLIES)
def test_whole_and_streamed_agree_wherever_the_text_is_cut(text):
    whole = parse_reply(text)
    assert whole == naive(text)
    assert streamed(text, list(text)) == whole  # a character at a time
    for i in range(len(text) + 1):  # in two pieces, cut at every position (every marker split every way)
        assert streamed(text, [text[:i], text[i:]]) == whole, i
    for i in range(0, len(text) + 1, 3):  # in three
        for j in range(i, len(text) + 1):
            assert streamed(text, [text[:i], text[i:j], text[j:]]) == whole, (i, j)


def test_random_replies_in_random_pieces_agree():
    pieces = ["Sure.", " ", "\n", CALL, "<tool_call>\n{broken\n</tool_call>", "<tool_call>", "</tool_call>", "<think>",
              "</think>", "<tool_c", "</thi", "<", "37*48 = 1776", "答案是1776。😀"]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choices(pieces, k=rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        whole = parse_reply(text)
        assert whole == naive(text), text
        assert streamed(text, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]) == whole, text


def test_the_grammar():
    # the first </think> ends the think block; a second is text; one leading <think> (after newlines) is dropped
    assert parse_reply("a</think>b</think> c ") == Reply("a", "b</think> c", [], 0)
    assert parse_reply("\n<think>\nI should multiply.\n</think>\n\n7") == Reply("I should multiply.", "7", [], 0)
    assert parse_reply("<think><think>x</think>y").reasoning == "<think>x"
    assert parse_reply("<think>no end").reasoning is None  # whole, no </think>: no think block
    assert parse_reply("still thinking\n", thinking=True) == Reply("still thinking", "", [], 0)  # the prompt opened it
    # calls: a block whose JSON is a call; another stays content and is malformed; so is an unclosed one
    assert parse_reply(f"Let me.\n{CALL}\n<tool_call>oops</tool_call>") == Reply(
        None, "Let me.\n\n<tool_call>oops</tool_call>", [CALC], 1)
    assert parse_reply(f'{CALL}<tool_call>{{"name"') == Reply(None, '<tool_call>{"name"', [CALC], 1)
    assert parse_reply(f"<think>{CALL}</think>").calls == []  # a call inside the think block is reasoning
    # streamed, the prompt says whether the turn starts in a think block: thinking off, </think> is content
    stream = ReplyStream(thinking=False, calls=True)
    assert stream.feed("a</think>b") + stream.finish() == [("content", "a</think>b")]
    # a forced call's opening (the prompt ends with it) comes first
    stream = ReplyStream(calls=True, opening="<tool_call>\n")
    (kind, call), = stream.feed(CALL[len("<tool_call>\n"):]) + stream.finish()
    assert kind == "call" and json.loads(call["arguments"]) == CALC["arguments"]
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_split_think_keeps_the_content_as_written():
    """The chat template's and the rewards' split: the reasoning as the grammar reads it, the rest untouched."""
    assert split_think("\n<think>\nabc\n</think>\n\n  x \n") == ("abc", "\n\n  x \n")
    assert split_think("a</think>b</think>") == ("a", "b</think>")
    assert split_think(f"no think {CALL} ") == (None, f"no think {CALL} ")


def test_a_calling_turn_as_a_message():
    assert parse_reply(f"<think>\nr\n</think>\n\nok {CALL}").as_message() == {
        "role": "assistant", "content": "ok", "tool_calls": [CALC], "reasoning_content": "r"}
    assert "reasoning_content" not in parse_reply(CALL).as_message()
