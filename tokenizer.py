"""Tokenizers behind one small interface: byte-level BPE run by tiktoken (default) or SentencePiece.

    tok = load_tokenizer()              # the default shipped in tokenizer/ beside this file
    ids = tok.encode("你好, world")     # ordinary text only: "<s>" in text is never the BOS id
    text = tok.decode(ids)

A tiktoken tokenizer is a directory with tokenizer.tiktoken (one "base64(token) rank" line per
token: the 256 single bytes first, then the merges in training order) and tokenizer.json (the
pre-tokenisation pattern, the special tokens' ids, vocab_size). The special tokens take the last
ids, so vocab_size counts them. train_tokenizer.py writes both formats.
"""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import tiktoken

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]
CHAT_TOKENS = SPECIAL_TOKENS[3:]
DEFAULT_DIR = Path(__file__).resolve().parent / "tokenizer"

# --- pre-tokenisation pattern -------------------------------------------------------------------
# The trainer splits text with Python's `re`, tiktoken with Rust fancy-regex; the two must cut
# every string identically or the merges are learned on chunks tiktoken never sees. \p{..} does
# not exist in `re`, and \s, \d, \w and (?i) do exist in both but mean different things (Python's
# \s has \x1c-\x1f, Rust's \w has all combining marks and \p{Pc}, case folding and the Unicode
# version differ). So the pattern uses no shorthand class, no flag, no property: only explicit
# code-point ranges written as \xHH / \uHHHH / \UHHHHHHHH escapes, which both engines parse the
# same. Every character is in exactly one of five sets, so the pattern matches all text:
#   SPACE  Unicode White_Space;  DIGIT  0-9 and fullwidth ０-９;  HAN  Chinese characters;
#   SYMBOL ASCII punctuation and controls, plus the Unicode blocks of punctuation, symbols and
#          emoji (incl. ZWJ, variation selectors, skin tones, tags);  letter  everything else.
# "Everything else is a letter" errs the right way for scripts not listed: they form word runs.
# tests/test_tokenizer.py proves the agreement on Chinese, English, code, emoji and random text.
_SPACE = [(0x09, 0x09), (0x0A, 0x0A), (0x0B, 0x0C), (0x0D, 0x0D), (0x20, 0x20), (0x85, 0x85),
          (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
          (0x205F, 0x205F), (0x3000, 0x3000)]
_DIGIT = [(0x30, 0x39), (0xFF10, 0xFF19)]
_HAN = [(0x3005, 0x3005), (0x3007, 0x3007), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
        (0x20000, 0x323AF)]  # 々 〇, CJK Ext. A, unified, compatibility, Ext. B-H
_SYMBOL = [
    (0x00, 0x08), (0x0E, 0x1F), (0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7F),  # ASCII
    (0x80, 0x84), (0x86, 0x9F), (0xA1, 0xBF), (0xD7, 0xD7), (0xF7, 0xF7),  # Latin-1 (· « » × ÷)
    (0x200B, 0x2027), (0x2030, 0x205E), (0x2060, 0x2BFF),  # punctuation, ZWJ, math, arrows, ①
    (0x2E00, 0x2E7F), (0x3001, 0x3004), (0x3006, 0x3006), (0x3008, 0x303F),  # 。、《》「」【】
    (0x30FB, 0x30FB), (0x3200, 0x33FF), (0x4DC0, 0x4DFF), (0xE000, 0xF8FF),  # ・ ㈠ ㎡, private use
    (0xFE00, 0xFE1F), (0xFE30, 0xFE6F), (0xFF00, 0xFF0F), (0xFF1A, 0xFF20),  # variation sel., ，！
    (0xFF3B, 0xFF40), (0xFF5B, 0xFF65), (0xFFE0, 0xFFFF),  # fullwidth ［～｝, ￥, U+FFFD
    (0x1D000, 0x1D24F), (0x1F000, 0x1FBFF), (0xE0000, 0xE01EF), (0xF0000, 0x10FFFF),  # emoji, tags
]


def _char_class(ranges: list[tuple[int, int]]) -> str:
    def esc(c: int) -> str:
        return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


_S, _W, _N, _H = (_char_class(r) for r in (_SYMBOL, _SPACE, _DIGIT, _HAN))
_W_INLINE = _char_class([r for r in _SPACE if r not in ((0x0A, 0x0A), (0x0D, 0x0D))])
# GPT-4's (cl100k) pattern with digits one by one and Chinese runs apart from other letters.
PATTERN = "|".join([
    r"'(?:[sdmtSDMT]|[lL][lL]|[vV][eE]|[rR][eE])",  # 's 'd 'm 't 'll 've 're
    f"[{_S}{_W_INLINE}]?+[^{_S}{_W}{_N}{_H}]+",  # a word, with at most one leading space or mark
    f"[{_H}]+",  # a run of Chinese characters
    f"[{_N}]",  # one digit, so arithmetic is learnable
    f" ?[{_S}]++[\\r\\n]*",  # a punctuation / symbol / emoji run, with its line ends
    f"[{_W}]*[\\r\\n]",  # whitespace up to a line end
    f"[{_W}]+(?![^{_W}])",  # whitespace except the last space before a word
    f"[{_W}]+",
])


# --- the interface ------------------------------------------------------------------------------
class Tokenizer:
    """What data, chat and sampling code may use; both backends provide exactly this."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    chat_tokens: dict[str, list[int]]  # "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>" -> ids
    fingerprint: str  # hash of the tokenizer file(s): caches of encoded data key on it

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded; the message names it."""


def _fingerprint(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _read_ranks(path: Path) -> dict[bytes, int]:
    # tiktoken.load.load_tiktoken_bpe would do, but it caches every path it reads in a temp dir
    # keyed by the path, so a tokenizer retrained into the same directory would load stale ranks.
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:  # includes binascii.Error
            raise TokenizerError(f"{path}:{n}: not a 'base64-token rank' line") from e
    return ranks


class TiktokenTokenizer(Tokenizer):
    def __init__(self, directory: Path):
        ranks_file, meta_file = directory / "tokenizer.tiktoken", directory / "tokenizer.json"
        try:
            ranks = _read_ranks(ranks_file)
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            special, self.vocab_size = meta["special_tokens"], meta["vocab_size"]
            if (sorted(ranks.values()) != list(range(len(ranks)))
                    or sorted(special.values()) != list(range(len(ranks), self.vocab_size))
                    or any(ranks.get(bytes([b])) != b for b in range(256))):
                raise ValueError("ids must be the 256 bytes, then merges, then special tokens")
            self.enc = tiktoken.Encoding(name=str(directory), pat_str=meta["pattern"],
                                         mergeable_ranks=ranks, special_tokens=special)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerError(f"cannot load tiktoken tokenizer from {directory}: {e}") from e
        self.bos_id, self.eos_id, self.pad_id = special["<s>"], special["</s>"], special["<pad>"]
        self.chat_tokens = {t: [special[t]] for t in CHAT_TOKENS}
        self.fingerprint = _fingerprint(ranks_file, meta_file)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special-token strings in text stay ordinary text

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(ids, errors="replace")  # a cut multi-byte char becomes U+FFFD


class SentencePieceTokenizer(Tokenizer):
    """A .model file: ours (train_tokenizer.py --backend sentencepiece) or a foreign one (LLaMA-2).

    decode(encode(s)) == s for our models (identity normalisation, no dummy prefix, byte
    fallback), except that U+2581 "▁", SentencePiece's space marker, decodes as a space.
    Specials are control symbols, which SentencePiece never produces from text and skips when
    decoding; decode() writes them out. A foreign model's user-defined symbols, however, are
    matched inside ordinary text by SentencePiece itself and cannot be turned off.
    """

    def __init__(self, model_file: Path):
        import sentencepiece as spm  # only this backend needs it
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_file.read_bytes())
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"cannot load SentencePiece model {model_file}: {e}") from e
        sp = self.sp
        self.vocab_size, self.bos_id, self.eos_id = sp.vocab_size(), sp.bos_id(), sp.eos_id()
        # LLaMA-2's model has no pad piece (pad_id() == -1): pad with eos. So padding must be
        # masked by position, never found by comparing ids with pad_id.
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else self.eos_id
        self._control = {i for i in range(self.vocab_size) if sp.is_control(i)}
        # A model without a chat piece (LLaMA-2) spells "[INST]" as ordinary text, as Meta does.
        self.chat_tokens = {t: [sp.piece_to_id(t)] if sp.piece_to_id(t) in self._control
                            else sp.encode(t) for t in CHAT_TOKENS}
        self.fingerprint = _fingerprint(model_file)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        parts, run = [], []
        for i in ids:
            if i in self._control:
                parts += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.sp.decode(run)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """None: the default in tokenizer/. A .model file, or a directory holding tokenizer.model:
    SentencePiece. A directory holding tokenizer.tiktoken (+ tokenizer.json): tiktoken."""
    p = DEFAULT_DIR if path is None else Path(path)
    if p.suffix == ".model" and p.is_file():
        return SentencePieceTokenizer(p)
    found = [f for f in ("tokenizer.tiktoken", "tokenizer.model") if (p / f).is_file()]
    if len(found) != 1:
        raise FileNotFoundError(f"{p}: expected a .model file, or a directory holding exactly one "
                                f"of tokenizer.tiktoken and tokenizer.model (found {found or 'none'})")
    if found[0] == "tokenizer.tiktoken":
        return TiktokenTokenizer(p)
    return SentencePieceTokenizer(p / found[0])
