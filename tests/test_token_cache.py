"""token_cache.py, data files to token records: each format and its bad lines (file:line), a cache reused, rebuilt and
never trusted half-written; at real sizes flat memory, a direct encoding's arrays, several files read as one."""
import copy
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import demo_data
import token_cache
from chat import encode_chat
from conftest import CONVERSATION, REPO, TINY_MODEL, TINY_RUN, write_jsonl
from data import DPOData, PretrainData, SFTData
from errors import BadRecord, DataError
from faults import run_on_small_disk
from token_cache import tokenize_file
from tokenizer import load_tokenizer


# --- formats and bad lines ------------------------------------------------------------------------

def test_txt_files_are_split_into_documents_at_blank_lines(tok, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("first doc\nline two\n\n\nsecond doc\n", encoding="utf-8")
    records = tokenize_file(str(path), tok, "pretrain", verbose=False)
    assert [tok.decode(records[i][0]) for i in range(len(records))] == ["<s>first doc\nline two</s>", "<s>second doc</s>"]


@pytest.mark.parametrize("line, reason", [
    ('{"text": "ok"', "malformed JSON"),
    ('{"txt": "ok"}', "missing field 'text'"),
    ('{"text": 5}', "'text' must be a string"),
    ('["text"]', "expected a JSON object"),
])
def test_bad_pretrain_lines_name_file_and_line(tok, tmp_path, line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "also fine"}, line])
    with pytest.raises(BadRecord, match=rf"bad\.jsonl:3: .*{reason}"):
        tokenize_file(path, tok, "pretrain", verbose=False)


def test_bad_sft_lines_fail_with_file_line_or_are_skipped_and_counted(tok, tmp_path, capsys):
    good = {"conversations": CONVERSATION[1:3]}
    rows = [good, {"conversations": CONVERSATION[1:2]}, good, {"conversations": [{"role": "user", "content": ""}]}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(BadRecord, match=r"sft\.jsonl:2: "):
        tokenize_file(path, tok, "sft", max_len=64, verbose=False)
    assert len(tokenize_file(path, tok, "sft", max_len=64, skip_bad=True)) == 2


def test_skipped_lines_are_counted_by_reason(tok, tmp_path, capsys):
    good = {"conversations": CONVERSATION[1:3]}
    rows = [good, {"conversations": CONVERSATION[1:2]}, good, {"conversations": CONVERSATION[1:2]}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    records = tokenize_file(path, tok, "sft", max_len=64, skip_bad=True)
    assert len(records) == 2
    assert "2 x skipped: the last message must be the assistant's" in capsys.readouterr().err


def test_sft_records_carry_the_chat_mask_fresh_and_from_the_cache(tok, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": CONVERSATION[1:3]},
                                                {"conversations": CONVERSATION[1:], "system": "You are terse."}])
    for _ in range(2):  # built, then read back from the cache
        records = tokenize_file(path, tok, "sft", max_len=512, verbose=False)
        assert [(ids.tolist(), mask.tolist()) for ids, mask in (records[0], records[1])] == [
            encode_chat(tok, CONVERSATION[1:3]), encode_chat(tok, CONVERSATION)]


def test_both_dpo_formats_load_and_mask_only_the_answers(tok, tmp_path):
    user = {"role": "user", "content": "What is 2 + 3?"}
    rows = [{"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},
            {"chosen": [user, {"role": "assistant", "content": "2 + 3 = 5."}],
             "rejected": [user, {"role": "assistant", "content": "2 + 3 = 6."}]}]
    data = DPOData(tokenize_file(write_jsonl(tmp_path / "d.jsonl", rows), tok, "dpo", verbose=False))
    assert len(data) == 2
    for i in range(2):
        (chosen, cmask), (rejected, rmask) = data[i]
        assert tok.decode(chosen) == "<s>[INST] What is 2 + 3? [/INST] 2 + 3 = 5. </s>"
        assert tok.decode(chosen[cmask == 1]) == " 2 + 3 = 5. </s>"
        assert tok.decode(rejected[rmask == 1]) == " 2 + 3 = 6. </s>"
    assert [a.tolist() for a in data[0][0]] == [a.tolist() for a in data[1][0]]


def test_both_formats_load_through_the_dpo_dataset(demo_dir):
    tok = load_tokenizer()
    data = DPOData(tokenize_file(f"{demo_dir}/dpo.jsonl", tok, "dpo", verbose=False))
    lines = open(f"{demo_dir}/dpo.jsonl", encoding="utf-8").read().splitlines()
    assert len(data) == len(lines) and '"prompt"' in lines[0] and '"prompt"' not in lines[1]
    for i in range(2):
        (chosen, cmask), (rejected, rmask) = data[i]
        assert chosen[-1] == tok.eos_id and cmask[-1] == 1 and rmask[0] == 0


@pytest.mark.parametrize("row", [
    {"prompt": "q", "chosen": "", "rejected": "b"},
    {"prompt": "q", "chosen": "a", "rejected": "  "},
    {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
     "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
])
def test_an_empty_dpo_answer_is_rejected_with_file_line(tok, tmp_path, row):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(BadRecord, match=r"d\.jsonl:2: .*(answer|content)"):
        tokenize_file(path, tok, "dpo", verbose=False)


def test_dpo_truncation_cuts_prompt_left_and_completion_right(tok, tmp_path):
    row = {"prompt": "a long question " * 10, "chosen": "a long answer " * 10, "rejected": "no"}
    records = tokenize_file(write_jsonl(tmp_path / "d.jsonl", [row]), tok, "dpo", max_prompt_length=8,
                            max_completion_length=5, verbose=False)
    prompt, chosen, rejected = records[0]
    full_prompt, _ = encode_chat(tok, [{"role": "user", "content": row["prompt"]}])
    assert prompt.tolist() == full_prompt[-8:]
    assert len(chosen) == 5 and rejected[-1] == tok.eos_id


def test_the_data_report_counts_conversations_cut_to_max_len(tok, tmp_path, capsys):
    """A conversation longer than max_len loses its earliest turns (its last answer whole) or, when the last answer
    alone is too long, the answer's end: each is counted in the line the data report prints."""
    turn = [{"role": "user", "content": "a question " * 8}, {"role": "assistant", "content": "an answer " * 8}]
    rows = [{"conversations": turn[:1] + [{"role": "assistant", "content": "ok"}]},  # fits
            {"conversations": turn * 3},  # too long: earlier turns go, the last is whole
            {"conversations": turn[:1] + [{"role": "assistant", "content": "a very long answer " * 40}]}]
    max_len = len(encode_chat(tok, turn)[0]) + 4
    records = tokenize_file(write_jsonl(tmp_path / "s.jsonl", rows), tok, "sft", max_len=max_len)
    report = capsys.readouterr().err.splitlines()[-1]
    assert report.endswith("; 1 x answer cut at max_len; 1 x earliest turns dropped to fit max_len"), report
    assert len(records[1][0]) <= max_len and records[1][0][-1] == tok.eos_id


# --- the cache ------------------------------------------------------------------------------------

def test_the_cache_is_reused_and_rebuilt_when_source_or_tokenizer_change(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "hello world"}])
    first = tokenize_file(path, tok, "pretrain", verbose=False)
    cache = path + ".pretrain.cache"
    stamp = os.stat(cache).st_mtime_ns
    again = tokenize_file(path, tok, "pretrain", verbose=False)
    assert os.stat(cache).st_mtime_ns == stamp  # reused
    assert len(again) == len(first) and again[0][0].tolist() == first[0][0].tolist()
    write_jsonl(path, [{"text": "hello there world"}])
    second = tokenize_file(path, tok, "pretrain", verbose=False)
    assert second[0][0].tolist() != first[0][0].tolist()
    assert tok.decode(second[0][0]) == "<s>hello there world</s>"

    other = copy.copy(tok)  # same ids, another fingerprint: the cache must not be trusted
    other.fingerprint = "another"
    stamp = os.stat(cache).st_mtime_ns
    tokenize_file(path, other, "pretrain", processes=1, verbose=False)
    assert os.stat(cache).st_mtime_ns != stamp


def test_a_half_written_cache_is_never_trusted(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "hello world"}] * 50)
    tokenize_file(path, tok, "pretrain", verbose=False)
    cache = path + ".pretrain.cache"
    data = open(cache, "rb").read()
    with open(cache, "wb") as f:
        f.write(data[: len(data) // 2])
    records = tokenize_file(path, tok, "pretrain", verbose=False)
    assert len(records) == 50 and os.path.getsize(cache) == len(data)


def header_length(n: int):
    return lambda data: data[:8] + n.to_bytes(8, "little") + data[16:]


def header_json(text: bytes):
    def garble(data):  # the header replaced by text, padded with spaces to its length
        n = int.from_bytes(data[8:16], "little")
        return data[:16] + text.ljust(n) + data[16 + n :]
    return garble


@pytest.mark.parametrize("garble", [header_length(2**60), header_length(2**64 - 1), header_length(0),
                                    header_json(b"[]"), header_json(b'{"key": 1}'), header_json(b"\xff\xfe")],
                         ids=["length_2**60", "length_2**64-1", "length_0", "a_list", "no_layout", "not_utf8"])
def test_a_cache_with_a_garbled_header_is_rebuilt(tok, tmp_path, garble):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": f"hello world {i}"} for i in range(50)])
    tokenize_file(path, tok, "pretrain", verbose=False)
    cache = path + ".pretrain.cache"
    good = open(cache, "rb").read()
    with open(cache, "wb") as f:
        f.write(garble(good))
    records = tokenize_file(path, tok, "pretrain", verbose=False)
    assert [records[i][0].tolist() for i in range(50)] == [
        [tok.bos_id, *tok.encode(f"hello world {i}"), tok.eos_id] for i in range(50)]
    assert open(cache, "rb").read() == good


# --- files of real size ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    return demo_data.documents(500, 20, random.Random(0))


def write_corpus(path, megabytes: float, pool, seed: int = 0) -> str:
    """Pretraining JSONL of about `megabytes`: records of 2-10 demo documents, with the line ends and blank lines
    real files have (\\r\\n, empty and whitespace-only lines, escaped and raw non-ASCII)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8", newline="") as f:
        while f.tell() < megabytes * 1e6:
            text = "\n".join(rng.choices(pool, k=rng.randint(2, 10)))
            f.write(json.dumps({"text": text}, ensure_ascii=rng.random() < 0.3) + rng.choice(["\n", "\r\n"]))
            f.write(rng.choice(["", "", "", "\n", " \u3000\n"]))
    return str(path)


def direct_encoding(path, tok) -> list[list[int]]:
    """The reference: each record of a JSONL file, read by Python's text mode, encoded by the tokenizer itself."""
    with open(path, encoding="utf-8") as f:
        return [[tok.bos_id] + tok.encode(json.loads(line)["text"]) + [tok.eos_id] for line in f if line.strip()]


def as_lists(records) -> list[list[int]]:
    return [records[i][0].tolist() for i in range(len(records))]


# --- memory ---------------------------------------------------------------------------------------

BUILD = """
import json, multiprocessing, resource, sys
import token_cache
from tokenizer import load_tokenizer
tok = load_tokenizer()
# forked from this one-threaded process, the workers are its children, and RUSAGE_CHILDREN sees their peaks
token_cache.worker_context = lambda: multiprocessing.get_context("fork")
def vm(field):  # bytes, from /proc/self/status
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
def workers_peak():  # the largest high-water mark of any child so far
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
# a two-line build first: its workers' peak is the workers' baseline (forked with the parent's RSS, torch included)
with open(sys.argv[1] + ".tiny.jsonl", "w") as f:
    f.write('{"text": "warm up"}\\n{"text": "again"}\\n')  # two chunks of 8 bytes: a pool of two, as below
token_cache.tokenize_file(sys.argv[1] + ".tiny.jsonl", tok, "pretrain", processes=2, chunk_bytes=8, verbose=False)
workers_before = workers_peak()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets this process's high-water mark (VmHWM) to its RSS now
before = vm("VmRSS")
token_cache.tokenize_file(sys.argv[1], tok, "pretrain", processes=2, chunk_bytes=int(sys.argv[2]), verbose=False)
print(json.dumps({"parent": vm("VmHWM") - before, "worker": workers_peak() - workers_before}))
"""


def build_peak(path, chunk_bytes: int) -> int:
    """Memory a build adds to the process tree at its peak, in bytes: the building process's and, for each of
    its two workers, the largest worker's, above what Python, torch and the tokenizer already take."""
    done = subprocess.run([sys.executable, "-c", BUILD, path, str(chunk_bytes)], cwd=REPO, capture_output=True,
                          text=True, check=True)
    m = json.loads(done.stdout.strip().splitlines()[-1])
    return m["parent"] + 2 * max(m["worker"], 0)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures memory through Linux's /proc")
def test_peak_memory_stays_flat_as_the_file_grows(tmp_path, pool):
    # 64 KB chunks make the bound show on a few MB: a build that kept the records until the end would add
    # ~6 bytes per byte of JSONL (~70 MB on the larger file), a streamed one the same few MB for both files
    small = write_corpus(tmp_path / "small.jsonl", 3, pool, seed=1)
    large = write_corpus(tmp_path / "large.jsonl", 12, pool, seed=2)
    peaks = {name: build_peak(path, 1 << 16) for name, path in (("small", small), ("large", large))}
    assert peaks["large"] <= 1.2 * peaks["small"] + (1 << 20), peaks  # + 1 MB: allocator noise


# --- workers --------------------------------------------------------------------------------------

def test_a_worker_dies_on_sigterm_whatever_handler_its_caller_has():
    # a training run catches SIGTERM (runtime.StopSignal): a worker forked from it would catch it too until its
    # initializer ran, and a pool terminated in that window would wait for that worker forever
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        worker = token_cache.worker_context().Process(target=time.sleep, args=(60,))
        worker.start()
        worker.terminate()
        worker.join(30)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_workers_start_only_for_a_file_of_several_chunks_and_never_more_than_its_chunks(tok, tmp_path, pool,
                                                                                        monkeypatch):
    # each worker imports the caller's script (and torch) before its first chunk: seconds on a fresh GPU machine
    # (its bench's 1 MB files took minutes), which a small file must not wait for
    pools, real = [], token_cache.worker_context

    class Counted:
        def Pool(self, processes, *args):
            pools.append(processes)
            return real().Pool(processes, *args)

    monkeypatch.setattr(token_cache, "worker_context", Counted)
    path = write_corpus(tmp_path / "p.jsonl", 0.1, pool)
    size, built = os.path.getsize(path), []
    for chunk_bytes in (size, size // 2 + 1):  # one chunk, then two
        built.append(as_lists(tokenize_file(path, tok, "pretrain", processes=8, chunk_bytes=chunk_bytes,
                                            verbose=False)))
        os.remove(f"{path}.pretrain.cache")
    assert pools == [2]
    assert built[0] == built[1]


# --- a killed build -------------------------------------------------------------------------------

KILLED = """
import os, signal, sys
import token_cache
from tokenizer import load_tokenizer
if sys.argv[2] == "at_commit":  # everything written, killed just before the rename that commits the cache
    os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
token_cache.tokenize_file(sys.argv[1], load_tokenizer(), "pretrain", processes=1, chunk_bytes=1 << 14, verbose=False)
"""


def temp_bytes(path) -> int:
    """Bytes in the temp files of path's cache being built."""
    total = 0
    for part in glob.glob(f"{path}.pretrain.cache.tmp*"):
        try:
            total += os.path.getsize(part)
        except FileNotFoundError:  # committed or removed meanwhile
            pass
    return total


def kill_build(path, when: str):
    """Run a build in its own process group and SIGKILL it (and its worker) mid-way, or let it kill itself at
    the commit."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED, path, when], cwd=REPO, start_new_session=True,
                            stderr=subprocess.DEVNULL)
    if when == "mid_way":
        deadline = time.time() + 60
        while temp_bytes(path) <= 1 << 16:
            assert proc.poll() is None and time.time() < deadline, "the build ended before it could be killed"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("when", ["mid_way", "at_commit"])
def test_a_killed_build_leaves_nothing_trusted_and_the_next_run_rebuilds(tok, tmp_path, pool, capsys, when):
    path = write_corpus(tmp_path / "p.jsonl", 1.5, pool)
    kill_build(path, when)
    records = tokenize_file(path, tok, "pretrain", chunk_bytes=1 << 16)
    assert f"tokenising {path} into" in capsys.readouterr().err  # rebuilt: what the killed run wrote is not used
    assert as_lists(records) == direct_encoding(path, tok)
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl", "p.jsonl.pretrain.cache"]  # the dead build's temp files are gone


# --- a full disk ----------------------------------------------------------------------------------

def test_a_full_disk_while_caching_is_one_error_line_naming_the_cache_and_leaves_no_temp_file(tmp_path, pool):
    """The data file on a small tmpfs: its first cache fits; then the file grows and its new cache does not, once
    where the part files fit but the cache joined from them does not, once where the part files do not. Each run
    of train_pretrain.py stops with one `error:` line naming the cache, leaves no temp file, and the first cache
    is intact."""
    mount, keep = tmp_path / "disk", tmp_path / "keep"
    mount.mkdir()
    keep.mkdir()
    sizes = tmp_path / "sizes"  # the caches' sizes, measured on a disk with room
    sizes.mkdir()
    small = write_corpus(sizes / "small.jsonl", 0.02, pool, seed=1)
    large = write_corpus(sizes / "large.jsonl", 0.6, pool, seed=2)
    cached, tok = {}, load_tokenizer()  # train_pretrain.py's default tokenizer
    for name in (small, large):
        tokenize_file(name, tok, "pretrain", verbose=False)
        cached[name] = os.path.getsize(name + ".pretrain.cache")
    # large's parts (about its cache's size) fit beside it and small's cache, with half a cache to spare
    disk = os.path.getsize(large) + cached[small] + cached[large] * 3 // 2
    largest = write_corpus(sizes / "largest.jsonl", (disk - cached[small] - (64 << 10)) / 1e6, pool, seed=3)
    train = " ".join(f"'{a}'" for a in [sys.executable, "train_pretrain.py", f"--data_path={mount}/p.jsonl",
                                        *TINY_MODEL, *TINY_RUN, "--batch_size=4", "--max_steps=1"])
    script = f"cd {REPO}\n"
    for run, data in enumerate([small, large, largest]):
        script += (f"cp {data} {mount}/p.jsonl\n"
                   f"{train} --out_dir={keep}/out{run} > {keep}/{run}.out 2> {keep}/{run}.err\n"
                   f"echo $? > {keep}/{run}.rc\n"
                   f"ls -a {mount} > {keep}/{run}.listing\n"
                   f"cp {mount}/p.jsonl.pretrain.cache {keep}/{run}.cache\n")
    done = run_on_small_disk(script, mount, f"{disk // 1024}k", timeout=600)
    assert done.returncode == 0, done.stderr
    assert (keep / "0.rc").read_text().strip() == "0", (keep / "0.err").read_text()[-3000:]
    first = (keep / "0.cache").read_bytes()
    for run in (1, 2):
        rc, err = int((keep / f"{run}.rc").read_text()), (keep / f"{run}.err").read_text()
        assert rc == 2 and "Traceback" not in err, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: no space left on the device to write {mount}/p.jsonl.pretrain.cache: nothing was replaced"), err
        assert (keep / f"{run}.listing").read_text().split() == [".", "..", "p.jsonl", "p.jsonl.pretrain.cache"]
        assert (keep / f"{run}.cache").read_bytes() == first  # the first cache, untouched


# --- identical arrays -----------------------------------------------------------------------------

def test_streamed_arrays_equal_a_direct_encoding_for_any_chunk_size(tok, tmp_path, pool, capsys):
    path = write_corpus(tmp_path / "p.jsonl", 0.6, pool)
    expected = direct_encoding(path, tok)
    caches = []
    for chunk_bytes in (1 << 20, 4096, 1):  # one chunk per line at the smallest
        records = tokenize_file(path, tok, "pretrain", chunk_bytes=chunk_bytes)
        assert as_lists(records) == expected
        with open(f"{path}.pretrain.cache", "rb") as f:
            caches.append(f.read())
        os.remove(f"{path}.pretrain.cache")
    assert caches[1] == caches[0] and caches[2] == caches[0]
    err = capsys.readouterr().err
    tokens = sum(map(len, expected))
    assert f"MB/s, {len(expected):,} records, {tokens / 1e6:,.1f}M tokens, ETA 0:00:00" in err  # the progress line
    assert f"{path}: {len(expected):,} records, {tokens:,} tokens" in err


def test_txt_documents_and_sft_masks_equal_a_direct_encoding(tok, tmp_path, pool):
    rng = random.Random(3)
    docs = [d.replace(". ", rng.choice([".\n", ".\r\n"])) for d in rng.choices(pool, k=300)]
    (tmp_path / "p.txt").write_bytes("".join(d + rng.choice(["\n\n", "\r\n\r\n", "\n \n\n"]) for d in docs)
                                     .encode("utf-8"))
    records = tokenize_file(str(tmp_path / "p.txt"), tok, "pretrain", chunk_bytes=2048, verbose=False)
    assert as_lists(records) == [[tok.bos_id] + tok.encode(d.replace("\r\n", "\n")) + [tok.eos_id] for d in docs]

    conversations = [[{"role": role, "content": rng.choice(pool)[: rng.randint(5, 300)]}
                      for _ in range(rng.randint(1, 3)) for role in ("user", "assistant")] for _ in range(300)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in conversations),
                    encoding="utf-8")
    records = tokenize_file(str(path), tok, "sft", max_len=256, chunk_bytes=4096, verbose=False)
    assert [(ids.tolist(), mask.tolist()) for ids, mask in (records[i] for i in range(len(records)))] == [
        tuple(encode_chat(tok, c, max_len=256)) for c in conversations]


# --- several files --------------------------------------------------------------------------------

def split_file(path, out_dir, sizes: list[int]) -> list[str]:
    """The lines of path in consecutive files out_dir/part_0.jsonl, part_1.jsonl, ... of `sizes` lines each."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    parts, start = [], 0
    for i, n in enumerate(sizes + [len(lines) - sum(sizes)]):
        parts.append(os.path.join(out_dir, f"part_{i}.jsonl"))
        with open(parts[-1], "w", encoding="utf-8") as f:
            f.writelines(lines[start : start + n])
        start += n
    return parts


def test_several_files_and_a_glob_give_the_windows_of_one_concatenated_file(tok, tmp_path, pool, capsys):
    (tmp_path / "one").mkdir()
    (tmp_path / "parts").mkdir()
    whole = tmp_path / "one" / "all.jsonl"
    rows = [{"text": d} for d in random.Random(4).choices(pool, k=200)]
    rows[60:60] = [{"text": "ok"}, {"text": "fine"}]
    whole.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # part_1 and part_2 hold one record of a few tokens each: 33-token windows run across three or four files
    parts = split_file(whole, str(tmp_path / "parts"), [60, 1, 1, 70])
    single = PretrainData(tokenize_file(str(whole), tok, "pretrain", verbose=False), 32)
    expected = [single[i][0][0].tolist() for i in range(len(single))]
    pattern, listed = str(tmp_path / "parts" / "part_*"), ",".join(parts)
    for spec in (pattern, listed, pattern):  # the glob again: it now matches the parts' caches too, not data
        multi = PretrainData(tokenize_file(spec, tok, "pretrain"), 32)
        assert [multi[i][0][0].tolist() for i in range(len(multi))] == expected
    assert sorted(glob.glob(str(tmp_path / "parts" / "*.cache"))) == [p + ".pretrain.cache" for p in parts]
    err = capsys.readouterr().err
    n_tokens = [sum(len(tok.encode(r["text"])) + 2 for r in chunk) for chunk in
                (rows[:60], rows[60:61], rows[61:62], rows[62:132], rows[132:])]
    assert f"{parts[1]}: 1 records, {n_tokens[1]:,} tokens" in err
    assert f"{pattern}: 5 files, {len(rows):,} records, {sum(n_tokens):,} tokens" in err

    sft = [{"conversations": [{"role": "user", "content": d[:80]}, {"role": "assistant", "content": d[80:200]}]}
           for d in pool[:50] if len(d) > 100]
    for name, chunk in (("a", sft[:20]), ("b", sft[20:])):
        (tmp_path / "parts" / f"s_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    records = SFTData(tokenize_file(str(tmp_path / "parts" / "s_*.jsonl"), tok, "sft", max_len=128, verbose=False))
    assert [records[i][0][0].tolist() for i in range(len(records))] == [
        encode_chat(tok, r["conversations"], max_len=128)[0] for r in sft]


def test_a_pattern_that_matches_nothing_is_a_data_error_naming_it(tok, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    pattern = str(tmp_path / "pretrain_*.jsonl")
    with pytest.raises(DataError, match=re.escape(f"no data file matches '{pattern}'")):
        tokenize_file(pattern, tok, "pretrain", verbose=False)
    with pytest.raises(FileNotFoundError, match=f"data file not found: {tmp_path}/b.jsonl"):
        tokenize_file(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", tok, "pretrain", verbose=False)
    with pytest.raises(DataError, match="names .*a.jsonl twice"):
        tokenize_file(f"{tmp_path}/a.jsonl,{tmp_path}/*.jsonl", tok, "pretrain", verbose=False)
    assert token_cache.file_digest(str(tmp_path / "*.jsonl")) != token_cache.file_digest(str(tmp_path / "a.jsonl"))


# --- a read-only data directory -------------------------------------------------------------------

def test_a_read_only_data_directory_gets_its_cache_under_the_home_directory(tok, tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "p.jsonl", 0.01, ["a short document.", "一个短文档。"])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(token_cache.os, "access", lambda p, mode: os.path.abspath(p) != str(tmp_path))  # (root writes anyway)
    records = tokenize_file(path, tok, "pretrain", verbose=False)
    assert as_lists(records) == direct_encoding(path, tok)
    assert sorted(os.listdir(tmp_path)) == ["home", "p.jsonl"]  # nothing written beside the data
    (cache,) = glob.glob(str(tmp_path / "home" / ".cache" / "nanomind" / "p.jsonl.*.pretrain.cache"))
    stamp = os.stat(cache).st_mtime_ns
    tokenize_file(path, tok, "pretrain", verbose=False)
    assert os.stat(cache).st_mtime_ns == stamp  # found there again, not rebuilt
