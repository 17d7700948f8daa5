"""
Conversations -> token ids and the loss mask, in the tokenizer's chat template (tokenizer.chat_template):
nanomind's own [INST] template ("llama2") or MiniMind's ChatML ("chatml"). Both build a conversation piece by
piece, so every token's role is known and the loss mask needs no searching for markers.

    ids, loss_mask = encode_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", ...}])
"""
import json
import re

from errors import BadRecord, DataError
from reply import CALL_END, CALL_START, THINK_END, THINK_START, split_think


# -----------------------------------------------------------------------------
# the shape of messages, whatever the template: checked here, where every reader of conversations comes through

JSON_NAMES = {str: "a string", int: "a number", float: "a number", bool: "true/false", type(None): "null",
              list: "a list", dict: "an object"}


def json_type(value) -> str:
    """What a parsed JSON value is, in JSON's words (for messages about a data file)."""
    return JSON_NAMES.get(type(value), type(value).__name__)


def check_messages(conversations) -> list[dict]:
    """conversations, checked to be a non-empty list of objects, each with a string 'role' and, where given, a string
    'content' and 'reasoning_content'; anything else is a BadRecord naming the message and the field. Which roles
    and fields a template can show is the template's to check."""
    if not isinstance(conversations, list) or not conversations:
        raise BadRecord(f"'conversations' must be a non-empty list of {{role, content}} messages, got "
                        f"{'an empty list' if conversations == [] else json_type(conversations)}")
    for i, m in enumerate(conversations):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} must be an object {{role, content}}, got {json_type(m)}")
        if not isinstance(m.get("role"), str):
            raise BadRecord(f"message {i} has no 'role'" if m.get("role") is None else
                            f"message {i}: 'role' must be a string, got {json_type(m['role'])}")
        for key in ("content", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRecord(f"message {i}: '{key}' must be a string, got {json_type(m[key])}")
        if m["role"] == "assistant" and not isinstance(m.get("reasoning_content"), str):
            check_think_block(i, m.get("content") or "")
    return conversations


def check_think_block(i: int, content: str):
    """An assistant message's content must mean the same to reply.py's grammar (the first </think> ends the think
    block, a <think> only opens it) and to the template's Jinja (the reasoning from the last <think> to the first
    </think>, the content after the last </think>); where they differ it is a BadRecord."""
    n = content.count(THINK_END)
    if n > 1:
        raise BadRecord(f"message {i}: its content holds {n} {THINK_END}: a reply's think block ends at the first, "
                        "and the chat template would drop what lies between them")
    reasoning, _ = split_think(content)
    if reasoning is not None and THINK_START in reasoning:
        raise BadRecord(f"message {i}: its think block holds a {THINK_START} after its start, where the chat "
                        "template would cut the reasoning")


# -----------------------------------------------------------------------------
# "llama2" (nanomind's own tokenizers):
#   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>   first turn, with a system prompt
#   <s>[INST] {user} [/INST] {assistant} </s>                                  every other turn

def chat_turns(conversations, system=None) -> tuple[str | None, list[tuple[str, str | None]]]:
    """Validate MiniMind-style messages -> (system, [(user, assistant), ...]). A leading {"role": "system"}
    message is the system prompt; the last turn's assistant is None when the messages end with the user."""
    for i, m in enumerate(check_messages(conversations)):
        if m["role"] not in ("system", "user", "assistant"):
            raise BadRecord(f"message {i} has unknown role {m['role']!r}: the [INST] template has system, user and "
                            "assistant only (MiniMind's ChatML one has tool)")
        extra = [k for k in ("reasoning_content", "tool_calls", "tools") if m.get(k)]
        if extra:
            raise BadRecord(f"message {i} has {extra[0]!r}, which the [INST] template cannot show "
                            "(a tokenizer with MiniMind's ChatML template can)")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise BadRecord(f"message {i} needs a non-empty string 'content'")
    if conversations[0]["role"] == "system":
        if system is not None:
            raise BadRecord("two system prompts: a 'system' field and a system message")
        system, conversations = conversations[0]["content"], conversations[1:]
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise BadRecord("'system' must be a non-empty string")
    roles = [m["role"] for m in conversations]
    if not roles or roles != ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2):
        raise BadRecord(f"roles must alternate user, assistant, ... starting with user; got {roles}")
    texts = [m["content"] for m in conversations] + [None]
    return system, [(texts[i], texts[i + 1]) for i in range(0, len(conversations), 2)]


def encode_turn(tokenizer, user: str, assistant: str | None, system: str | None) -> tuple[list[int], list[int]]:
    """One '<s>[INST] ... [/INST] ... </s>' turn -> (ids, loss_mask); ends at [/INST] when assistant is None."""
    special = tokenizer.chat_tokens
    ids = [tokenizer.bos_id] + special["[INST]"]
    if system is not None:
        ids += tokenizer.encode(" ") + special["<<SYS>>"] + tokenizer.encode(f"\n{system}\n") + special["<</SYS>>"]
        ids += tokenizer.encode(f"\n\n{user} ")
    else:
        ids += tokenizer.encode(f" {user} ")
    ids += special["[/INST]"]
    mask = [0] * len(ids)
    if assistant is not None:
        answer = tokenizer.encode(f" {assistant} ") + [tokenizer.eos_id]
        ids, mask = ids + answer, mask + [1] * len(answer)
    return ids, mask


def encode_llama2(tokenizer, conversations, system, max_len) -> tuple[list[int], list[int]]:
    system, turns = chat_turns(conversations, system)
    for first in range(len(turns)):
        encoded = [encode_turn(tokenizer, u, a, system if i == first else None)
                   for i, (u, a) in enumerate(turns) if i >= first]
        ids = [t for turn_ids, _ in encoded for t in turn_ids]
        if max_len is None or len(ids) <= max_len:
            break
    return ids, [m for _, turn_mask in encoded for m in turn_mask]


# "chatml": MiniMind's (Qwen3-style) template, the rules of its tokenizer_config.json's Jinja written out.
# Without tools, an optional system turn; a tool message is shown as a user turn holding <tool_response>s:
#   <|im_start|>system\n{system}<|im_end|>\n
#   <|im_start|>user\n{user}<|im_end|>\n
#   <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}\n<tool_call>\n{call}\n</tool_call><|im_end|>\n
#   <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
# The generation prompt closes an empty think block (MiniMind's default), or with thinking on opens one for the model
# to fill: <|im_start|>assistant\n<think>\n\n</think>\n\n, or <|im_start|>assistant\n<think>\n
# Loss: everything the assistant writes, from <think> to its <|im_end|>; not the \n after it.
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                f"{CALL_START}{CALL_END} XML tags:\n{CALL_START}\n{{\"name\": <function-name>, \"arguments\": "
                f"<args-json-object>}}\n{CALL_END}<|im_end|>\n")
GENERATION_PROMPT = f"<|im_start|>assistant\n{THINK_START}\n\n{THINK_END}\n\n"
THINKING_PROMPT = f"<|im_start|>assistant\n{THINK_START}\n"


def json_field(value, what: str):
    """MiniMind stores tools and tool_calls as JSON strings or as JSON values."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or an integer of over 4300 digits
            raise BadRecord(f"{what} is not valid JSON ({str(e)[:80]})") from None
    return value


def chatml_messages(conversations, system=None, tools=None) -> tuple[list[dict], list | None]:
    """Validate MiniMind's message fields -> (messages with tool_calls parsed, tools or None). tools: given apart
    from the messages (as OpenAI's API and apply_chat_template take them), not also on the system message."""
    check_messages(conversations)
    if system is not None:
        if not isinstance(system, str) or conversations[0]["role"] == "system":
            raise BadRecord("'system' must be a string, and not given beside a system message")
        conversations = [{"role": "system", "content": system}] + conversations
    if tools is not None and not isinstance(tools, list):
        raise BadRecord("'tools' must be a list of function descriptions")
    messages, given = [], tools
    for i, m in enumerate(conversations):
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise BadRecord(f"message {i} has unknown role {m['role']!r}: expected system, user, assistant or tool")
        role, m = m["role"], dict(m)
        if m.get("tools"):
            if i != 0 or role != "system" or given:
                raise BadRecord(f"message {i}: 'tools' belongs on the first message, a system message, once")
            tools = json_field(m["tools"], f"message {i} 'tools'")
            if not isinstance(tools, list):
                raise BadRecord(f"message {i}: 'tools' must be a list of function descriptions")
        if m.get("tool_calls"):
            if role != "assistant":
                raise BadRecord(f"message {i}: only an assistant message has 'tool_calls'")
            m["tool_calls"] = calls = json_field(m["tool_calls"], f"message {i} 'tool_calls'")
            for call in calls if isinstance(calls, list) else [None]:
                call = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
                    raise BadRecord(f"message {i}: 'tool_calls' must be a list of {{name, arguments}} "
                                    "(or {function: {name, arguments}})")
        if role == "tool" and not any(p["role"] == "assistant" and p.get("tool_calls") for p in messages):
            raise BadRecord(f"message {i} is a tool result, but no assistant message before it calls a tool")
        messages.append(m)
    return messages, tools or None


def split_reasoning(message) -> tuple[str, str]:
    """(reasoning, content) of an assistant message: its reasoning_content, else a <think> block leading its
    content."""
    content = message.get("content") or ""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"], content
    reasoning, content = split_think(content)  # one </think> at most: check_messages refuses more
    return reasoning or "", content.lstrip("\n") if reasoning is not None else content


def markup(text: str, loss: int = 0) -> tuple[str, int, bool]:
    """A piece of the template: its added tokens (<|im_start|>, <think>, ...) become their ids."""
    return text, loss, True


def data(text: str, loss: int = 0) -> tuple[str, int, bool]:
    """A piece of what the data says: always text, even where it spells an added token."""
    return text, loss, False


def chatml_pieces(messages: list[dict], tools: list | None, thinking: bool = False) -> list[tuple[str, int, bool]]:
    """Messages -> [(text, carries loss, is markup)], in MiniMind's template."""
    pieces = system_pieces(messages[0] if messages[0]["role"] == "system" else None, tools)
    for i, m in enumerate(messages):
        if m["role"] == "user" or (m["role"] == "system" and i > 0):
            pieces += [markup(f"<|im_start|>{m['role']}\n"), data(m.get("content") or ""), markup("<|im_end|>\n")]
        elif m["role"] == "assistant":
            pieces += assistant_pieces(m)
        elif m["role"] == "tool":  # consecutive tool results share one user turn
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
            pieces += [markup("<|im_start|>user")] * first + tool_pieces(m) + [markup("<|im_end|>\n")] * last
    if messages[-1]["role"] != "assistant":
        pieces.append(markup(THINKING_PROMPT if thinking else GENERATION_PROMPT))
    return pieces


def system_pieces(system: dict | None, tools: list | None) -> list[tuple[str, int, bool]]:
    """The system turn: the system message (if any), then the tools block (if any); neither: nothing."""
    if not tools and not system:
        return []
    if not tools:
        return [markup("<|im_start|>system\n"), data(system.get("content") or ""), markup("<|im_end|>\n")]
    pieces = [markup("<|im_start|>system\n")]
    if system:
        pieces += [data(system.get("content") or ""), markup("\n\n")]
    pieces.append(markup(TOOLS_HEADER))
    for tool in tools:
        pieces += [markup("\n"), data(json.dumps(tool, ensure_ascii=False))]  # Jinja's tojson as transformers has it
    return pieces + [markup(TOOLS_FOOTER)]


def assistant_pieces(message: dict) -> list[tuple[str, int, bool]]:
    """An assistant turn: everything it writes carries loss, from <think> to its <|im_end|>."""
    reasoning, content = split_reasoning(message)
    pieces = [markup("<|im_start|>assistant\n"), markup(f"{THINK_START}\n", 1), data(reasoning.strip("\n"), 1),
              markup(f"\n{THINK_END}\n\n", 1), data(content.lstrip("\n"), 1)]
    for j, call in enumerate(message.get("tool_calls") or []):
        call, separator = call.get("function", call), [markup("\n", 1)] if j > 0 or content else []
        args = call["arguments"]
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        pieces += separator + [markup(f'{CALL_START}\n{{"name": "', 1), data(call["name"], 1),
                               markup('", "arguments": ', 1), data(args, 1), markup(f"}}\n{CALL_END}", 1)]
    return pieces + [markup("<|im_end|>", 1), markup("\n")]


def tool_pieces(message: dict) -> list[tuple[str, int, bool]]:
    return [markup("\n<tool_response>\n"), data(message.get("content") or ""), markup("\n</tool_response>")]


def encode_pieces(tokenizer, pieces) -> tuple[list[int], list[int]]:
    """Pieces -> (ids, loss_mask). Markup is cut at added tokens; the text between two added tokens is encoded as
    one string (as the tokenizers library does), unless its loss changes inside it."""
    names = sorted(getattr(tokenizer, "added_tokens", {}), key=len, reverse=True)
    added = re.compile("(" + "|".join(map(re.escape, names)) + ")" if names else "(?!)")  # (?!): matches nothing
    runs: list[tuple[str | int, int]] = []  # (text to encode, or an added token's id; its loss)
    for value, loss, is_markup in pieces:
        for k, part in enumerate(added.split(value) if is_markup else [value]):
            if k % 2:  # an added token
                runs.append((tokenizer.added_tokens[part], loss))
            elif part and runs and isinstance(runs[-1][0], str) and runs[-1][1] == loss:
                runs[-1] = (runs[-1][0] + part, loss)
            elif part:
                runs.append((part, loss))
    ids, mask = [], []
    for item, loss in runs:
        new = tokenizer.encode(item) if isinstance(item, str) else [item]
        ids.extend(new)
        mask.extend([loss] * len(new))
    return ids, mask


def encode_chatml(tokenizer, conversations, system, max_len, tools=None, thinking=False):
    messages, tools = chatml_messages(conversations, system, tools)
    head = messages[:1] if messages[0]["role"] == "system" else []
    turns = [len(head)] + [i for i, m in enumerate(messages) if m["role"] == "user" and i > len(head)]
    for first in turns:  # too long: drop whole earliest turns (a turn starts at a user message)
        ids, mask = encode_pieces(tokenizer, chatml_pieces(head + messages[first:], tools, thinking))
        if max_len is None or len(ids) <= max_len:
            break
    return ids, mask


def tool_results_ids(tokenizer, results: list[str], thinking: bool = False) -> list[int]:
    """What follows an assistant turn that called tools and ended with <|im_end|>: its tool results (one per call,
    in one user turn) and the next generation prompt -- the ids encode_chat gives after that turn."""
    if tokenizer.chat_template != "chatml":
        raise DataError("this tokenizer's chat template cannot show tool results: tools need MiniMind's ChatML one")
    pieces = [markup("\n<|im_start|>user")] + [p for r in results for p in tool_pieces({"content": r})]
    pieces += [markup("<|im_end|>\n"), markup(THINKING_PROMPT if thinking else GENERATION_PROMPT)]
    return encode_pieces(tokenizer, pieces)[0]


def encode_chat(tokenizer, conversations, system=None, max_len=None, tools=None,
                thinking=False) -> tuple[list[int], list[int]]:
    """Messages -> (input_ids, loss_mask) in the tokenizer's chat template, loss_mask 1 exactly on what the
    assistant writes and its end-of-turn token (</s> or <|im_end|>). Messages that do not end with the
    assistant end with the generation prompt (... [/INST] or <|im_start|>assistant ...).
    Too long for max_len: whole earliest turns are dropped (the system prompt stays);
    a last turn that alone is too long is cut at the end (its answer then lacks its end-of-turn token).
    tools: function descriptions given apart from the messages; thinking: the generation prompt opens a think
    block (MiniMind's open_thinking, transformers' enable_thinking); both need the ChatML template."""
    if tokenizer.chat_template == "llama2":
        if tools or thinking:
            raise DataError(f"this tokenizer's [INST] chat template cannot show {'tools' if tools else 'thinking'} "
                            "(a tokenizer with MiniMind's ChatML template can)")
        ids, mask = encode_llama2(tokenizer, conversations, system, max_len)
    elif tokenizer.chat_template == "chatml":
        ids, mask = encode_chatml(tokenizer, conversations, system, max_len, tools, thinking)
    else:
        raise DataError("this tokenizer's chat_template (tokenizer_config.json) is neither ChatML nor absent: "
                        "nanomind renders only ChatML (MiniMind's) and its own [INST] template")
    return ids[:max_len], mask[:max_len]


def show_mask(tokenizer, ids, loss_mask) -> str:
    """One line per token: position, id, ✓ (carries loss) or ✗, and the token's text."""
    return "\n".join(f"{i:5d} {t:6d} {'✓' if m else '✗'} {tokenizer.decode([t])!r}"
                     for i, (t, m) in enumerate(zip(ids, loss_mask)))
