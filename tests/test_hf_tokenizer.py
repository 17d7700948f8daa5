"""Hugging Face byte-level BPE files run by tiktoken give the ids of the tokenizers library itself, on MiniMind's
tokenizer.json (vocab/minimind, the default) and on small ones trained here with the library's own trainer."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Regex, Tokenizer as LibTokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

import tokenizer as tk
from chat import encode_chat
from conftest import CHECK, corpus_lines, random_strings
from token_cache import tokenize_file
from tokenizer import TokenizerError, load_tokenizer
from train_tokenizer import main as train_main

ROOT = Path(__file__).resolve().parents[1]
MINIMIND = ROOT / "vocab" / "minimind"
SHIPPED_FINGERPRINT = "c93ebe85913d7b99"  # vocab/ (then tokenizer/) before its tokenizer.json became nanomind.json
# Qwen2's split: a Split pre-tokenizer followed by ByteLevel without its own regex
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPLITS = {
    "byte_level": pre_tokenizers.ByteLevel(add_prefix_space=False),
    "split": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), "isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    # matches letters and digits only: the text between matches becomes pieces too (Isolated)
    "split_gaps": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}"), "isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]
HAND_WRITTEN = [
    "人工智能是计算机科学的一个分支，它企图了解智能的实质。北京是中国的首都；上海在东边。",
    "The quick brown fox jumps over the lazy dog. It's 9:30 a.m., isn't it? WE'LL SEE.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 递归\n",
    "emoji 😀😀😀 👍🏽 ❤️‍🔥 🇨🇳🇺🇸 👨‍👩‍👧‍👦 ✨✨",
    "0 12 345 6789 3.14159 1,000,000 ２０２４年 ①②③ ٣٤٥",
    "a  b   c    d\t\te\t \t f      \n\n\n\n  \r\n\r\n   x\u3000\u3000y\u00a0z",
    "\n", "\n\n", " ", "   ", "\t", "line one\nline two\r\nline three\n\n",
    "混合 mixed 文本 with 数字 123 and code `x = y**2` 和 emoji 🎉！",
]


def library(directory: Path) -> LibTokenizer:
    lib = LibTokenizer.from_file(str(directory / "tokenizer.json"))
    lib.encode_special_tokens = True  # special tokens written in text stay text, as in nanomind
    return lib


def lib_encode(lib: LibTokenizer, text: str) -> list[int]:
    return lib.encode(text, add_special_tokens=False).ids


def train_lib_tokenizer(out: Path, split: str, config: dict | None = None) -> Path:
    """A byte-level BPE of ~900 ids trained by the tokenizers library, saved as tokenizer.json, with added
    tokens at its first ids (its trainer's specials), one special and one non-special after the last."""
    lib = LibTokenizer(models.BPE())
    lib.pre_tokenizer, lib.decoder = SPLITS[split], decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lib.train_from_iterator(corpus_lines(random.Random(0), 3000), trainer)
    lib.add_special_tokens(["<extra_special>"])
    lib.add_tokens(["<think>"])
    out.mkdir(parents=True, exist_ok=True)
    lib.save(str(out / "tokenizer.json"))
    if config is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="module", params=["minimind", *SPLITS])
def hf_dir(request, tmp_path_factory) -> Path:
    if request.param == "minimind":
        return MINIMIND
    return train_lib_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def vocab_texts(lib: LibTokenizer, n: int, seed: int) -> list[str]:
    """Every vocab token that is whole UTF-8 text, alone, and n strings of random such tokens end to end:
    where tiktoken's merging by rank and the library's merging by merge order would part, if they could."""
    added = lib.get_added_tokens_decoder()
    texts = []
    for i in lib.get_vocab(with_added_tokens=False).values():
        text = lib.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text and i not in added:
            texts.append(text)
    rng = random.Random(seed)
    return texts + ["".join(rng.choices(texts, k=rng.randint(2, 30))) for _ in range(n)]


def test_encodes_like_the_library(hf_dir):
    tok, lib = load_tokenizer(hf_dir), library(hf_dir)
    assert isinstance(tok, tk.HFTokenizer)
    texts = CHECK + HAND_WRITTEN + corpus_lines(random.Random(1), 300) + random_strings(2000, seed=3)
    texts += vocab_texts(lib, 2000, seed=4)
    # special tokens in text stay text in both (encode_special_tokens); the library would match the others
    plain = [t.content for t in lib.get_added_tokens_decoder().values() if not t.special]
    assert not any(t in text for t in plain for text in texts) and "[INST]" in CHECK[9]
    for text in texts:
        ids = tok.encode(text)
        assert ids == lib_encode(lib, text), text
        assert tok.decode(ids) == text


def test_decodes_like_the_library(hf_dir):
    """Any ids, added tokens and cut multi-byte characters included (both write U+FFFD for those)."""
    tok, lib, rng = load_tokenizer(hf_dir), library(hf_dir), random.Random(5)
    for _ in range(2000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=False), ids


def test_minimind_ids_and_special_tokens_match_transformers():
    """bos / eos / pad from tokenizer_config.json, the 36 added tokens at ids 0-35, 6400 ids in all."""
    tok, auto = load_tokenizer(MINIMIND), AutoTokenizer.from_pretrained(str(MINIMIND))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)  # <|im_start|>, <|im_end|>, <|endoftext|>
    assert tok.vocab_size == len(auto) == 6400
    assert tok.added_tokens == {t.content: i for i, t in auto.added_tokens_decoder.items()}
    assert sorted(tok.added_tokens.values()) == list(range(36))
    text = "你好，MiniMind! Let's test 123."
    assert tok.encode(text) == auto(text, add_special_tokens=False).input_ids == auto(text).input_ids


def test_added_tokens_in_text_stay_text():
    """The library turns "<|im_start|>" (special) and "<think>" (added, not special) in text into their ids;
    nanomind's encode never does: it gives the library's ids with no added token, the BPE of the text."""
    tok = load_tokenizer(MINIMIND)
    data = json.loads((MINIMIND / "tokenizer.json").read_text(encoding="utf-8"))
    bpe_only = LibTokenizer.from_str(json.dumps({**data, "added_tokens": []}))
    text = "a<|im_start|>user\nhi<|im_end|> <think>x</think>" + "".join(tok.added_tokens) + " <s>[INST]"
    ids = tok.encode(text)
    assert ids == lib_encode(bpe_only, text) and tok.decode(ids) == text
    assert not set(ids) & set(tok.added_tokens.values())
    assert lib_encode(LibTokenizer.from_file(str(MINIMIND / "tokenizer.json")), "<|im_start|><think>") == [1, 25]
    only_special = "<|im_start|>system\n<|endoftext|>"  # special ones only: split_special_tokens does the same
    assert tok.encode(only_special) == lib_encode(library(MINIMIND), only_special)
    assert tok.decode([1, *tok.encode("user"), 25, 2]) == "<|im_start|>user<think><|im_end|>"


def test_bos_eos_pad_without_config_or_with_nulls(tmp_path):
    ids = {t: i for i, t in enumerate(SPECIALS)}
    tok = load_tokenizer(train_lib_tokenizer(tmp_path / "none", "byte_level"))
    assert tok.bos_id == tok.eos_id == tok.pad_id == ids["<|endoftext|>"]
    qwen_like = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": None}
    tok = load_tokenizer(train_lib_tokenizer(tmp_path / "nulls", "byte_level", qwen_like))
    assert tok.bos_id == tok.eos_id == tok.pad_id == ids["<|im_end|>"]
    named = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<extra_special>"}
    tok = load_tokenizer(train_lib_tokenizer(tmp_path / "named", "byte_level", named))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, tok.vocab_size - 2)  # <think> is the last id
    fingerprints = {load_tokenizer(tmp_path / d).fingerprint for d in ("none", "nulls", "named")}
    assert len(fingerprints) == 3  # the config changes the ids data is encoded with: caches must differ
    (tmp_path / "named" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"eos_token '</s>' is not an added token"):
        load_tokenizer(tmp_path / "named")


def test_chat_tokens_and_data_pipeline(tmp_path):
    """Without [INST] pieces (MiniMind) the LLaMA-2 template spells them as text; with them, one id each.
    data.py's pretraining records (through its worker processes) and chat template work with the tokenizer."""
    minimind = load_tokenizer(MINIMIND)
    assert all(ids == minimind.encode(t) and len(ids) > 1 for t, ids in minimind.chat_tokens.items())
    trained = load_tokenizer(train_lib_tokenizer(tmp_path / "chat", "byte_level"))
    assert trained.chat_tokens == {t: [SPECIALS.index(t)] for t in tk.CHAT_TOKENS}
    texts = HAND_WRITTEN[:4]
    path = tmp_path / "pretrain.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    records = tokenize_file(str(path), minimind, "pretrain", processes=2, verbose=False)
    assert [list(records[i][0]) for i in range(len(texts))] == [[1, *minimind.encode(t), 2] for t in texts]
    chat = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "hi"}]
    ids, mask = encode_chat(minimind, chat)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(ids) and minimind.eos_id in ids
    assert "你好" in minimind.decode(ids) and "hi" in minimind.decode(ids)


def edit_json(directory: Path, edit) -> Path:
    data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    edit(data)
    (directory / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return directory


def swap_first_merges(data):
    data["model"]["merges"][:2] = data["model"]["merges"][1::-1]


def lib_json(model, pre_tokenizer=None) -> dict:
    lib = LibTokenizer(model)
    if pre_tokenizer is not None:
        lib.pre_tokenizer = pre_tokenizer
    return json.loads(lib.to_str())


def metaspace(data):  # LLaMA-2 / Mistral style: "▁" for spaces, not bytes
    data["pre_tokenizer"] = lib_json(models.BPE(), pre_tokenizers.Metaspace())["pre_tokenizer"]


def split_removed(data):
    data["pre_tokenizer"] = lib_json(models.BPE(), SPLITS["split"])["pre_tokenizer"]
    data["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"


BROKEN = {  # what is wrong -> (edit of a trained byte-level file, what the error must say)
    "WordPiece": (lambda d: d.update(lib_json(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))),
                  "model type WordPiece is not supported"),
    "Unigram": (lambda d: d.update(lib_json(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False))),
                "model type Unigram is not supported"),
    "SentencePiece-style BPE": (metaspace, r"pre_tokenizer \['Metaspace'\] is not supported"),
    "no pre-tokenizer": (lambda d: d.update(pre_tokenizer=None), "pre_tokenizer none is not supported"),
    "NFKC": (lambda d: d.update(normalizer={"type": "NFKC"}), r"normalizer \['NFKC'\] is not supported"),
    "add_prefix_space": (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space=true"),
    "byte_fallback": (lambda d: d["model"].update(byte_fallback=True), "byte_fallback=True"),
    "dropout": (lambda d: d["model"].update(dropout=0.1), "dropout=0.1"),
    "Split Removed": (split_removed, "behavior Removed"),
    "merges out of order": (swap_first_merges, r"merge 1 .* makes id \d+, not above the previous"),
    "token no merge makes": (lambda d: d["model"]["vocab"].update({"xyzw": 5000}), r"'xyzw' \(id 5000\) is neither"),
    "not byte-level": (lambda d: d["model"]["vocab"].update({"a b": 5000}), r"'a b' \(id 5000\) is not byte-level"),
    "missing byte": (lambda d: d["model"]["vocab"].pop("ÿ"), "no vocab token for byte 0xff"),
    "not a tokenizer.json": (lambda d: d.pop("model"), "no model"),
}


@pytest.mark.parametrize("what", BROKEN)
def test_unsupported_files_say_what_is_missing(tmp_path, what):
    edit, message = BROKEN[what]
    directory = edit_json(train_lib_tokenizer(tmp_path, "byte_level"), edit)
    with pytest.raises(TokenizerError, match=message) as error:
        load_tokenizer(directory)
    assert str(directory / "tokenizer.json") in str(error.value)


def test_add_prefix_space_in_config_is_refused(tmp_path):
    directory = train_lib_tokenizer(tmp_path, "byte_level", {"add_prefix_space": True})
    with pytest.raises(TokenizerError, match="add_prefix_space=true is not supported"):
        load_tokenizer(directory)


def test_shipped_tokenizer_renamed_with_its_fingerprint_and_old_name_loads(tmp_path):
    """nanomind.json is nanomind's tokenizer's old tokenizer.json, byte for byte: every cache keyed on its
    fingerprint stays valid, and a directory still holding the old name loads the same tokenizer."""
    shipped = load_tokenizer(tk.NANOMIND_DIR)
    assert isinstance(shipped, tk.TiktokenTokenizer) and shipped.fingerprint == SHIPPED_FINGERPRINT
    assert not (tk.NANOMIND_DIR / "tokenizer.json").exists()
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(tk.NANOMIND_DIR / "tokenizer.tiktoken", old / "tokenizer.tiktoken")
    shutil.copy(tk.NANOMIND_DIR / tk.META_FILE, old / "tokenizer.json")
    tok = load_tokenizer(old)
    assert isinstance(tok, tk.TiktokenTokenizer) and tok.fingerprint == SHIPPED_FINGERPRINT
    assert all(tok.encode(t) == shipped.encode(t) for t in CHECK + HAND_WRITTEN)
    # retraining into it writes the new name and removes the stale old one
    (tmp_path / "corpus.txt").write_text("\n".join(corpus_lines(random.Random(2), 200)), encoding="utf-8")
    train_main([str(tmp_path / "corpus.txt"), "--vocab_size=300", f"--out={old}"])
    assert sorted(p.name for p in old.iterdir()) == ["nanomind.json", "tokenizer.tiktoken"]
    assert load_tokenizer(old).vocab_size == 300


def test_which_format_a_directory_is_read_as(tmp_path):
    """tokenizer.tiktoken first (nanomind's), then tokenizer.model (SentencePiece: LLaMA-2's Hugging Face
    folders hold a tokenizer.json too), then a Hugging Face tokenizer.json."""
    hf = train_lib_tokenizer(tmp_path / "hf", "byte_level")
    assert isinstance(load_tokenizer(hf), tk.HFTokenizer)
    ours = shutil.copytree(tk.NANOMIND_DIR, tmp_path / "ours", ignore=shutil.ignore_patterns("*.py"))
    shutil.copy(hf / "tokenizer.json", ours / "tokenizer.json")
    assert load_tokenizer(ours).fingerprint == SHIPPED_FINGERPRINT
    sp = tmp_path / "sp"
    sp.mkdir()
    with open(sp / "tokenizer.model", "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines(random.Random(3), 300)), model_writer=f,
                                       model_type="bpe", vocab_size=300, minloglevel=2)
    shutil.copy(hf / "tokenizer.json", sp / "tokenizer.json")
    assert isinstance(load_tokenizer(sp), tk.SentencePieceTokenizer)


def test_runtime_code_does_not_import_the_library():
    code = ("import sys, data, tokenizer; tok = tokenizer.load_tokenizer(sys.argv[1]); tok.decode(tok.encode('hi')); "
            "sys.exit(bool({'tokenizers', 'transformers'} & set(sys.modules)))")
    subprocess.run([sys.executable, "-c", code, str(MINIMIND)], cwd=ROOT, check=True)
