"""
From raw JSONL to the (X, Y, loss_mask) batches the training scripts consume.

  pretrain  {"text": ...} lines or .txt files  -> <s> doc </s> packed end to end into windows of max_seq_len + 1
  sft       {"conversations": [...]}           -> the tokenizer's chat template; loss on what the assistant writes
  dpo       {"prompt","chosen","rejected"} or {"chosen": [msgs], "rejected": [msgs]} -> prompt + two answers

data_path names one file, a glob pattern ("data/pretrain_*.jsonl") or several of them separated by commas;
the files are read as one, in that order (each pattern's matches sorted). Each file is tokenised once, in
parallel processes, into FILE.<kind>.cache beside it (under ~/.cache/nanomind if its directory is read-only),
streamed to disk chunk by chunk so that memory does not grow with the file; the cache is reused while the file,
the tokenizer and the encoding options are unchanged, and rebuilt (atomically) when any of them changes.
Training reads the caches memory-mapped: a corpus of many GB never has to fit in RAM.
"""
import bisect
import contextlib
import datetime
import glob
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter, deque

import numpy as np
import torch

from tokenizer import load_tokenizer  # noqa: F401  (data.load_tokenizer is the documented entry point)


class DataError(ValueError):
    """A data file that cannot train: missing, malformed, or too small for the batch asked for."""


class BadRecord(DataError):
    pass


# -----------------------------------------------------------------------------
# chat templates: the tokenizer says which (tokenizer.chat_template). Both build a conversation piece by piece,
# so every token's role is known and the loss mask needs no searching for markers.
#
# "llama2" (nanomind's own tokenizers):
#   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>   first turn, with a system prompt
#   <s>[INST] {user} [/INST] {assistant} </s>                                  every other turn

def chat_turns(conversations, system=None) -> tuple[str | None, list[tuple[str, str | None]]]:
    """Validate MiniMind-style messages -> (system, [(user, assistant), ...]). A leading {"role": "system"}
    message is the system prompt; the last turn's assistant is None when the messages end with the user."""
    if not isinstance(conversations, list) or not conversations:
        raise BadRecord("'conversations' must be a non-empty list of {role, content} messages")
    for i, m in enumerate(conversations):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRecord(f"message {i} has unknown role {m.get('role') if isinstance(m, dict) else m!r}: the "
                            "[INST] template has system, user and assistant only (MiniMind's ChatML one has tool)")
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
# The generation prompt is the non-thinking one: <|im_start|>assistant\n<think>\n\n</think>\n\n
# Loss: everything the assistant writes, from <think> to its <|im_end|>; not the \n after it.
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n")
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def json_field(value, what: str):
    """MiniMind stores tools and tool_calls as JSON strings or as JSON values."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRecord(f"{what} is not valid JSON ({e})") from None
    return value


def chatml_messages(conversations, system=None) -> tuple[list[dict], list | None]:
    """Validate MiniMind's message fields -> (messages with tool_calls parsed, tools or None)."""
    if not isinstance(conversations, list) or not conversations:
        raise BadRecord("'conversations' must be a non-empty list of messages")
    if system is not None:
        if not isinstance(system, str) or conversations[0].get("role") == "system":
            raise BadRecord("'system' must be a string, and not given beside a system message")
        conversations = [{"role": "system", "content": system}] + conversations
    messages, tools = [], None
    for i, m in enumerate(conversations):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise BadRecord(f"message {i} has unknown role {m.get('role') if isinstance(m, dict) else m!r}: "
                            "expected system, user, assistant or tool")
        role, m = m["role"], dict(m)
        for key in ("content", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRecord(f"message {i}: '{key}' must be a string")
        if m.get("tools"):
            if i != 0 or role != "system":
                raise BadRecord(f"message {i}: 'tools' belongs on the first message, a system message")
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
    return messages, tools


def split_reasoning(message) -> tuple[str, str]:
    """(reasoning, content) of an assistant message: its reasoning_content, else a <think> block leading its
    content."""
    content = message.get("content") or ""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"], content
    if "</think>" in content:
        head, content = content.split("</think>")[0], content.split("</think>")[-1]
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), content.lstrip("\n")
    return "", content


def chatml_pieces(tokenizer, messages: list[dict], tools: list | None) -> list[tuple[str, int, bool]]:
    """Messages -> [(text, carries loss, is markup)]; markup's added tokens (<|im_start|>, <think>, ...) become
    their ids, as apply_chat_template's tokenizer finds them; what the data says (content, tools) never does."""
    pieces = []

    def markup(text, loss=0):
        pieces.append((text, loss, True))

    def data(text, loss=0):
        pieces.append((text, loss, False))

    first_system = messages[0]["role"] == "system"
    if tools:
        markup("<|im_start|>system\n")
        if first_system:
            data(messages[0].get("content") or "")
            markup("\n\n")
        markup(TOOLS_HEADER)
        for tool in tools:
            markup("\n")
            data(json.dumps(tool, ensure_ascii=False))  # Jinja's tojson as transformers defines it
        markup(TOOLS_FOOTER)
    elif first_system:
        markup("<|im_start|>system\n")
        data(messages[0].get("content") or "")
        markup("<|im_end|>\n")
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "user" or (role == "system" and i > 0):
            markup(f"<|im_start|>{role}\n")
            data(content)
            markup("<|im_end|>\n")
        elif role == "assistant":
            reasoning, content = split_reasoning(m)
            markup("<|im_start|>assistant\n")
            markup("<think>\n", 1)
            data(reasoning.strip("\n"), 1)
            markup("\n</think>\n\n", 1)
            data(content.lstrip("\n"), 1)
            for j, call in enumerate(m.get("tool_calls") or []):
                call = call.get("function", call)
                if j > 0 or content:
                    markup("\n", 1)
                markup('<tool_call>\n{"name": "', 1)
                data(call["name"], 1)
                markup('", "arguments": ', 1)
                args = call["arguments"]
                data(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), 1)
                markup("}\n</tool_call>", 1)
            markup("<|im_end|>", 1)
            markup("\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                markup("<|im_start|>user")
            markup("\n<tool_response>\n")
            data(content)
            markup("\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                markup("<|im_end|>\n")
    if messages[-1]["role"] != "assistant":
        markup(GENERATION_PROMPT)
    return pieces


def encode_pieces(tokenizer, pieces) -> tuple[list[int], list[int]]:
    """Pieces -> (ids, loss_mask). Markup is cut at added tokens; the text between two added tokens is encoded as
    one string (as the tokenizers library does), unless its loss changes inside it."""
    added = re.compile("(" + "|".join(map(re.escape, sorted(tokenizer.added_tokens, key=len, reverse=True))) + ")")
    ids, mask, text, text_loss = [], [], "", 0

    def flush():
        encoded = tokenizer.encode(text)
        ids.extend(encoded)
        mask.extend([text_loss] * len(encoded))

    for value, loss, is_markup in pieces:
        for k, part in enumerate(added.split(value) if is_markup else [value]):
            if k % 2:  # an added token
                flush()
                text = ""
                ids.append(tokenizer.added_tokens[part])
                mask.append(loss)
            elif part:
                if text and loss != text_loss:
                    flush()
                    text = ""
                text, text_loss = text + part, loss
    flush()
    return ids, mask


def encode_chatml(tokenizer, conversations, system, max_len) -> tuple[list[int], list[int]]:
    messages, tools = chatml_messages(conversations, system)
    head = messages[:1] if messages[0]["role"] == "system" else []
    turns = [len(head)] + [i for i, m in enumerate(messages) if m["role"] == "user" and i > len(head)]
    for first in turns:  # too long: drop whole earliest turns (a turn starts at a user message)
        ids, mask = encode_pieces(tokenizer, chatml_pieces(tokenizer, head + messages[first:], tools))
        if max_len is None or len(ids) <= max_len:
            break
    return ids, mask


def encode_chat(tokenizer, conversations, system=None, max_len=None) -> tuple[list[int], list[int]]:
    """Messages -> (input_ids, loss_mask) in the tokenizer's chat template, loss_mask 1 exactly on what the
    assistant writes and its end-of-turn token (</s> or <|im_end|>). Messages that do not end with the
    assistant end with the generation prompt (... [/INST] or <|im_start|>assistant ...).
    Too long for max_len: whole earliest turns are dropped (the system prompt stays);
    a last turn that alone is too long is cut at the end (its answer then lacks its end-of-turn token)."""
    if tokenizer.chat_template == "llama2":
        ids, mask = encode_llama2(tokenizer, conversations, system, max_len)
    elif tokenizer.chat_template == "chatml":
        ids, mask = encode_chatml(tokenizer, conversations, system, max_len)
    else:
        raise DataError("this tokenizer's chat_template (tokenizer_config.json) is neither ChatML nor absent: "
                        "nanomind renders only ChatML (MiniMind's) and its own [INST] template")
    return ids[:max_len], mask[:max_len]


def show_mask(tokenizer, ids, loss_mask) -> str:
    """One line per token: position, id, ✓ (carries loss) or ✗, and the token's text."""
    return "\n".join(f"{i:5d} {t:6d} {'✓' if m else '✗'} {tokenizer.decode([t])!r}"
                     for i, (t, m) in enumerate(zip(ids, loss_mask)))


# -----------------------------------------------------------------------------
# one record (a parsed JSONL line) -> token arrays; BadRecord names what is wrong, the caller adds file:line

def encode_pretrain(tokenizer, record, max_len=None):
    text = record.get("text")
    if not isinstance(text, str):
        raise BadRecord("missing field 'text'" if text is None else f"'text' must be a string, got {type(text).__name__}")
    return (np.array([tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id]),), []


def encode_sft(tokenizer, record, max_len=None):
    if "conversations" not in record:
        raise BadRecord("missing field 'conversations'")
    if record["conversations"] and record["conversations"][-1].get("role") != "assistant":
        raise BadRecord("the last message must be the assistant's")
    ids, mask = encode_chat(tokenizer, record["conversations"], record.get("system"), max_len)
    if not any(mask):  # the prompt alone fills max_len: nothing to learn, so no batch is ever all-masked
        return None, [f"skipped: no assistant token fits in {max_len} tokens"]
    end = len(mask) - mask[::-1].index(1)  # after the last answer token: ChatML's closing "\n" teaches nothing
    notes = ["answer cut at max_len"] if ids[end - 1] != tokenizer.eos_id else []
    return (np.array(ids[:end]), np.array(mask[:end], dtype=np.uint8)), notes


def dpo_prompt_and_answers(record) -> tuple[list[dict], dict, dict]:
    """Both DPO formats -> (prompt messages, chosen assistant message, rejected assistant message)."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        if not chosen or not rejected or chosen[:-1] != rejected[:-1]:
            raise BadRecord("'chosen' and 'rejected' must be message lists sharing everything but the last message")
        if any(not isinstance(m[-1], dict) or m[-1].get("role") != "assistant" for m in (chosen, rejected)):
            raise BadRecord("'chosen' and 'rejected' must end with an assistant message")
        return chosen[:-1], chosen[-1], rejected[-1]
    if "prompt" in record:
        for name in ("chosen", "rejected"):
            if not isinstance(record.get(name), str) or not record[name].strip():
                raise BadRecord(f"the {name} answer must be a non-empty string")
        return ([{"role": "user", "content": record["prompt"]}], {"role": "assistant", "content": chosen},
                {"role": "assistant", "content": rejected})
    raise BadRecord("expected fields 'prompt', 'chosen', 'rejected' (strings) or 'chosen', 'rejected' (message lists)")


def encode_dpo(tokenizer, record, max_prompt_length=None, max_completion_length=None):
    """-> (prompt, chosen answer, rejected answer) ids: each conversation rendered whole, cut where the last
    answer's loss begins, so an answer is exactly the tokens SFT would train on (end-of-turn token included)."""
    prompt, *answers = dpo_prompt_and_answers(record)
    parts, notes = [], []
    for answer in answers:
        ids, mask = encode_chat(tokenizer, prompt + [answer], record.get("system"))
        start = len(mask) - mask[::-1].index(0, mask[::-1].index(1))  # where the last run of 1s begins
        end = len(mask) - mask[::-1].index(1)
        parts.append((ids[:start], ids[start:end]))
    (prompt_ids, chosen), (rejected_prompt, rejected) = parts
    assert prompt_ids == rejected_prompt, "both answers follow the same prompt tokens"
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids, notes = prompt_ids[-max_prompt_length:], ["prompt cut from the left"]
    answers = []
    for ids in (chosen, rejected):
        if max_completion_length is not None and len(ids) > max_completion_length:
            ids, notes = ids[:max_completion_length], notes + ["completion cut from the right"]
        answers.append(np.array(ids))
    return (np.array(prompt_ids), *answers), notes


ENCODERS = {"pretrain": encode_pretrain, "sft": encode_sft, "dpo": encode_dpo}
ARRAYS = {"pretrain": ("tokens",), "sft": ("tokens", "mask"), "dpo": ("prompt", "chosen", "rejected")}


# -----------------------------------------------------------------------------
# which files: data_path is one file, a glob pattern, or several of either separated by commas

# what data.py and train_dpo.py write beside a data file: FILE.<kind>.cache (and its temp files), FILE.ref-KEY.pt
CACHE_NAME = re.compile(rf"\.({'|'.join(ARRAYS)})\.cache(\.tmp.*)?$|\.ref-[0-9a-f]+\.pt(\.tmp)?$")


def expand_paths(data_path: str) -> list[str]:
    """'data/a.jsonl', 'data/pretrain_*.jsonl' or 'a.jsonl,more/*.txt' -> the files, in the order given, each
    pattern's matches sorted (a stable order); the token caches data.py writes beside them never match."""
    paths = []
    for entry in [e.strip() for e in data_path.split(",") if e.strip()]:
        if os.path.isfile(entry):
            paths.append(entry)
            continue
        if not any(c in entry for c in "*?["):
            raise FileNotFoundError(f"data file not found: {entry}")
        found = sorted(p for p in glob.glob(entry) if os.path.isfile(p) and not CACHE_NAME.search(p))
        if not found:
            raise DataError(f"no data file matches {entry!r}")
        paths += found
    if not paths:
        raise DataError(f"data_path {data_path!r} names no file")
    twice = [p for p, n in Counter(paths).items() if n > 1]
    if twice:
        raise DataError(f"data_path {data_path!r} names {twice[0]} twice")
    return paths


def file_digest(path: str) -> str:
    """blake2b of a file's bytes; of a data_path naming several files, of their names and digests."""
    h = hashlib.blake2b(digest_size=16)
    if not os.path.isfile(path):
        for p in expand_paths(path):
            h.update(f"{p}\0{file_digest(p)}\0".encode())
        return h.hexdigest()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# -----------------------------------------------------------------------------
# a file is read in chunks of whole records; a worker process turns a chunk into token arrays

CHUNK_BYTES = 1 << 20  # per task: amortises handing it to a worker; a few in flight bound the memory


def count_lines(raw: bytes) -> int:
    """Line ends in raw as Python's text mode counts them: \\n, \\r\\n and a lone \\r each end a line."""
    return raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")


def read_chunks(path: str, chunk_bytes: int = CHUNK_BYTES):
    """Yield (first line number, raw bytes) chunks of about chunk_bytes that cut no record: each ends at a
    line end (JSONL) or after a blank line (.txt, whose documents are separated by blank lines)."""
    lineno = 1
    with open(path, "rb") as f:
        while raw := f.read(chunk_bytes):
            raw += f.readline()  # the rest of the line the read cut
            if path.endswith(".txt"):
                last, more = raw[raw.rfind(b"\n", 0, len(raw) - 1) + 1 :], []
                while last.strip() and (last := f.readline()):
                    more.append(last)
                raw = b"".join([raw, *more])
            yield lineno, raw
            lineno += count_lines(raw)


def text_lines(raw: bytes) -> list[bytes]:
    """A chunk's lines without their ends, split as text mode splits them."""
    lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


def parse_line(line: bytes) -> dict | None:
    """A JSONL line -> its record, None if the line is blank; BadRecord if it holds no JSON object."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 text (byte {e.start + 1})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    return record


def txt_documents(raw: bytes, lineno: int, path: str) -> list[tuple[int, dict]]:
    """(first line number, {"text": document}) for the blank-line-separated documents of a .txt chunk."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # a whole .txt chunk is one piece of text: not skippable line by line
        raise BadRecord(f"{path}:{lineno + count_lines(raw[: e.start])}: not UTF-8 text") from None
    docs, block, start = [], [], lineno
    for i, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), lineno):
        if line.strip():
            start = i if not block else start
            block.append(line)
        elif block:
            docs.append((start, {"text": "\n".join(block)}))
            block = []
    if block:
        docs.append((start, {"text": "\n".join(block)}))
    return docs


_worker: dict = {}


def _init_worker(tokenizer, kind, path, options, skip_bad, dtypes):
    # a forked worker inherits the trainer's handlers, under which SIGTERM would not end it: restore the
    # defaults, and leave Ctrl-C to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(tokenizer=tokenizer, kind=kind, path=path, options=options, skip_bad=skip_bad, dtypes=dtypes)


def _encode_chunk(task):
    """Worker: (first line number, raw chunk) -> ([per array name: the records' arrays end to end], lengths
    (n_records, n_arrays), Counter of notes and skipped reasons, bytes read)."""
    w, (lineno, raw) = _worker, task
    txt = w["path"].endswith(".txt")
    units = txt_documents(raw, lineno, w["path"]) if txt else enumerate(text_lines(raw), lineno)
    columns, lengths, notes = [[] for _ in w["dtypes"]], [], Counter()
    for lineno, unit in units:
        try:
            record = unit if txt else parse_line(unit)
            if record is None:
                continue
            arrays, record_notes = ENCODERS[w["kind"]](w["tokenizer"], record, **w["options"])
        except BadRecord as e:
            if not w["skip_bad"]:
                raise BadRecord(f"{w['path']}:{lineno}: {e}") from None
            arrays, record_notes = None, [f"skipped: {e}"]
        if arrays is not None:
            for column, a in zip(columns, arrays):
                column.append(a)
            lengths.append([len(a) for a in arrays])
        notes.update(record_notes)
    arrays = [np.concatenate(c).astype(dt) if c else np.zeros(0, dt) for c, dt in zip(columns, w["dtypes"])]
    return arrays, np.array(lengths, dtype=np.int64).reshape(-1, len(columns)), notes, len(raw)


def array_dtypes(kind: str, tokenizer) -> list[np.dtype]:
    ids = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    return [np.dtype(np.uint8) if name == "mask" else ids for name in ARRAYS[kind]]


def encode_chunks(path: str, tokenizer, kind: str, options: dict, skip_bad: bool, processes: int, chunk_bytes: int):
    """The workers' results for path's chunks, in file order. At most two chunks per process are in flight, so
    memory does not grow with the file, even when writing falls behind (Pool.imap would queue results)."""
    initargs = (tokenizer, kind, path, options, skip_bad, array_dtypes(kind, tokenizer))
    # leaving the block terminates the workers: they must die on SIGTERM (see _init_worker)
    with multiprocessing.Pool(processes, _init_worker, initargs) as pool:
        pending = deque()
        for task in read_chunks(path, chunk_bytes):
            pending.append(pool.apply_async(_encode_chunk, (task,)))
            if len(pending) == 2 * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# -----------------------------------------------------------------------------
# the cache: a JSON header, then each array 64-byte aligned; built by streaming, committed by a rename

CACHE_MAGIC, CACHE_VERSION = b"NANOMIND", 2  # 2: a ChatML tokenizer's conversations in its own template


def cache_path(path: str, kind: str) -> str:
    """FILE.<kind>.cache beside the file, or under ~/.cache/nanomind when the file's directory is read-only."""
    if os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
        return f"{path}.{kind}.cache"
    where = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=8).hexdigest()
    return os.path.join(os.path.expanduser("~"), ".cache", "nanomind", f"{os.path.basename(path)}.{where}.{kind}.cache")


def write_cache(path: str, key: str, parts: dict[str, tuple[str, np.dtype]], info: dict):
    """Header, then each array copied from its part file ({name: (part file, dtype)}); written to a temp file,
    fsynced and renamed into place, so a reader sees the old cache or the complete new one, never half of one."""
    layout, offset = {}, 0
    for name, (part, dtype) in parts.items():
        n = os.path.getsize(part) // dtype.itemsize
        layout[name] = (dtype.str, offset, n)
        offset += -(-n * dtype.itemsize // 64) * 64
    header = json.dumps({"key": key, "info": info, "layout": layout}).encode()
    start = -(-(len(CACHE_MAGIC) + 8 + len(header)) // 64) * 64
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(CACHE_MAGIC + len(header).to_bytes(8, "little") + header)
        for name, (part, _) in parts.items():
            f.seek(start + layout[name][1])
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        f.truncate(start + offset)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_cache(path: str, key: str):
    """(arrays as read-only memmaps, info) if path holds a complete cache for key, else None."""
    try:
        with open(path, "rb") as f:
            if f.read(len(CACHE_MAGIC)) != CACHE_MAGIC:
                return None
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        start = -(-(len(CACHE_MAGIC) + 8 + n) // 64) * 64
        if header["key"] != key:
            return None
        arrays = {name: np.memmap(path, dtype=np.dtype(dt), mode="r", offset=start + off, shape=(n,))
                  for name, (dt, off, n) in header["layout"].items()}
        return arrays, header["info"]
    except (OSError, ValueError, KeyError):
        return None


def remove_dead_temps(cache: str):
    """Delete the temp files of builds that were killed (their process is gone); nothing ever reads them."""
    for tmp in glob.glob(glob.escape(cache) + ".tmp*"):
        pid = tmp[len(cache) + len(".tmp") :].split(".")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(tmp)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


class Progress:
    """The tokenising line: MB done, MB/s, records, tokens, ETA; redrawn every 2 s on a terminal, and printed
    every 30 s into a log."""

    def __init__(self, path: str, verbose: bool):
        self.path, self.verbose, self.size, self.done = path, verbose, os.path.getsize(path), 0
        self.t0 = self.last = time.time()
        self.tty = sys.stderr.isatty()

    def update(self, n_bytes: int, records: int, tokens: int, final: bool = False):
        self.done += n_bytes
        if not self.verbose or not final and time.time() - self.last < (2 if self.tty else 30):
            return
        self.last = time.time()
        rate = self.done / max(self.last - self.t0, 1e-9)
        eta = datetime.timedelta(seconds=round((self.size - self.done) / max(rate, 1e-9)))
        redraw = "\r" if self.tty else ""
        print(f"{redraw}tokenising {self.path}: {self.done / 1e6:,.1f}/{self.size / 1e6:,.1f} MB, "
              f"{rate / 1e6:.1f} MB/s, {records:,} records, {tokens / 1e6:,.1f}M tokens, ETA {eta}",
              end="\n" if final or not self.tty else "", file=sys.stderr, flush=True)


def build_cache(path: str, cache: str, key: str, tokenizer, kind: str, options: dict, skip_bad: bool,
                processes: int, chunk_bytes: int, verbose: bool):
    """Tokenise path into `cache`, streaming: each chunk's arrays are appended to one part file per array as they
    arrive (memory holds a few chunks, whatever the file's size), and write_cache joins the parts at the end."""
    names, dtypes = ARRAYS[kind], array_dtypes(kind, tokenizer)
    tmp = f"{cache}.tmp{os.getpid()}"
    parts = {name: f"{tmp}.{name}" for name in (*names, "offsets")}
    ends, records, notes = np.zeros(len(names), dtype=np.int64), 0, Counter()  # ends: each array's length so far
    progress = Progress(path, verbose)
    try:
        with contextlib.ExitStack() as stack:
            files = {name: stack.enter_context(open(part, "wb")) for name, part in parts.items()}
            files["offsets"].write(ends.tobytes())  # offsets (n_records + 1, n_arrays): row i = where record i starts
            for arrays, lengths, chunk_notes, n_bytes in encode_chunks(path, tokenizer, kind, options, skip_bad,
                                                                       processes, chunk_bytes):
                for name, a in zip(names, arrays):
                    files[name].write(a.tobytes())
                files["offsets"].write((ends + np.cumsum(lengths, axis=0)).tobytes())
                ends += lengths.sum(axis=0)
                records += len(lengths)
                notes.update(chunk_notes)
                progress.update(n_bytes, records, int(ends[0]))
        progress.update(0, records, int(ends[0]), final=True)
        if records == 0:
            raise BadRecord(f"{path}: no usable records")
        info = {"records": records, "tokens": int(ends[0]), "notes": dict(notes)}
        write_cache(cache, key, {name: (parts[name], dtype) for name, dtype in zip(names, dtypes)}
                    | {"offsets": (parts["offsets"], np.dtype(np.int64))}, info)
    finally:
        for part in [*parts.values(), tmp]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)


# -----------------------------------------------------------------------------
# records of one or more files, memory-mapped from their caches

class Records:
    """Ragged token arrays, one entry per record, over the caches of one or more files as if they were one:
    records[i] -> tuple of 1-D arrays (e.g. tokens, mask). Nothing is copied into RAM: the arrays stay
    memory-mapped, so a corpus of many GB costs only the pages a batch touches."""

    def __init__(self, files: list[dict[str, np.ndarray]], names: tuple[str, ...], lo: int = 0, hi: int | None = None):
        self.files, self.names = files, names
        self.starts = [0]  # (n_files + 1,): the first record of each file, counted across files
        for arrays in files:
            self.starts.append(self.starts[-1] + len(arrays["offsets"]) - 1)
        self.lo, self.hi = lo, self.starts[-1] if hi is None else hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        f = bisect.bisect_right(self.starts, self.lo + i) - 1
        arrays, r = self.files[f], self.lo + i - self.starts[f]
        off = arrays["offsets"][r : r + 2]  # (2, n_arrays): where record r and the next one start
        return tuple(arrays[name][off[0, j] : off[1, j]] for j, name in enumerate(self.names))

    def split(self, n_first: int) -> tuple["Records", "Records"]:
        cut = self.lo + n_first
        return Records(self.files, self.names, self.lo, cut), Records(self.files, self.names, cut, self.hi)

    def token_spans(self) -> list[np.ndarray]:
        """The first array ('tokens', 'prompt') of records lo..hi-1 end to end: one memory-mapped slice per file."""
        spans = []
        for f, arrays in enumerate(self.files):
            a, b = max(self.lo, self.starts[f]) - self.starts[f], min(self.hi, self.starts[f + 1]) - self.starts[f]
            if a < b:
                offsets = arrays["offsets"][:, 0]
                spans.append(arrays[self.names[0]][offsets[a] : offsets[b]])
        return spans


def file_records(path: str, tokenizer, kind: str, skip_bad: bool, processes: int | None, verbose: bool,
                 chunk_bytes: int, options: dict) -> tuple[dict[str, np.ndarray], dict]:
    """(memory-mapped arrays, info) of one file's cache, built first unless it is there and matches."""
    key = json.dumps([CACHE_VERSION, kind, sorted(options.items()), skip_bad, tokenizer.fingerprint, file_digest(path)])
    cache = cache_path(path, kind)
    if read_cache(cache, key) is None:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        remove_dead_temps(cache)
        if verbose:
            print(f"tokenising {path} into {cache}{other_ranks_wait()}", file=sys.stderr, flush=True)
        build_cache(path, cache, key, tokenizer, kind, options, skip_bad, processes or min(os.cpu_count() or 1, 8),
                    chunk_bytes, verbose)
    arrays, info = read_cache(cache, key)
    arrays["offsets"] = arrays["offsets"].reshape(-1, len(ARRAYS[kind]))
    return arrays, info


def other_ranks_wait() -> str:
    """Under torchrun, train_*.py let rank 0 tokenise while the other ranks wait (run.rank0_first()): say so."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ""
    others = torch.distributed.get_world_size() - 1
    return f"; the other {others} rank(s) wait for it" if others else ""


def tokenize_file(path: str, tokenizer, kind: str, skip_bad: bool = False, processes: int | None = None,
                  verbose: bool = True, chunk_bytes: int = CHUNK_BYTES, **options) -> Records:
    """Records of a pretrain/sft/dpo data_path (a file, a glob pattern or several: see expand_paths), each file
    from its cache when that matches, else tokenised in parallel and cached. A bad line raises BadRecord
    naming file:line, or with skip_bad is skipped and counted."""
    paths, files, records, tokens = expand_paths(path), [], 0, 0
    for p in paths:
        arrays, info = file_records(p, tokenizer, kind, skip_bad, processes, verbose, chunk_bytes, options)
        files.append(arrays)
        records, tokens = records + info["records"], tokens + info["tokens"]
        if verbose:
            print(f"{p}: {info['records']:,} records, {info['tokens']:,} tokens" +
                  "".join(f"; {n} x {what}" for what, n in sorted(info["notes"].items())), file=sys.stderr)
    if verbose and len(paths) > 1:
        print(f"{path}: {len(paths)} files, {records:,} records, {tokens:,} tokens", file=sys.stderr)
    return Records(files, ARRAYS[kind])


def load_split(data_path: str, val_data_path: str | None, val_fraction: float, tokenizer, kind: str,
               **options) -> tuple[Records, Records]:
    """(train, validation) records: val_data_path's if given, else the last val_fraction of data_path's records
    (counted across all its files, in their order). options go to tokenize_file."""
    records = tokenize_file(data_path, tokenizer, kind, **options)
    if val_data_path:
        return records, tokenize_file(val_data_path, tokenizer, kind, **options)
    n_val = max(1, round(len(records) * val_fraction))
    if n_val >= len(records):
        raise DataError(f"{data_path}: {len(records)} records are too few to hold out {n_val} for validation")
    return records.split(len(records) - n_val)


# -----------------------------------------------------------------------------
# datasets: item i -> a tuple of rows; a row is (ids, loss_mask or None for "all ones")

class PretrainData:
    """Documents packed end to end, cut into windows of max_seq_len + 1 tokens (consecutive windows share
    one token, so every token is a target exactly once); the tail that fills no window is dropped. Several
    files are one stream: a window may run from one file's last document into the next file's first."""

    def __init__(self, records: Records, max_seq_len: int):
        self.spans = records.token_spans()  # memory-mapped, one per file
        self.starts = [0]  # (n_spans + 1,): where each span starts in the stream
        for span in self.spans:
            self.starts.append(self.starts[-1] + len(span))
        self.max_seq_len = max_seq_len

    def __len__(self):
        return max(self.starts[-1] - 1, 0) // self.max_seq_len

    def __getitem__(self, i):
        start = i * self.max_seq_len
        end, s = start + self.max_seq_len + 1, bisect.bisect_right(self.starts, start) - 1
        if end <= self.starts[s + 1]:  # within one file (nearly always): a view, no copy
            return ((self.spans[s][start - self.starts[s] : end - self.starts[s]], None),)
        pieces = []
        while start < end:
            pieces.append(self.spans[s][start - self.starts[s] : end - self.starts[s]])
            start, s = self.starts[s + 1], s + 1
        return ((np.concatenate(pieces), None),)


class SFTData:
    def __init__(self, records: Records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return (self.records[i],)


class DPOData:
    """Item i -> (prompt + chosen, prompt + rejected), loss_mask 1 on the answers only."""

    def __init__(self, records: Records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        prompt, chosen, rejected = self.records[i]
        masked = np.zeros(len(prompt), dtype=np.uint8)
        return tuple((np.concatenate([prompt, a]), np.concatenate([masked, np.ones(len(a), np.uint8)]))
                     for a in (chosen, rejected))


def pad_rows(rows, pad_id: int):
    """Rows of ids -> X, Y (n, T) int64 and loss_mask (n, T) float32, padded to the longest row in the batch
    (T = its length - 1); padded positions have mask 0."""
    T = max(len(ids) for ids, _ in rows) - 1
    X = np.full((len(rows), T), pad_id, dtype=np.int64)
    Y = np.full((len(rows), T), pad_id, dtype=np.int64)
    M = np.zeros((len(rows), T), dtype=np.float32)
    for r, (ids, mask) in enumerate(rows):
        n = len(ids) - 1
        X[r, :n], Y[r, :n] = ids[:-1], ids[1:]
        M[r, :n] = 1.0 if mask is None else mask[1:]
    return torch.from_numpy(X), torch.from_numpy(Y), torch.from_numpy(M)


class Loader:
    """Batches in a seeded order that every rank computes alike; rank r takes every world_size-th item of each
    global batch, so the ranks' batches together are exactly the batch a single process would see.
    Epochs are reshuffled; the position (epoch, batch) is saved and restored for an exact resume."""

    def __init__(self, dataset, batch_size: int, pad_id: int, device="cpu", seed: int = 0, rank: int = 0,
                 world_size: int = 1, name: str = "data"):
        self.dataset, self.batch_size, self.pad_id, self.device = dataset, batch_size, pad_id, torch.device(device)
        self.seed, self.rank, self.world_size, self.name = seed, rank, world_size, name
        self.epoch, self.pos = 0, 0
        self._order = (None, None)  # (epoch, its item order)
        if len(dataset) < world_size:
            raise DataError(f"{name}: {len(dataset)} items, fewer than the {world_size} ranks")

    def __len__(self):
        """Full batches per epoch (per rank)."""
        return len(self.dataset) // (self.batch_size * self.world_size)

    def order(self, epoch: int) -> np.ndarray:
        """The item order of an epoch, a pure function of (seed, epoch); computed once per epoch."""
        if self._order[0] != epoch:
            self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        return self._order[1]

    def next_batch(self):
        """The next training batch: (X, Y, loss_mask, item indices) on the device."""
        if len(self) == 0:
            raise DataError(f"{self.name}: {len(self.dataset)} items cannot fill one batch of "
                             f"{self.batch_size} x {self.world_size} rank(s)")
        if self.pos == len(self):
            self.epoch, self.pos = self.epoch + 1, 0
        step = self.batch_size * self.world_size
        items = self.order(self.epoch)[self.pos * step : (self.pos + 1) * step][self.rank :: self.world_size]
        self.pos += 1
        return self.batch(items)

    def batches(self, limit: int):
        """For evaluation: this rank's share of the items in file order, at most `limit` batches (the last may
        be short). Leaves the training position alone."""
        mine = np.arange(self.rank, len(self.dataset), self.world_size)
        for start in range(0, min(len(mine), limit * self.batch_size), self.batch_size):
            yield self.batch(mine[start : start + self.batch_size])

    def batch(self, indices):
        """Items -> (X, Y, loss_mask, item indices) on the device."""
        items = [self.dataset[int(i)] for i in indices]
        rows = [item[j] for j in range(len(items[0])) for item in items]  # DPO: all chosen rows, then all rejected
        batch = (*pad_rows(rows, self.pad_id), torch.as_tensor(np.asarray(indices, dtype=np.int64)))
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in batch)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict):
        self.epoch, self.pos = state["epoch"], state["pos"]
