"""dedup.py and minhash.py: lightly edited copies are found and texts sharing only a boilerplate line are not, in
English and Chinese; estimates are close to the exact Jaccard similarity of the shingle sets; the vectorised
signatures equal a naive loop; dedup keeps the first of each cluster and the order of the rest, compares
conversations on their text, leaves IN untouched and replaces OUT atomically; its memory does not grow with the
texts; its command line."""
import json
import os
import random
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

import dedup
import minhash
from conftest import REPO
from errors import BadRecord, ConfigError, DataError, DiskFullError

BOILERPLATE = {"en": "Copyright (c) Example News. All rights reserved. Reproduction without permission is prohibited.",
               "zh": "本文来源：人民日报。未经许可，不得转载。版权所有，侵权必究。"}


def make_text(rng: random.Random, lang: str, sentences: int | None = None) -> str:
    """Seeded prose, ~2 KB unless sentences says: English-like words of random letters, or Chinese two-character
    words from 600 characters."""
    out, sentences = [], sentences or {"en": 40, "zh": 80}[lang]
    for _ in range(sentences):
        if lang == "en":
            words = ["".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(2, 8)))
                     for _ in range(rng.randint(6, 14))]
            out.append(" ".join(words).capitalize() + rng.choice([". ", ", ", "; "]))
        else:
            words = [chr(0x4E00 + rng.randrange(600)) + chr(0x4E00 + rng.randrange(600))
                     for _ in range(rng.randint(2, 6))]
            out.append("".join(words) + rng.choice(["，", "。", "；"]))
    return "".join(out).strip()


def light_edit(rng: random.Random, text: str) -> str:
    """Three characters changed, a line broken, a space doubled, a punctuation mark swapped, capitals at the start."""
    chars = list(text)
    for k in rng.sample(range(len(chars)), 3):
        chars[k] = rng.choice("xqz的了是")
    text = "".join(chars)
    middle = len(text) // 2
    text = text[:middle] + "\n" + text[middle:]
    text = text.replace(" ", "  ", 1).replace("，", ",", 1).replace(". ", "! ", 1)
    return text[:20].upper() + text[20:]


def shingles(text: str) -> set[str]:
    """The oracle: the set of character 5-grams after NFKC, case folding and collapsing whitespace."""
    s = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return {s[i : i + 5] for i in range(max(len(s) - 4, 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


# --- the finder ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lang", ["en", "zh"])
def test_edited_copies_are_found_and_texts_sharing_only_a_boilerplate_line_are_not(lang):
    rng = random.Random(lang)
    originals = [make_text(rng, lang) for _ in range(20)]
    boilerplate = [make_text(rng, lang, {"en": 3, "zh": 6}[lang]) + "\n" + BOILERPLATE[lang] for _ in range(6)]
    edited = [light_edit(rng, t) for t in originals[:10]]
    assert all(a != b and jaccard(a, b) > 0.92 for a, b in zip(originals, edited))  # light edits
    assert 0.15 < max(jaccard(a, b) for a in boilerplate for b in boilerplate if a != b) < 0.5  # the line shared
    texts = originals + boilerplate + edited + [originals[3]]
    finder = minhash.DuplicateFinder(threshold=0.8)
    finder.add(texts[:17])  # two batches, a cluster spanning both
    finder.add(texts[17:])
    d = finder.find()
    assert d.of.tolist() == [-1] * 26 + list(range(10)) + [3]
    assert d.exact.tolist() == [False] * 36 + [True]
    assert all(abs(d.similarity[26 + i] - jaccard(originals[i], edited[i])) < 0.1 for i in range(10))


def test_estimated_similarity_is_close_to_the_exact_jaccard():
    rng = random.Random(0)
    pairs = []
    for k in range(60):  # pairs sharing a random share of their sentences: similarities all over [0, 1]
        lang = "en" if k % 2 else "zh"
        a = [make_text(rng, lang, sentences=1) for _ in range(20)]
        keep = rng.random()
        b = [s if rng.random() < keep else make_text(rng, lang, sentences=1) for s in a]
        pairs.append(("".join(a), "".join(b)))
    exact = np.array([jaccard(a, b) for a, b in pairs])
    mh = minhash.MinHash(num_perm=128, seed=0)
    signatures = mh.signatures([t for pair in pairs for t in pair])
    error = minhash.similarity(signatures[0::2], signatures[1::2]) - exact
    assert exact.min() < 0.2 and exact.max() > 0.8
    assert np.abs(error).mean() < 0.05 and abs(error.mean()) < 0.02  # standard error 0.044 at most, no bias


def test_signatures_equal_a_naive_loop_across_block_boundaries(monkeypatch):
    """The oracle: each text alone, each hash function in turn, in Python integers (mod 2^64)."""
    M = 2**64

    def mix(h):  # splitmix64's finaliser
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) % M
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) % M
        return h ^ (h >> 31)

    def naive(text, a, b):
        s = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
        grams = [s[i : i + 5] for i in range(max(len(s) - 4, 1))] if s else []
        xs = []
        for g in grams:
            h = 0
            for c in g:
                h = (h * 0x100000001B3 + ord(c)) % M
            xs.append(mix(h) >> 32)
        return [min(((int(ai) * x + int(bi)) % M) >> 32 for x in xs) if xs else 2**32 - 1 for ai, bi in zip(a, b)]

    monkeypatch.setattr(minhash, "BLOCK", 7)  # texts spanning blocks, blocks holding several texts
    texts = ["", "ab", "Hello,  WORLD!", "你好，世界。你好", "x" * 30, "", "Full-width ＡＢＣ，and more."]
    mh = minhash.MinHash(num_perm=16, seed=3)
    assert mh.signatures(texts).tolist() == [naive(t, mh.a, mh.b) for t in texts]


# --- dedup.py -----------------------------------------------------------------------------------

def write_lines(path, records) -> bytes:
    data = "".join((json.dumps(r, ensure_ascii=False) if r is not None else "") + "\n" for r in records).encode()
    path.write_bytes(data)
    return data


def test_dedup_keeps_the_first_of_each_cluster_and_the_order_of_the_rest(tmp_path, capsys):
    rng = random.Random(1)
    texts = [make_text(rng, lang) for lang in ["en", "zh"] * 6]
    copies = {3: light_edit(rng, texts[0]), 6: texts[1], 9: light_edit(rng, texts[4]), 12: texts[4],
              14: light_edit(rng, texts[0])}  # position in the file -> a copy of an earlier text
    records = [{"text": t} for t in texts]
    for position, text in sorted(copies.items()):
        records.insert(position, {"text": text, "id": position})
    records.insert(5, None)  # a blank line: not a record
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = write_lines(src, records)
    dedup.main([str(src), str(out)])
    expected = [line for r, line in zip(records, data.decode().splitlines(keepends=True)) if r and "id" not in r]
    assert out.read_text() == "".join(expected)  # the originals, byte for byte, in their order
    assert src.read_bytes() == data
    report = capsys.readouterr().out
    assert "exact duplicates: 2 (" in report and "near duplicates (estimated Jaccard >= 0.8" in report
    assert ": 3 (" in report.split("near duplicates")[1] and f"wrote {out}: 12 records" in report


def test_conversations_are_compared_on_their_text(tmp_path):
    rng = random.Random(2)

    def chat(*contents, **extra):
        roles = ["user", "assistant"] * len(contents)
        return {"conversations": [{"role": r, "content": c} for r, c in zip(roles, contents)], **extra}

    q, a, other = make_text(rng, "en", 4), make_text(rng, "zh", 12), make_text(rng, "zh", 12)
    records = [chat(q, a), chat(q, other),
               chat(q, a, system="You are helpful."),  # the same text, another system prompt: an exact duplicate
               {"conversations": [{"role": "system", "content": ""}, *chat(q, light_edit(rng, a))["conversations"]]},
               chat(q, make_text(rng, "zh", 12))]  # the same question, another answer
    src, out = tmp_path / "sft.jsonl", tmp_path / "out.jsonl"
    data = write_lines(src, records)
    dedup.main([str(src), str(out), "--field=conversations"])
    assert out.read_text().splitlines() == [data.decode().splitlines()[i] for i in (0, 1, 4)]


def test_a_bad_line_is_one_error_naming_it_and_out_is_left_as_it_was(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"text": "one"}\n\n{"text": "two"\n{"text": "three"}\n')
    out.write_text("the previous output\n")
    done = subprocess.run([sys.executable, "dedup.py", str(src), str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {src}:3: malformed JSON")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert out.read_text() == "the previous output\n" and sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]
    src.write_text('{"text": "one"}\n{"title": "two"}\n')
    with pytest.raises(BadRecord, match=f"{src}:2: missing field 'text'"):
        dedup.main([str(src), str(out)])


def test_out_is_replaced_atomically_or_not_at_all(tmp_path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = write_lines(src, [{"text": f"record {i} " * 20} for i in range(50)])
    out.write_text("the previous output\n")

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # the disk fills while OUT's temp file is written
        m.setattr(os, "fsync", failing_fsync)
        with pytest.raises(DiskFullError, match=r"^no space left on the device to write .*out\.jsonl: nothing was replaced"):
            dedup.main([str(src), str(out)])
    find_duplicates = dedup.find_duplicates

    def find_then_append(path, cfg):  # IN grows between the two passes
        found = find_duplicates(path, cfg)
        with open(path, "a") as f:
            f.write('{"text": "late"}\n')
        return found

    monkeypatch.setattr(dedup, "find_duplicates", find_then_append)
    with pytest.raises(DataError, match="changed while dedup read it"):
        dedup.main([str(src), str(out)])
    assert out.read_text() == "the previous output\n" and sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]
    assert src.read_bytes()[: len(data)] == data


def test_out_may_not_be_in(tmp_path):
    src = tmp_path / "in.jsonl"
    data = write_lines(src, [{"text": "one"}, {"text": "one"}])
    os.symlink(src, tmp_path / "link.jsonl")
    for out in (src, tmp_path / "link.jsonl", tmp_path / "." / "in.jsonl"):
        with pytest.raises(ConfigError, match="is IN"):
            dedup.main([str(src), str(out)])
    assert src.read_bytes() == data


# a script run as __main__, then its own peak resident set: VmHWM belongs to the process image exec started, whereas
# ru_maxrss (getrusage, wait4) also keeps the peak of the parent's image the child was forked from, here pytest's
RUN_AND_REPORT_PEAK = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")), file=sys.stderr)"""


def test_memory_does_not_grow_with_the_texts(tmp_path):
    """Peak resident memory of dedup.py on N and 4N records of ~2 KB: what grows is the signatures (~350 bytes a
    record), not the texts; one that held the texts would grow by at least the input's growth."""
    rng = random.Random(3)
    lines = [json.dumps({"text": make_text(rng, "en")[:2000]}) + "\n" for _ in range(4000)]

    def peak_rss(n):
        (tmp_path / "in.jsonl").write_text("".join(lines[:n]))
        done = subprocess.run([sys.executable, "-c", RUN_AND_REPORT_PEAK, "dedup.py", str(tmp_path / "in.jsonl"),
                               str(tmp_path / "out.jsonl")], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return int(done.stderr.split()[-2]) * 1024, os.path.getsize(tmp_path / "in.jsonl")

    (rss_small, size_small), (rss_large, size_large) = peak_rss(1000), peak_rss(4000)
    assert rss_large - rss_small < (size_large - size_small) / 3


# --- the command line ---------------------------------------------------------------------------

def test_help_lists_every_key_and_a_bad_key_or_value_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        dedup.main(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: python dedup.py IN.jsonl OUT.jsonl")
    listed = {line.split()[0] for line in help_text.splitlines() if line.startswith("  --")}
    assert {"--field=text", "--threshold=0.8"} <= listed
    src = tmp_path / "in.jsonl"
    write_lines(src, [{"text": "one"}])
    for args, named in [(["--thresold=0.9"], "'thresold'"), (["--threshold=1.5"], "'threshold' must be in"),
                        (["--threshold=high"], "'threshold'")]:
        with pytest.raises(ConfigError, match=named):
            dedup.main([str(src), str(tmp_path / "out.jsonl"), *args])
    with pytest.raises(ConfigError, match="usage: python dedup.py"):
        dedup.main([str(src)])
