"""Tokenizer invariants on tiny tokenizers trained here, on a corpus generated here; the trainer's sample of a large
corpus is spread over all of it."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import tiktoken

import tokenizer as tk
from conftest import CHECK, corpus_lines, random_strings
from tokenizer import PATTERN, SPECIAL_TOKENS, load_tokenizer
from train_tokenizer import iter_texts, main as train_main

ROOT = Path(__file__).resolve().parents[1]
BPE_VOCAB, SP_VOCAB = 700, 600


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """One file of each input format the trainer reads."""
    d, rng = tmp_path_factory.mktemp("corpus"), random.Random(0)

    def write_jsonl(name: str, records: list[dict]) -> Path:
        lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
        (d / name).write_text("".join(lines), encoding="utf-8")
        return d / name

    def msgs(*contents: str) -> list[dict]:
        return [{"role": r, "content": c} for r, c in zip(["user", "assistant"], contents)]

    pretrain = write_jsonl("pretrain.jsonl", [{"text": "\n".join(corpus_lines(rng, 8))} for _ in range(300)])
    sft = write_jsonl("sft.jsonl", [{"conversations": msgs(*corpus_lines(rng, 2)), "system": "你是一个助手"}
                                    for _ in range(200)])
    dpo = write_jsonl("dpo.jsonl", [{"prompt": "问题", "chosen": "好", "rejected": "坏"},
                                    {"chosen": msgs("q", "a"), "rejected": msgs("q", "b")}])
    (d / "notes.txt").write_text("\n".join(corpus_lines(rng, 500)), encoding="utf-8")
    return [pretrain, sft, dpo, d / "notes.txt"]


def train(corpus: list[Path], out: Path, vocab_size: int, backend: str = "tiktoken") -> Path:
    train_main([*map(str, corpus), f"--vocab_size={vocab_size}", f"--out={out}", f"--backend={backend}"])
    return out


@pytest.fixture(scope="module")
def bpe_dir(corpus, tmp_path_factory) -> Path:
    return train(corpus, tmp_path_factory.mktemp("bpe"), BPE_VOCAB)


@pytest.fixture(scope="module", params=["tiktoken", "sentencepiece"])
def tok(request, corpus, bpe_dir, tmp_path_factory) -> tk.Tokenizer:
    if request.param == "tiktoken":
        return load_tokenizer(bpe_dir)
    return load_tokenizer(train(corpus, tmp_path_factory.mktemp("sp"), SP_VOCAB, "sentencepiece"))


def test_vocab_size_is_exactly_the_asked_one(tok):
    asked = BPE_VOCAB if isinstance(tok, tk.TiktokenTokenizer) else SP_VOCAB
    assert tok.vocab_size == asked
    if isinstance(tok, tk.TiktokenTokenizer):
        assert tok.enc.n_vocab == asked and tok.enc.max_token_value == asked - 1
    else:
        assert tok.sp.get_piece_size() == asked


def test_round_trip(tok):
    texts = CHECK + random_strings(400, seed=1)
    if isinstance(tok, tk.SentencePieceTokenizer):  # its one documented exception
        texts = [t.replace("\u2581", "_") for t in texts]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_never_made_from_text(tok):
    special = {tok.bos_id: "<s>", tok.eos_id: "</s>", tok.pad_id: "<pad>"}
    special |= {ids[0]: t for t, ids in tok.chat_tokens.items()}
    assert len(special) == 7 and all(len(ids) == 1 for ids in tok.chat_tokens.values())
    for i, text in special.items():
        assert tok.decode([i]) == text
    if isinstance(tok, tk.TiktokenTokenizer):  # our format: the last 7 ids, in SPECIAL_TOKENS order
        ids = [tok.enc.encode_single_token(t) for t in SPECIAL_TOKENS]
        assert ids == list(range(tok.vocab_size - 7, tok.vocab_size))
    text = "".join(SPECIAL_TOKENS) + " <s>hi</s> [INST] x [/INST] <<SYS>>" + CHECK[9]
    ids = tok.encode(text)
    assert not set(ids) & set(special) and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *tok.encode("你好"), tok.eos_id]) == "<s>你好</s>"


def test_digits_are_split_one_per_token(tok):
    text = "2024年 3141592653 12+34=46 x99"
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert all(sum(c.isdigit() for c in p) <= 1 for p in pieces), pieces
    assert sum(p.strip().isdigit() for p in pieces) == 22  # every digit, and only digits, alone
    if isinstance(tok, tk.TiktokenTokenizer):  # the corpus repeats "2024": BPE would merge it
        assert len(tok.encode("2024")) == 4 and len(tok.encode(" the")) == 1


def test_invalid_utf8_decodes_with_replacement(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert tok.decode([0xE4]) == "\ufffd"  # first byte of a 3-byte character
    ids = tok.encode("中文 ok")
    assert tok.decode(ids) == "中文 ok" and tok.decode([ids[0], 0xE4]).endswith("\ufffd")


def test_pattern_character_sets_are_disjoint():
    sets = [{c for a, b in t for c in range(a, b + 1)} for t in (tk._SPACE, tk._DIGIT, tk._HAN, tk._SYMBOL)]
    assert sum(map(len, sets)) == len(set().union(*sets))


def test_pattern_cuts_text_the_same_in_python_re_and_tiktoken(bpe_dir):
    """tiktoken is given a vocabulary holding every substring of the text, so each chunk it finds
    becomes exactly one token: its tokens spell its chunks, which must be Python's chunks."""
    trained = load_tokenizer(bpe_dir)  # uses the pattern as stored in its nanomind.json
    assert json.loads((bpe_dir / "nanomind.json").read_text(encoding="utf-8"))["pattern"] == PATTERN
    for text in CHECK[1:] + random_strings(300, seed=2):
        chunks = re.findall(PATTERN, text)
        assert "".join(chunks) == text  # the pattern matches every character
        b = text.encode()
        ranks = {bytes([i]): i for i in range(256)}
        for length in range(2, len(b) + 1):
            for i in range(len(b) - length + 1):
                ranks.setdefault(b[i:i + length], len(ranks))
        enc = tiktoken.Encoding("substrings", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
        tiktoken_chunks = [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]
        assert tiktoken_chunks == chunks
        assert trained.encode(text) == [i for c in chunks for i in trained.encode(c)]


def test_trainer_is_deterministic(corpus, bpe_dir, tmp_path):
    """Two fresh processes with different hash seeds write byte-identical files."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        cmd = [sys.executable, str(ROOT / "train_tokenizer.py"), *map(str, corpus),
               f"--vocab_size={BPE_VOCAB}", f"--out={out}"]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed})
        outs.append(out)
    for name in ("tokenizer.tiktoken", "nanomind.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes() == (bpe_dir / name).read_bytes()
    fingerprint = load_tokenizer(bpe_dir).fingerprint
    assert load_tokenizer(outs[0]).fingerprint == fingerprint
    assert load_tokenizer(train(corpus, tmp_path / "smaller", 600)).fingerprint != fingerprint


def test_reads_every_record_format(corpus):
    assert list(iter_texts(corpus[2])) == ["问题", "好", "坏", "q", "a", "q", "b"]
    sft = list(iter_texts(corpus[1]))
    assert len(sft) == 600 and sft[0] == "你是一个助手"  # system + user + assistant per record


@pytest.mark.parametrize("backend", ["tiktoken", "sentencepiece"])
@pytest.mark.parametrize("line", [b'{"text": "unterminated', b'{"text": "\xff\xfe"}', b'{"role": "user"}',
                                  b'["a list"]', b'{"conversations": [{"role": "user", "content": 3}]}'])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, backend):
    bad = tmp_path / "broken.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n\n' + line + b"\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:3: "):
        train_main([str(bad), "--vocab_size=300", f"--out={tmp_path / 'tok'}", f"--backend={backend}"])
    assert not (tmp_path / "tok" / "tokenizer.model").exists()


def test_missing_or_garbled_files_name_the_path(bpe_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        load_tokenizer(tmp_path / "nowhere")
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "nanomind.json").write_bytes((bpe_dir / "nanomind.json").read_bytes())
    (garbled / "tokenizer.tiktoken").write_text("IQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match=re.escape(str(garbled))):
        load_tokenizer(garbled)
    (tmp_path / "bad.model").write_bytes(b"\x00 not a sentencepiece model")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "bad.model"))):
        load_tokenizer(tmp_path / "bad.model")


def test_foreign_sentencepiece_model_without_pad_or_chat_pieces(corpus, tmp_path):
    """LLaMA-2 style: no pad piece, no chat pieces, <s>/</s> as control symbols."""
    model = tmp_path / "foreign.model"
    lines = corpus[3].read_text(encoding="utf-8").splitlines()
    with open(model, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=f, model_type="bpe",
                                       vocab_size=400, byte_fallback=True, minloglevel=2)
    tok = load_tokenizer(model)
    assert tok.pad_id == tok.eos_id == 2 and tok.bos_id == 1
    assert tok.chat_tokens["[INST]"] == tok.encode("[INST]") and len(tok.chat_tokens["[INST]"]) > 1
    assert tok.decode([tok.bos_id, *tok.encode("hello"), tok.eos_id]).endswith("hello</s>")


# --- a tokenizer from a sample of a large corpus --------------------------------------------------

def test_tokenizer_sample_is_spread_over_the_whole_input_and_bounded(tmp_path):
    import train_tokenizer

    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for k, path in enumerate(files):  # 2 x 5000 records, record-NNNNN in order, b.jsonl's twice as long
        path.write_text("".join(json.dumps({"text": f"record-{i:05d} " + "words " * 20 * (k + 1)}) + "\n"
                                for i in range(5000 * k, 5000 * (k + 1))))
    paths, sizes = [str(p) for p in files], [os.path.getsize(p) for p in files]
    sample = list(train_tokenizer.sample_texts(paths, 90_000, n_ranges=30))  # ~10 ranges in a.jsonl, ~20 in b.jsonl
    assert 90_000 <= sum(map(len, sample)) <= 100_000  # each range overshoots by less than a record
    seen = [int(t[7:12]) for t in sample]
    assert seen == sorted(set(seen))  # in file order, no record twice
    for k in range(2):  # each file gives its share, and every tenth of it about a tenth of that
        chars = sum(len(t) for t in sample if int(t[7:12]) // 5000 == k)
        assert abs(chars - 90_000 * sizes[k] / sum(sizes)) < 0.1 * 90_000
        tenths = np.bincount([(i - 5000 * k) // 500 for i in seen if i // 5000 == k], minlength=10)
        assert tenths.min() >= 0.4 * tenths.mean(), tenths  # (ranges and tenths need not line up)
    everything = [t for p in paths for t in train_tokenizer.iter_texts(p)]
    assert list(train_tokenizer.sample_texts(paths, 10**9)) == everything  # a budget over the size: all of it
