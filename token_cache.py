"""
From data files to token records, cached. data_path names one file, a glob pattern ("data/pretrain_*.jsonl") or
several of them separated by commas; the files are read as one, in that order (each pattern's matches sorted).

  pretrain  {"text": ...} lines or .txt files  -> <s> doc </s>
  sft       {"conversations": [...]}           -> the tokenizer's chat template and its loss mask (chat.py)
  dpo       {"prompt","chosen","rejected"} or {"chosen": [msgs], "rejected": [msgs]} -> prompt + two answers

Each file is tokenised once, in parallel processes, into FILE.<kind>.cache beside it (under ~/.cache/nanomind if
its directory is read-only), streamed to disk chunk by chunk so that memory does not grow with the file; the cache
is reused while the file, the tokenizer and the encoding options are unchanged, and rebuilt (atomically) when any
of them changes. Records reads the caches memory-mapped: a corpus of many GB never has to fit in RAM.
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

from chat import encode_chat, json_type
from errors import BadRecord, DataError
from fileio import atomic_write, disk_full, full_disk_error


# -----------------------------------------------------------------------------
# one record (a parsed JSONL line) -> token arrays; BadRecord names what is wrong, the caller adds file:line

def encode_pretrain(tokenizer, record, max_len=None):
    text = record.get("text")
    if not isinstance(text, str):
        raise BadRecord("missing field 'text'" if text is None else f"'text' must be a string, got {json_type(text)}")
    return (np.array([tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id]),), []


def encode_sft(tokenizer, record, max_len=None):
    if "conversations" not in record:
        raise BadRecord("missing field 'conversations'")
    ids, mask = encode_chat(tokenizer, record["conversations"], record.get("system"))  # checks each message
    if record["conversations"][-1]["role"] != "assistant":
        raise BadRecord("the last message must be the assistant's")
    cut = max_len is not None and len(ids) > max_len
    if cut:  # rendered again to fit: the data report counts what was lost
        ids, mask = encode_chat(tokenizer, record["conversations"], record.get("system"), max_len)
    if not any(mask):  # the prompt alone fills max_len: nothing to learn, so no batch is ever all-masked
        return None, [f"skipped: no assistant token fits in {max_len} tokens"]
    end = len(mask) - mask[::-1].index(1)  # after the last answer token: ChatML's closing "\n" teaches nothing
    if ids[end - 1] != tokenizer.eos_id:
        notes = ["answer cut at max_len"]
    else:
        notes = ["earliest turns dropped to fit max_len"] if cut else []
    return (np.array(ids[:end]), np.array(mask[:end], dtype=np.uint8)), notes


def dpo_prompt_and_answers(record) -> tuple[list[dict], dict, dict]:
    """Both DPO formats -> (prompt messages, chosen assistant message, rejected assistant message)."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        if len(chosen) < 2 or len(rejected) < 2 or chosen[:-1] != rejected[:-1]:
            raise BadRecord("'chosen' and 'rejected' must be message lists sharing everything but the last message "
                            "(the prompt, at least one message)")
        if any(not isinstance(m[-1], dict) or m[-1].get("role") != "assistant" for m in (chosen, rejected)):
            raise BadRecord("'chosen' and 'rejected' must end with an assistant message")
        return chosen[:-1], chosen[-1], rejected[-1]
    if "prompt" in record:
        for name, what in (("prompt", "the prompt"), ("chosen", "the chosen answer"),
                           ("rejected", "the rejected answer")):
            if not isinstance(record.get(name), str) or not record[name].strip():
                raise BadRecord(f"{what} must be a non-empty string")
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

# what token_cache.py and train_dpo.py write beside a data file: FILE.<kind>.cache (and its temp files), FILE.ref-KEY.pt
CACHE_NAME = re.compile(rf"\.({'|'.join(ARRAYS)})\.cache(\.tmp.*)?$|\.ref-[0-9a-f]+\.pt(\.tmp)?$")


def expand_paths(data_path: str) -> list[str]:
    """'data/a.jsonl', 'data/pretrain_*.jsonl' or 'a.jsonl,more/*.txt' -> the files, in the order given, each
    pattern's matches sorted (a stable order); the token caches written beside them never match."""
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
    except ValueError:  # valid JSON that Python will not turn into an int
        raise BadRecord("a number of over 4300 digits") from None
    except RecursionError:
        raise BadRecord("JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {json_type(record)}")
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
WORKER_STATE = ("tokenizer", "kind", "path", "options", "skip_bad", "dtypes")  # what _encode_chunk reads


def _init_worker(*state):
    # a worker must die on SIGTERM, and leave Ctrl-C to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(zip(WORKER_STATE, state))


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


def worker_context():
    """Workers forked from a server process that only imported this module, never from the caller: a fork of a
    process with other threads (a server's, a progress bar's) copies the locks they hold, and one of the caller's
    signal handlers (a training run's SIGTERM) would keep a worker alive until its initializer ran."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # started once per process; its forks need not import anything
    return ctx


def encode_chunks(path: str, tokenizer, kind: str, options: dict, skip_bad: bool, processes: int, chunk_bytes: int):
    """The workers' results for path's chunks, in file order. At most two chunks per process are in flight, so
    memory does not grow with the file, even when writing falls behind (Pool.imap would queue results)."""
    initargs = (tokenizer, kind, path, options, skip_bad, array_dtypes(kind, tokenizer))
    # never more workers than chunks, and with one (a file of one chunk, or processes=1) no pool at all: each
    # worker first imports the caller's script (torch with it), seconds on a fresh machine, which a small file
    # must not wait for
    processes = min(processes, -(-os.path.getsize(path) // chunk_bytes))
    if processes <= 1:
        _worker.update(zip(WORKER_STATE, initargs))
        try:
            yield from map(_encode_chunk, read_chunks(path, chunk_bytes))
        finally:
            _worker.clear()
        return
    # leaving the block terminates the workers: they must die on SIGTERM (see _init_worker)
    with worker_context().Pool(processes, _init_worker, initargs) as pool:
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
    with atomic_write(path, tmp=f"{path}.tmp{os.getpid()}") as f:  # the pid's: ranks may build it at once
        f.write(CACHE_MAGIC + len(header).to_bytes(8, "little") + header)
        for name, (part, _) in parts.items():
            f.seek(start + layout[name][1])
            with open(part, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        f.truncate(start + offset)


def read_cache(path: str, key: str):
    """(arrays as read-only memmaps, info) if path holds a complete cache for key, else None."""
    try:
        with open(path, "rb") as f:
            if f.read(len(CACHE_MAGIC)) != CACHE_MAGIC:
                return None
            n = int.from_bytes(f.read(8), "little")
            if len(CACHE_MAGIC) + 8 + n > os.fstat(f.fileno()).st_size:  # a garbled length: never read 2**60 bytes
                return None
            header = json.loads(f.read(n))
        start = -(-(len(CACHE_MAGIC) + 8 + n) // 64) * 64
        if not isinstance(header, dict) or header.get("key") != key:
            return None
        arrays = {name: np.memmap(path, dtype=np.dtype(dt), mode="r", offset=start + off, shape=(n,))
                  for name, (dt, off, n) in header["layout"].items()}
        return arrays, header["info"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
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

    def lengths(self, array: int = 0) -> np.ndarray:
        """(n,) int64: the length of each record's array-th array (DPO: 0 prompt, 1 chosen, 2 rejected), from the
        offsets alone (no token is read)."""
        parts = []
        for f, arrays in enumerate(self.files):
            a, b = max(self.lo, self.starts[f]) - self.starts[f], min(self.hi, self.starts[f + 1]) - self.starts[f]
            if a < b:
                parts.append(np.diff(arrays["offsets"][a : b + 1, array].astype(np.int64)))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

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
        try:
            os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
            remove_dead_temps(cache)
            if verbose:
                print(f"tokenising {path} into {cache}{other_ranks_wait()}", file=sys.stderr, flush=True)
            build_cache(path, cache, key, tokenizer, kind, options, skip_bad,
                        processes or min(os.cpu_count() or 1, 8), chunk_bytes, verbose)
        except OSError as e:
            if disk_full(e):  # build_cache has removed its temp files; the old cache (if any) was never touched
                raise full_disk_error(cache) from None
            raise
    arrays, info = read_cache(cache, key)
    arrays["offsets"] = arrays["offsets"].reshape(-1, len(ARRAYS[kind]))
    return arrays, info


def other_ranks_wait() -> str:
    """Under torchrun, train_*.py let rank 0 tokenise while the other ranks wait (run.rank0_first()): say so."""
    others = int(os.environ.get("WORLD_SIZE", "1")) - 1  # torchrun's; read here so the workers need no torch
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
    return records.split(len(records) - held_out(len(records), val_fraction, data_path, "records"))


def held_out(n: int, val_fraction: float, data_path: str, items: str) -> int:
    """How many of n items the last val_fraction holds out for validation: at least one, and never all."""
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise DataError(f"{data_path}: {n} {items} are too few to hold out {n_val} for validation")
    return n_val
