"""
The grammar of an assistant turn (a model's reply), stated once and parsed here, whole or as it streams, so that a
reply means the same to the CLI, the server, eval, RL rollouts, the rewards and the chat template.

    turn     := [think] content
    think    := ["<think>"] reasoning "</think>"      the FIRST </think> ends it (a stream cannot look ahead)
    content  := (text | block)*                        a later </think> is text
    block    := "<tool_call>" JSON "</tool_call>"      up to the first </tool_call> after its opening

- Whether a turn has a think block: streamed, the prompt says (thinking on: the generation prompt opened the block,
  so the turn starts inside it); whole, a </think> in the text says (the prompt opened it, or the model wrote
  <think>). A think block that never closes is all reasoning. One <think> at its start (after newlines) is dropped.
- A block whose JSON is a call -- {"name", "arguments": an object or its JSON text}, or OpenAI's {"function": ...};
  the name 1-64 letters, digits, _ or - -- is a call. Any other block stays in the content as text and counts as
  malformed; so does an opening that never closes (the rest of the turn is then content).
- The reasoning is stripped of newlines at both ends; the content, when the turn is taken apart (thinking or
  calls), of whitespace.

    reply = parse_reply(text)                     # -> Reply(reasoning, content, calls, malformed)
    stream = ReplyStream(thinking, calls=True)    # stream.feed(piece) -> [("reasoning" | "content", text) |
    parts = stream.feed(piece) + stream.finish()  #                        ("call", {index, id, name, arguments})]

parse_reply is the stream fed the whole text at once: one implementation, so the two cannot disagree.
"""
import dataclasses
import json
import re
import uuid

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclasses.dataclass
class Reply:
    """An assistant turn's text taken apart."""
    reasoning: str | None  # the think block's text (None: the turn has none)
    content: str  # what is left for the user: the text without the think block and without its calls
    calls: list[dict]  # [{"name": str, "arguments": dict}] in the order written
    malformed: int  # <tool_call> blocks that are not calls (they stay in content), an unclosed one included

    def as_message(self) -> dict:
        """The turn as the assistant message of a conversation that goes on from its calls."""
        said = {"role": "assistant", "content": self.content, "tool_calls": self.calls}
        return said | ({"reasoning_content": self.reasoning} if self.reasoning else {})


def as_call(value) -> dict | None:
    """{"name", "arguments": an object or its JSON text} (or OpenAI's {"function": {...}}) -> {"name", "arguments":
    dict}, or None when it is not a call."""
    value = value.get("function", value) if isinstance(value, dict) else value
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not NAME.fullmatch(value["name"]):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # a model may write the arguments as a JSON string, as OpenAI's wire format does
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    return {"name": value["name"], "arguments": arguments} if isinstance(arguments, dict) else None


def parse_call(block: str) -> dict | None:
    """The text inside <tool_call></tool_call> -> {"name", "arguments": dict}, or None when it is not a call."""
    try:
        return as_call(json.loads(block))
    except (ValueError, RecursionError):  # not JSON; a number of over 4300 digits; nested too deeply
        return None


def call_text(call: dict) -> str:
    """A call as the template writes it (and a model trained on it does)."""
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return f'{CALL_START}\n{{"name": "{call["name"]}", "arguments": {arguments}}}\n{CALL_END}'


class Trimmed:
    """Text sent in pieces as if stripped of chars at both ends (None: whitespace, "": nothing): the leading ones
    dropped, trailing ones held until more text follows them."""

    def __init__(self, chars: str | None):
        self.chars, self.started, self.held = chars, False, ""

    def add(self, text: str) -> str:
        text = self.held + text if self.started else text.lstrip(self.chars)
        body = text.rstrip(self.chars)
        self.held, self.started = text[len(body):], self.started or bool(body)
        return body


class ReplyStream:
    """A turn's text pieces -> its parts as soon as they are certain: ("reasoning", text) inside the think block
    (thinking: the turn starts in it), ("content", text), and ("call", {index, id, name, arguments: JSON text}, as
    OpenAI's API sends a call) for each block that is a call (calls on; off, blocks are text). Text that may still
    become a marker is held back. self.calls and self.malformed count what the turn wrote. raw: the content as
    written, not stripped."""

    def __init__(self, thinking: bool = False, calls: bool = False, opening: str = "", raw: bool = False):
        self.thinking, self.in_think, self.opened = thinking, thinking, False  # opened: a leading <think> ruled on
        self.pending = opening  # text not yet sent: a forced call's opening (the prompt ends with it) comes first
        self.parse_calls, self.calls, self.malformed = calls, [], 0
        # taken apart, content is stripped; otherwise it is the text as generated
        self.trimmed = {"reasoning": Trimmed("\n"), "content": Trimmed("" if raw or not (thinking or calls) else None)}

    def feed(self, text: str) -> list[tuple[str, str | dict]]:
        self.pending += text
        parts = []
        if self.in_think:
            if not self.opened and not self.drop_think_start():
                return []  # may still be a leading <think>
            end = self.pending.find(THINK_END)
            if end < 0:
                return self.send("reasoning", len(self.pending) - self.may_begin(THINK_END))
            parts += self.send("reasoning", end)
            self.pending, self.in_think = self.pending[len(THINK_END):], False
        while self.parse_calls and (start := self.pending.find(CALL_START)) >= 0:
            parts += self.send("content", start)
            end = self.pending.find(CALL_END)  # the first one after the opening
            if end < 0:
                return parts  # held until its </tool_call> comes
            block, self.pending = self.pending[: end + len(CALL_END)], self.pending[end + len(CALL_END):]
            call = parse_call(block[len(CALL_START) : -len(CALL_END)].strip())
            try:
                arguments = json.dumps(call["arguments"], ensure_ascii=False) if call else None
            except (ValueError, RecursionError):  # a value JSON cannot write back: not a call the API can send
                call = None
            if call is None:
                self.malformed += 1
                parts += self.trim("content", block)
                continue
            self.calls.append(call)
            parts.append(("call", {"index": len(self.calls) - 1, "id": f"call_{uuid.uuid4().hex[:24]}",
                                   "name": call["name"], "arguments": arguments}))
        held = self.may_begin(CALL_START) if self.parse_calls else 0
        return parts + self.send("content", len(self.pending) - held)

    def drop_think_start(self) -> bool:
        """Rule on a leading <think> (after newlines), dropping it: False while the text may still become one."""
        head = self.pending.lstrip("\n")
        if head.startswith(THINK_START):
            self.pending = head[len(THINK_START):]
        elif THINK_START.startswith(head):
            return False
        self.opened = True
        return True

    def finish(self) -> list[tuple[str, str]]:
        """What is left when the turn ends: an unclosed think block is reasoning, an unclosed call content."""
        self.malformed += not self.in_think and self.parse_calls and self.pending.startswith(CALL_START)
        return self.send("reasoning" if self.in_think else "content", len(self.pending))

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.calls and finish == "stop" else finish

    def may_begin(self, marker: str) -> int:
        """The length of the pending text's end that may be the beginning of marker: a marker's one < is its first
        character, so only the last < among the pending text's last len(marker) - 1 characters can begin it."""
        start = self.pending.rfind("<", max(0, len(self.pending) - len(marker) + 1))
        return len(self.pending) - start if start >= 0 and marker.startswith(self.pending[start:]) else 0

    def send(self, kind: str, n: int) -> list[tuple[str, str]]:
        text, self.pending = self.pending[:n], self.pending[n:]
        return self.trim(kind, text)

    def trim(self, kind: str, text: str) -> list[tuple[str, str]]:
        text = self.trimmed[kind].add(text)
        return [(kind, text)] if text else []


def take_apart(text: str, thinking: bool, calls: bool, raw: bool = False) -> tuple[ReplyStream, dict[str, str]]:
    """A whole turn through the stream -> (the stream, for its calls and malformed count; {"reasoning", "content"})."""
    stream = ReplyStream(thinking, calls, raw=raw)
    parts = stream.feed(text) + stream.finish()
    return stream, {kind: "".join(v for k, v in parts if k == kind) for kind in ("reasoning", "content")}


def parse_reply(text: str, thinking: bool | None = None) -> Reply:
    """A whole turn -> its think block, its calls and the rest. thinking: whether the turn starts inside a think
    block (None: whether the text holds a </think>)."""
    thinking = THINK_END in text if thinking is None else thinking
    stream, parts = take_apart(text, thinking, calls=True)
    return Reply(parts["reasoning"] if thinking else None, parts["content"], stream.calls, stream.malformed)


def split_think(text: str) -> tuple[str | None, str]:
    """A whole turn -> (its think block's text, None without a </think>; the text after the block, as written)."""
    thinking = THINK_END in text
    _, parts = take_apart(text, thinking, calls=False, raw=True)
    return (parts["reasoning"] if thinking else None), parts["content"]


def written_calls(turns: list[dict], last: str) -> tuple[list[dict], int]:
    """The calls a conversation's turns wrote -> (the calls, {"name", "arguments": dict}, in order; the blocks
    that were not calls). turns: its messages after the prompt (their assistant tool_calls and content); last: the
    last turn's text, whose calls were never run."""
    written = [as_call(c) for m in turns if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
    replies = [parse_reply(m.get("content") or "") for m in turns if m.get("role") == "assistant"]
    replies.append(parse_reply(last))
    calls = [c for c in written if c is not None] + replies[-1].calls
    return calls, written.count(None) + sum(r.malformed for r in replies)
