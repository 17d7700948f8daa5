"""Train a tokenizer on JSONL / text files.

    python train_tokenizer.py data/pretrain.jsonl --vocab_size=6400 --out=tokenizer
    python train_tokenizer.py a.jsonl b.txt --out=tok_sp --backend=sentencepiece
    python train_tokenizer.py data/pretrain_hq.jsonl --max_chars=200_000_000 --out=tok   # a large corpus

tiktoken backend (default): byte-level BPE trained here in pure Python, written as
OUT/tokenizer.tiktoken + OUT/nanomind.json. sentencepiece backend: OUT/tokenizer.model.
Either way vocab_size counts everything, special tokens included, and load_tokenizer(OUT) loads it.
"""
from __future__ import annotations

import base64
import heapq
import io
import json
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from config import load_config, usage, words
from errors import ConfigError, DataError, cli
from tokenizer import CHAT_TOKENS, PATTERN, SPECIAL_TOKENS, load_tokenizer


@dataclass
class Config:
    # --- I/O
    input: list[str] = words("FILE...")  # .jsonl (text / conversations / DPO records) or .txt files
    out: str | None = None  # the output directory (required)
    # --- the tokenizer
    vocab_size: int = 6400  # total, special tokens included
    backend: str = "tiktoken"  # tiktoken | sentencepiece
    max_chars: int = 0  # train on about this many characters sampled evenly across the input (0: all of it)


# --- reading the corpus -------------------------------------------------------------------------
def record_texts(record: object) -> list[str]:
    """Every text string in a MiniMind pretrain / SFT / DPO record; [] if it has none."""
    if not isinstance(record, dict):
        return []
    texts = [record["text"]] if "text" in record else []
    texts += [record[k] for k in ("system", "prompt") if k in record]
    for key in ("conversations", "chosen", "rejected"):
        value = record.get(key)
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts += [m.get("content") if isinstance(m, dict) else m for m in value]
    if not all(isinstance(t, str) for t in texts):
        return []
    return texts


def line_texts(line: bytes, where: str) -> list[str]:
    """The texts of one JSONL line ([] if blank); `where` (file:line) names it in an error."""
    if not line.strip():
        return []
    try:
        record = json.loads(line)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise DataError(f"{where}: malformed JSON line: {e}") from None
    texts = record_texts(record)
    if not texts:
        raise DataError(f"{where}: no string 'text', 'conversations' or 'chosen'/'rejected' field")
    return texts


def iter_texts(path: str | Path) -> Iterator[str]:
    """Texts of a .txt file (in ~1 MB pieces of whole lines) or of a JSONL file (per record)."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.suffix == ".txt":
            for lines in iter(lambda: f.readlines(1 << 20), []):
                try:
                    yield b"".join(lines).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}: not UTF-8 text: {e}") from None
            return
        for n, line in enumerate(f, 1):
            yield from line_texts(line, f"{path}:{n}")


def sample_texts(paths: list[str], max_chars: int, n_ranges: int | None = None) -> Iterator[str]:
    """About max_chars characters drawn evenly from the whole input, not from its start: each file is cut into
    byte ranges (n_ranges over all files, in proportion to their sizes; by default one per 100k characters, at
    most 1000) and each range gives the whole records (JSONL lines; lines of a .txt) that start in it, up to its
    share of characters. Only those are read, so time and memory follow max_chars, not the size of the input;
    a budget above the input's size reads all of it."""
    n_ranges = n_ranges or min(1000, max(1, max_chars // 100_000))
    sizes = [os.path.getsize(p) for p in paths]
    for path, size in zip(paths, sizes):
        ranges = max(1, round(n_ranges * size / max(sum(sizes), 1)))
        share = max_chars * size / max(sum(sizes), 1) / ranges  # characters per range
        with open(path, "rb") as f:
            for j in range(ranges):
                yield from range_texts(f, j * size // ranges, (j + 1) * size // ranges, share)


def range_texts(f, start: int, end: int, share: float) -> Iterator[str]:
    """The texts of the records of file f that start in bytes [start, end), until they hold `share` characters;
    a .txt range is one text, its lines joined."""
    f.seek(max(start - 1, 0))
    if start > 0:
        f.readline()  # to the first line that starts at or after start
    lines, chars = [], 0
    while chars < share and f.tell() < end and (line := f.readline()):
        if f.name.endswith(".txt"):
            lines.append(line)
            chars += len(line)  # bytes: at least the characters
        else:
            texts = line_texts(line, f"{f.name} (byte {f.tell() - len(line)})")
            chars += sum(map(len, texts))
            yield from texts
    if lines:
        try:
            yield b"".join(lines).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f.name} (bytes {start}-{end}): not UTF-8 text: {e}") from None


def count_chunks(texts: Iterable[str]) -> Counter[bytes]:
    """How often each pre-tokenised chunk occurs: BPE never merges across chunks, so this is all
    the trainer needs to see of the corpus."""
    split = re.compile(PATTERN).findall
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(split(text))
    # surrogatepass: a lone surrogate (legal in JSON) still counts; tiktoken maps it to U+FFFD
    return Counter({chunk.encode("utf-8", "surrogatepass"): n for chunk, n in counts.items()})


# --- byte-level BPE -----------------------------------------------------------------------------
def train_bpe(chunk_counts: dict[bytes, int], n_merges: int, verbose: bool = True) -> dict[bytes, int]:
    """Merge the most frequent adjacent pair n_merges times; return tiktoken's mergeable ranks
    (token bytes -> rank = id): the 256 bytes first, then each new token in merge order.

    Counts are kept incrementally: a merge rewrites only the chunks that hold the pair (found via
    `where`) and adjusts only the counts of pairs next to each rewritten occurrence. Ties go to the
    smallest pair of ids, so training is deterministic.

    Every merge makes new bytes (tiktoken knows tokens by their bytes only): a span that is one
    token in some chunk was never cut across before, so it evolved exactly like the isolated
    string, and the same bytes cannot come from two different pairs.
    """
    vocab = [bytes([i]) for i in range(256)]  # id -> token bytes
    chunks = [list(c) for c in chunk_counts]  # each unique chunk as a list of token ids
    freqs = list(chunk_counts.values())
    counts, where = pair_counts(chunks, freqs)
    # max-heap by (count, then smallest pair). Counts only fall, except for pairs with the new
    # token, which are pushed fresh; a popped entry with a stale count is re-pushed, not used.
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    t0 = last_log = time.time()
    while len(vocab) < 256 + n_merges:
        pair, count = most_frequent(heap, counts, merges_so_far=len(vocab) - 256)
        new = len(vocab)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        for p, d in merge(chunks, freqs, where, pair, new).items():
            counts[p] += d
            if d > 0:
                heapq.heappush(heap, (-counts[p], p))
        assert counts.pop(pair) == 0, "incremental pair counts went wrong"
        done = len(vocab) - 256
        if verbose and (time.time() - last_log > 5 or done == n_merges):
            last_log, elapsed = time.time(), time.time() - t0
            print(f"merge {done}/{n_merges} | count {count} | {vocab[new]!r} | {done / elapsed:.0f} "
                  f"merges/s | elapsed {elapsed:.0f}s | ETA {elapsed / done * (n_merges - done):.0f}s",
                  flush=True)
    return {t: i for i, t in enumerate(vocab)}


def pair_counts(chunks: list[list[int]], freqs: list[int]):
    """(pair -> occurrences in the corpus, pair -> the chunks that may hold it)."""
    counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for ci, (ids, f) in enumerate(zip(chunks, freqs)):
        for pair in zip(ids, ids[1:]):
            counts[pair] += f
            where[pair].add(ci)
    return counts, where


def most_frequent(heap: list, counts: dict, merges_so_far: int) -> tuple[tuple[int, int], int]:
    """Pop the heap until its top holds a pair's current count: (that pair, its count)."""
    while heap:
        neg_count, pair = heapq.heappop(heap)
        count = counts.get(pair, 0)
        if count == -neg_count:
            return pair, count
        if count > 0:
            heapq.heappush(heap, (-count, pair))
    raise DataError(f"corpus too small: no pairs left after {merges_so_far} merges")


def merge(chunks: list[list[int]], freqs: list[int], where, pair: tuple[int, int], new: int) -> dict:
    """Rewrite every occurrence of pair as the token new in the chunks that hold it (in place, updating `where`);
    return how the pair counts change."""
    a, b = pair
    delta: defaultdict[tuple[int, int], int] = defaultdict(int)
    for ci in where.pop(pair):
        ids, f, i = chunks[ci], freqs[ci], 0
        while True:
            try:
                i = ids.index(a, i)
            except ValueError:
                break
            if i + 1 < len(ids) and ids[i + 1] == b:
                delta[pair] -= f
                if i > 0:  # left neighbour x: (x, a) -> (x, new)
                    x = ids[i - 1]
                    delta[x, a] -= f
                    delta[x, new] += f
                    where[x, new].add(ci)
                if i + 2 < len(ids):  # right neighbour y: (b, y) -> (new, y)
                    y = ids[i + 2]
                    delta[b, y] -= f
                    delta[new, y] += f
                    where[new, y].add(ci)
                ids[i:i + 2] = [new]
            i += 1
    return delta


def write_tiktoken(ranks: dict[bytes, int], out: Path) -> None:
    """OUT/tokenizer.tiktoken in tiktoken's format, OUT/nanomind.json with pattern and specials
    (named so as not to look like a Hugging Face tokenizer.json, the name it had before)."""
    lines = [base64.b64encode(t) + b" " + str(r).encode()
             for t, r in sorted(ranks.items(), key=lambda item: item[1])]
    (out / "tokenizer.tiktoken").write_bytes(b"\n".join(lines) + b"\n")
    special = {t: len(ranks) + i for i, t in enumerate(SPECIAL_TOKENS)}
    meta = {"pattern": PATTERN, "special_tokens": special, "vocab_size": len(ranks) + len(special)}
    (out / "nanomind.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    old_meta = out / "tokenizer.json"  # this writer's output before the rename, now stale; an HF file stays
    if old_meta.is_file() and old_meta.read_bytes().startswith(b'{\n "pattern": '):
        old_meta.unlink()


# --- SentencePiece ------------------------------------------------------------------------------
def train_sentencepiece(texts: Iterable[str], vocab_size: int, out: Path) -> None:
    """OUT/tokenizer.model: BPE with byte fallback, so any text encodes and round-trips."""
    import sentencepiece as spm
    # read everything first: a bad input line then fails here, before SentencePiece starts
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        # identity: the default NFKC would turn Chinese "，" into "," and collapse spaces
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>", unk_piece="<unk>",
        # control, not user-defined: SentencePiece matches user-defined symbols inside ordinary
        # text, so a literal "[INST]" in data would become the special id
        control_symbols=CHAT_TOKENS, minloglevel=1)
    (out / "tokenizer.model").write_bytes(model.getvalue())


def main(argv: list[str]) -> None:
    (args,) = load_config(argv, Config)
    if not args.input or args.out is None:
        raise ConfigError(f"{usage([Config])}: name at least one input FILE and the output directory --out=DIR")
    if args.backend not in ("tiktoken", "sentencepiece"):
        raise ConfigError(f"config key 'backend' must be tiktoken or sentencepiece, got {args.backend!r}")
    out = Path(args.out)
    other = out / ("tokenizer.model" if args.backend == "tiktoken" else "tokenizer.tiktoken")
    if other.exists():
        raise ConfigError(f"{other} exists: load_tokenizer({str(out)!r}) would be ambiguous; remove it")
    out.mkdir(parents=True, exist_ok=True)
    if args.max_chars > 0:
        texts = sample_texts(args.input, args.max_chars)
    else:
        texts = (t for path in args.input for t in iter_texts(path))
    t0 = time.time()
    if args.backend == "sentencepiece":
        train_sentencepiece(texts, args.vocab_size, out)
    else:
        n_merges = args.vocab_size - 256 - len(SPECIAL_TOKENS)
        if n_merges < 0:
            raise ConfigError(f"--vocab_size must be at least {256 + len(SPECIAL_TOKENS)}")
        chunk_counts = count_chunks(texts)
        print(f"{len(chunk_counts):,} unique chunks, {sum(chunk_counts.values()):,} in all "
              f"({time.time() - t0:.1f}s)", flush=True)
        write_tiktoken(train_bpe(chunk_counts, n_merges), out)
    tok = load_tokenizer(out)
    sample = "Hello, 世界! 12+34=46 [INST]"
    print(f"wrote {out} ({args.backend}, vocab_size {tok.vocab_size}, {time.time() - t0:.0f}s): "
          f"{sample!r} -> {tok.encode(sample)}")


if __name__ == "__main__":
    cli(main)
