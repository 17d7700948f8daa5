"""
From raw JSONL to the (X, Y, loss_mask) batches the training scripts consume.

  pretrain  {"text": ...} lines or .txt files  -> <s> doc </s> packed end to end into windows of max_seq_len + 1
  sft       {"conversations": [...]}           -> chat template; loss on assistant tokens and their </s> only
  dpo       {"prompt","chosen","rejected"} or {"chosen": [msgs], "rejected": [msgs]} -> prompt + two answers

A file is tokenised once, in parallel processes, into a cache file beside it; the cache is reused while the
file, the tokenizer and the encoding options are unchanged and rebuilt (atomically) when any of them changes.
"""
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter

import numpy as np
import torch

from tokenizer import load_tokenizer  # noqa: F401  (data.load_tokenizer is the documented entry point)


class DataError(ValueError):
    """A data file that cannot train: missing, malformed, or too small for the batch asked for."""


class BadRecord(DataError):
    pass


# -----------------------------------------------------------------------------
# the chat template (LLaMA-2 style), built segment by segment so every token's role is known:
#   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>   first turn, with a system prompt
#   <s>[INST] {user} [/INST] {assistant} </s>                                  every other turn

def chat_turns(conversations, system=None) -> tuple[str | None, list[tuple[str, str | None]]]:
    """Validate MiniMind-style messages -> (system, [(user, assistant), ...]). A leading {"role": "system"}
    message is the system prompt; the last turn's assistant is None when the messages end with the user."""
    if not isinstance(conversations, list) or not conversations:
        raise BadRecord("'conversations' must be a non-empty list of {role, content} messages")
    for i, m in enumerate(conversations):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m["content"].strip():
            raise BadRecord(f"message {i} needs a non-empty string 'content'")
        if m.get("role") not in ("system", "user", "assistant"):
            raise BadRecord(f"message {i} has unknown role {m.get('role')!r}")
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


def encode_answer(tokenizer, answer: str) -> list[int]:
    """The assistant segment that follows [/INST]: ' {answer} </s>' (every token carries loss)."""
    return tokenizer.encode(f" {answer} ") + [tokenizer.eos_id]


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
        answer = encode_answer(tokenizer, assistant)
        ids, mask = ids + answer, mask + [1] * len(answer)
    return ids, mask


def encode_chat(tokenizer, conversations, system=None, max_len=None) -> tuple[list[int], list[int]]:
    """Messages -> (input_ids, loss_mask), loss_mask 1 exactly on assistant tokens and their </s>.
    Messages ending with the user give a generation prompt ending in [/INST].
    Too long for max_len: whole earliest turns are dropped (the system prompt moves to the first kept turn);
    a last turn that alone is too long is cut at the end (its answer then lacks the closing </s>)."""
    system, turns = chat_turns(conversations, system)
    for first in range(len(turns)):
        encoded = [encode_turn(tokenizer, u, a, system if i == first else None)
                   for i, (u, a) in enumerate(turns) if i >= first]
        ids = [t for turn_ids, _ in encoded for t in turn_ids]
        if max_len is None or len(ids) <= max_len:
            break
    mask = [m for _, turn_mask in encoded for m in turn_mask]
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
    notes = ["answer cut at max_len"] if ids[-1] != tokenizer.eos_id else []
    return (np.array(ids), np.array(mask, dtype=np.uint8)), notes


def dpo_prompt_and_answers(record):
    """Both DPO formats -> (prompt messages ending with the user, chosen answer, rejected answer)."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        if not chosen or not rejected or chosen[:-1] != rejected[:-1]:
            raise BadRecord("'chosen' and 'rejected' must be message lists sharing everything but the last message")
        if any(m[-1].get("role") != "assistant" for m in (chosen, rejected)):
            raise BadRecord("'chosen' and 'rejected' must end with an assistant message")
        prompt, chosen, rejected = chosen[:-1], chosen[-1].get("content"), rejected[-1].get("content")
    elif "prompt" in record:
        prompt = [{"role": "user", "content": record["prompt"]}]
    else:
        raise BadRecord("expected fields 'prompt', 'chosen', 'rejected' (strings) or 'chosen', 'rejected' (message lists)")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(answer, str) or not answer.strip():
            raise BadRecord(f"the {name} answer must be a non-empty string")
    return prompt, chosen, rejected


def encode_dpo(tokenizer, record, max_prompt_length=None, max_completion_length=None):
    prompt, chosen, rejected = dpo_prompt_and_answers(record)
    prompt_ids, _ = encode_chat(tokenizer, prompt, record.get("system"))
    notes = []
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids, notes = prompt_ids[-max_prompt_length:], ["prompt cut from the left"]
    answers = []
    for answer in (chosen, rejected):
        ids = encode_answer(tokenizer, answer)
        if max_completion_length is not None and len(ids) > max_completion_length:
            ids, notes = ids[:max_completion_length], notes + ["completion cut from the right"]
        answers.append(np.array(ids))
    return (np.array(prompt_ids), *answers), notes


ENCODERS = {"pretrain": encode_pretrain, "sft": encode_sft, "dpo": encode_dpo}
ARRAYS = {"pretrain": ("tokens",), "sft": ("tokens", "mask"), "dpo": ("prompt", "chosen", "rejected")}


# -----------------------------------------------------------------------------
# tokenising a file in parallel, into a cache beside it

def read_units(path: str, chunk_lines: int = 2000):
    """Yield (first line number, [raw units]) chunks: JSONL lines, or blank-line-separated documents of a .txt."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".txt"):
            units, start, block = [], 1, []
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    start = lineno if not block else start
                    block.append(line)
                elif block:
                    units.append((start, json.dumps({"text": "".join(block).rstrip("\n")})))
                    block = []
            if block:
                units.append((start, json.dumps({"text": "".join(block).rstrip("\n")})))
            for i in range(0, len(units), chunk_lines):
                yield units[i : i + chunk_lines]
        else:
            chunk = []
            for lineno, line in enumerate(f, 1):
                chunk.append((lineno, line))
                if len(chunk) == chunk_lines:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk


_worker: dict = {}


def _init_worker(tokenizer, kind, path, options, skip_bad):
    # a forked worker inherits the trainer's handlers, under which SIGTERM would not end it: restore the
    # defaults, and leave Ctrl-C to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(tokenizer=tokenizer, kind=kind, path=path, options=options, skip_bad=skip_bad)


def _encode_chunk(chunk):
    """Worker: [(line number, raw line)] -> ([per-record arrays], Counter of notes and skipped reasons, bytes)."""
    w = _worker
    records, notes, n_bytes = [], Counter(), 0
    for lineno, line in chunk:
        n_bytes += len(line.encode("utf-8"))
        if not line.strip():
            continue
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadRecord(f"malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
            arrays, record_notes = ENCODERS[w["kind"]](w["tokenizer"], record, **w["options"])
        except BadRecord as e:
            if not w["skip_bad"]:
                raise BadRecord(f"{w['path']}:{lineno}: {e}") from None
            arrays, record_notes = None, [f"skipped: {e}"]
        if arrays is not None:
            records.append(arrays)
        notes.update(record_notes)
    return records, notes, n_bytes


def file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


CACHE_MAGIC, CACHE_VERSION = b"NANOMIND", 1


def write_cache(path: str, key: str, arrays: dict[str, np.ndarray], info: dict):
    """Header (JSON) then the arrays, 64-byte aligned; written to a temp file, fsynced and renamed into place,
    so a reader sees the old cache or the complete new one, never half of one."""
    layout, offset = {}, 0
    for name, a in arrays.items():
        layout[name] = (a.dtype.str, offset, len(a))
        offset += -(-a.nbytes // 64) * 64
    header = json.dumps({"key": key, "info": info, "layout": layout}).encode()
    start = -(-(len(CACHE_MAGIC) + 8 + len(header)) // 64) * 64
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(CACHE_MAGIC + len(header).to_bytes(8, "little") + header)
        for name, a in arrays.items():
            f.seek(start + layout[name][1])
            f.write(np.ascontiguousarray(a).tobytes())
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


class Records:
    """Ragged token arrays, one entry per record: records[i] -> tuple of 1-D arrays (e.g. tokens, mask)."""

    def __init__(self, arrays: dict[str, np.ndarray], names: tuple[str, ...], lo: int = 0, hi: int | None = None):
        self.arrays, self.names = arrays, names
        self.lo, self.hi = lo, len(arrays["offsets"]) - 1 if hi is None else hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        off = self.arrays["offsets"][self.lo + i : self.lo + i + 2]  # (n_arrays + 1,) per record, row-major
        return tuple(self.arrays[name][off[0, j] : off[1, j]] for j, name in enumerate(self.names))

    def split(self, n_first: int) -> tuple["Records", "Records"]:
        cut = self.lo + n_first
        return Records(self.arrays, self.names, self.lo, cut), Records(self.arrays, self.names, cut, self.hi)


def tokenize_file(path: str, tokenizer, kind: str, skip_bad: bool = False, processes: int | None = None,
                  verbose: bool = True, **options) -> Records:
    """Records of a pretrain/sft/dpo file, from its cache when it matches, else tokenised in parallel and cached.
    A bad line raises BadRecord naming file:line, or with skip_bad is skipped and counted."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    names = ARRAYS[kind]
    key = json.dumps([CACHE_VERSION, kind, sorted(options.items()), skip_bad, tokenizer.fingerprint, file_digest(path)])
    cache_path = f"{path}.{kind}.cache"
    cached = read_cache(cache_path, key)
    if cached is not None:
        arrays, info = cached
        return Records({k: v.reshape(-1, len(names)) if k == "offsets" else v for k, v in arrays.items()}, names)

    size, done, t0, last = os.path.getsize(path), 0, time.time(), 0.0
    columns, notes = [[] for _ in names], Counter()
    processes = processes or min(os.cpu_count() or 1, 8)
    # leaving the block terminates the workers: they must die on SIGTERM (see _init_worker)
    with multiprocessing.Pool(processes, _init_worker, (tokenizer, kind, path, options, skip_bad)) as pool:
        for records, chunk_notes, n_bytes in pool.imap(_encode_chunk, read_units(path)):
            for arrays in records:
                for column, a in zip(columns, arrays):
                    column.append(a)
            notes.update(chunk_notes)
            done += n_bytes
            if verbose and (time.time() - last > 2 or done >= size):
                rate = done / max(time.time() - t0, 1e-9)
                print(f"\rtokenising {path}: {done / 1e6:.1f}/{size / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, "
                      f"ETA {(size - done) / max(rate, 1e-9):.0f}s", end="", file=sys.stderr, flush=True)
                last = time.time()
    if verbose:
        print(file=sys.stderr)
    if not columns[0]:
        raise BadRecord(f"{path}: no usable records")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    lengths = np.array([[len(a) for a in column] for column in columns]).T  # (n_records, n_arrays)
    offsets = np.zeros((len(lengths) + 1, len(names)), dtype=np.int64)
    np.cumsum(lengths, axis=0, out=offsets[1:])
    arrays = {name: np.concatenate(column).astype(np.uint8 if name == "mask" else dtype)
              for name, column in zip(names, columns)}
    arrays["offsets"] = offsets.reshape(-1)
    info = {"records": len(lengths), "tokens": int(lengths[:, 0].sum()), "notes": dict(notes)}
    if verbose:
        print(f"{path}: {info['records']:,} records, {info['tokens']:,} tokens" +
              "".join(f"; {n} x {what}" for what, n in sorted(notes.items())), file=sys.stderr)
    try:
        write_cache(cache_path, key, arrays, info)
    except OSError as e:  # a read-only data directory: train from memory, just slower next time
        print(f"warning: could not write the token cache {cache_path}: {e}", file=sys.stderr)
    arrays["offsets"] = offsets
    return Records(arrays, names)


def load_split(data_path: str, val_data_path: str | None, val_fraction: float, tokenizer, kind: str,
               **kwargs) -> tuple[Records, Records]:
    """(train, validation) records: val_data_path's if given, else the last val_fraction of data_path's."""
    records = tokenize_file(data_path, tokenizer, kind, **kwargs)
    if val_data_path:
        return records, tokenize_file(val_data_path, tokenizer, kind, **kwargs)
    n_val = max(1, round(len(records) * val_fraction))
    if n_val >= len(records):
        raise DataError(f"{data_path}: {len(records)} records are too few to hold out {n_val} for validation")
    return records.split(len(records) - n_val)


# -----------------------------------------------------------------------------
# datasets: item i -> a tuple of rows; a row is (ids, loss_mask or None for "all ones")

class PretrainData:
    """Documents packed end to end, cut into windows of max_seq_len + 1 tokens (consecutive windows share
    one token, so every token is a target exactly once); the tail that fills no window is dropped."""

    def __init__(self, records: Records, max_seq_len: int):
        offsets = records.arrays["offsets"][:, 0]
        self.tokens = records.arrays["tokens"][offsets[records.lo] : offsets[records.hi]]
        self.max_seq_len = max_seq_len

    def __len__(self):
        return max(len(self.tokens) - 1, 0) // self.max_seq_len

    def __getitem__(self, i):
        start = i * self.max_seq_len
        return ((self.tokens[start : start + self.max_seq_len + 1], None),)


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
