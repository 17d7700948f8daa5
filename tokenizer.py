"""Tokenizers behind one small interface: byte-level BPE run by tiktoken, or SentencePiece.

    tok = load_tokenizer()              # the default: MiniMind's, shipped in vocab/minimind/
    ids = tok.encode("你好, world")     # ordinary text only: "<|im_start|>" in text is never the BOS id
    text = tok.decode(ids)

Two tokenizers ship in vocab/. The default is MiniMind's (Apache-2.0): a Hugging Face tokenizer.json
(+ tokenizer_config.json) holding a byte-level BPE of 6400 ids split by GPT-2's rule, with its ChatML
template; HFTokenizer runs such files with tiktoken. It packs Chinese tighter than nanomind's own, and
llama.cpp splits text by its rule exactly (docs/tokenizer.md).

nanomind's own, in vocab/nanomind/ (the default of earlier checkpoints, which still load with it), is
a directory with tokenizer.tiktoken (one "base64(token) rank" line per token: the 256 single bytes
first, then the merges in training order) and nanomind.json (the pre-tokenisation pattern, the special
tokens' ids, vocab_size; directories written before it had that name call it tokenizer.json). The
special tokens take the last ids, so vocab_size counts them. train_tokenizer.py writes this format and
SentencePiece's.
"""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import tiktoken

from errors import TokenizerError

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]
CHAT_TOKENS = SPECIAL_TOKENS[3:]
DEFAULT_DIR = Path(__file__).resolve().parent / "vocab" / "minimind"
NANOMIND_DIR = DEFAULT_DIR.parent / "nanomind"  # the default until MiniMind's took its place
META_FILE = "nanomind.json"  # beside tokenizer.tiktoken; not Hugging Face's tokenizer.json format

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
    chat_template: str | None = "llama2"  # encode_chat's: "llama2" ([INST]), "chatml" (MiniMind's), None (neither)
    added_tokens: dict[str, int] = {}  # text -> id of tokens matched in chat-template markup (chatml)
    fingerprint: str  # hash of the tokenizer file(s): caches of encoded data key on it

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


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
        ranks_file, meta_file = directory / "tokenizer.tiktoken", directory / META_FILE
        if not meta_file.is_file():  # a directory written before the rename: the same bytes
            meta_file = directory / "tokenizer.json"
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
        self.ranks, self.pattern, self.special_tokens = ranks, meta["pattern"], special  # for export
        self.bos_id, self.eos_id, self.pad_id = special["<s>"], special["</s>"], special["<pad>"]
        self.chat_tokens = {t: [special[t]] for t in CHAT_TOKENS}
        self.fingerprint = _fingerprint(ranks_file, meta_file)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special-token strings in text stay ordinary text

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(ids, errors="replace")  # a cut multi-byte char becomes U+FFFD


class SentencePieceTokenizer(Tokenizer):
    """A .model file: ours (train_tokenizer.py --backend=sentencepiece) or a foreign one (LLaMA-2).

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


# --- Hugging Face tokenizer.json: byte-level BPE -------------------------------------------------
# ByteLevel's own split (use_regex true) is GPT-2's pattern, as the tokenizers library writes it.
# The library runs it with Oniguruma, tiktoken with fancy-regex; the tests compare the two on
# random text from all of Unicode, as for nanomind's own PATTERN.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: a byte-level vocab spells each byte as one printable
    character (printable Latin-1 bytes as themselves, the other 68 as U+0100 upwards)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(others)}


def _steps(component: dict | None, key: str) -> tuple[list, list[dict]]:
    """A normalizer or pre-tokenizer as its steps (a Sequence's, or itself) and their types."""
    if not component:
        steps = []
    elif component.get("type") == "Sequence":
        steps = component.get(key) or []
    else:
        steps = [component]
    return [step.get("type") for step in steps], steps


def _hf_pattern(pre_tokenizer: dict | None) -> str:
    """The tiktoken pattern that cuts text into the pieces the file's pre_tokenizer makes."""
    kinds, steps = _steps(pre_tokenizer, "pretokenizers")
    if kinds not in (["ByteLevel"], ["Split", "ByteLevel"]):
        raise TokenizerError(f"pre_tokenizer {kinds or 'none'} is not supported: a byte-level BPE needs "
                             "ByteLevel, or a Split followed by ByteLevel")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise TokenizerError("ByteLevel add_prefix_space=true is not supported: it puts a space "
                             "before every text encoded, and nanomind encodes a chat piece by piece")
    use_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"]:
        return GPT2_PATTERN if use_regex else r"[\s\S]+"  # no split: the whole text is one piece
    split, pattern = steps[0], (steps[0].get("pattern") or {}).get("Regex")
    if pattern is None or split.get("behavior") != "Isolated" or split.get("invert") or use_regex:
        found = (f"Split {split.get('pattern')} behavior {split.get('behavior')} invert "
                 f"{split.get('invert')}, ByteLevel use_regex {use_regex}")
        raise TokenizerError(f"pre_tokenizer {found} is not supported: only a Split by a Regex, "
                             "behavior Isolated, not inverted, then a ByteLevel with use_regex false")
    # Isolated: the text between two matches is a piece too, but tiktoken encodes matches only
    return f"(?:{pattern})|(?:(?!(?:{pattern}))[\\s\\S])+"


def _hf_ranks(model: dict, added_ids: set[int]) -> dict[bytes, int]:
    """tiktoken's mergeable ranks: every byte-level vocab token (as bytes) -> its id."""
    if model.get("type") != "BPE":
        raise TokenizerError(f"model type {model.get('type')} is not supported: only byte-level BPE")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):  # random merges, word-piece markers, SentencePiece-style <0x..> bytes
            raise TokenizerError(f"BPE option {key}={model[key]!r} is not supported by a byte-level BPE")
    alphabet = _byte_level_alphabet()
    vocab = {t: i for t, i in model["vocab"].items() if i not in added_ids}  # added: not merged
    ranks = {}
    for token, i in vocab.items():
        if not token or any(c not in alphabet for c in token):
            raise TokenizerError(f"vocab token {token!r} (id {i}) is not byte-level (GPT-2's alphabet)")
        ranks[bytes(alphabet[c] for c in token)] = i
    missing = [f"0x{b:02x}" for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"not a byte-level BPE: no vocab token for byte {', '.join(missing[:8])}")
    _check_merges(model["merges"], vocab, {ranks[bytes([b])] for b in range(256)})
    return ranks


def _check_merges(merges: list, vocab: dict[str, int], byte_ids: set[int]) -> None:
    """tiktoken merges, at each step, the adjacent pair whose joined token has the lowest rank;
    the library merges the adjacent pair that comes first in its merge list. With rank = id the two
    rules agree when every longer token is made by exactly one merge and ids rise in merge order
    (so a merge's priority is its result's id), as in files the library's trainer writes; anything
    else is refused. That this is enough is shown, not proved: tests/test_hf_tokenizer.py compares
    the ids with the library's on MiniMind's file and on files trained there."""
    made, last = set(), -1
    for n, merge in enumerate(merges):
        a, b = merge.split(" ") if isinstance(merge, str) else merge  # old "a b" or new ["a", "b"]
        i = vocab.get(a + b)
        if a not in vocab or b not in vocab or i is None:
            raise TokenizerError(f"merge {n} {[a, b]}: a part or the result is not in the vocab")
        if i <= last:
            raise TokenizerError(f"merge {n} {[a, b]} makes id {i}, not above the previous merge's "
                                 f"{last}: tiktoken would apply the merges in another order")
        made.add(i)
        last = i
    orphans = set(vocab.values()) - made - byte_ids
    if orphans:
        i = min(orphans)
        token = next(t for t, j in vocab.items() if j == i)
        raise TokenizerError(f"vocab token {token!r} (id {i}) is neither a byte, a merge's result nor an "
                             "added token: the library never makes it from text, tiktoken would")


def _check_no_normalizer(normalizer: dict | None) -> None:
    kinds, _ = _steps(normalizer, "normalizers")
    if kinds:
        raise TokenizerError(f"normalizer {kinds} is not supported: it changes text before encoding, "
                             "nanomind encodes text as it is (a byte-level BPE needs no normalizer)")


def _hf_bos_eos_pad(config: dict, added: dict[str, int]) -> tuple[int, int, int]:
    """bos / eos / pad as tokenizer_config.json names them. MiniMind's: <|im_start|>, <|im_end|>,
    <|endoftext|>, which its pretraining puts around each document and pads with, as nanomind does.
    Without a name: eos is <|endoftext|> or </s>; bos is eos (a file naming no bos, as Qwen's, was
    trained on documents separated by eos alone, GPT-2 style); pad is eos, masked by position (see
    SentencePieceTokenizer)."""
    def named(key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken dict
        if value is not None and value not in added:
            raise TokenizerError(f"tokenizer_config.json: {key} {value!r} is not an added token")
        return None if value is None else added[value]

    eos = named("eos_token")
    if eos is None:
        found = [t for t in ("<|endoftext|>", "</s>") if t in added]
        if not found:
            raise TokenizerError("no end-of-text token: name eos_token in tokenizer_config.json")
        eos = added[found[0]]
    bos, pad = named("bos_token"), named("pad_token")
    return (eos if bos is None else bos), eos, (eos if pad is None else pad)


def _hf_chat_template(config: dict, added: dict[str, int]) -> str | None:
    """"chatml" when tokenizer_config.json's chat_template is ChatML (<|im_start|>role ... <|im_end|>,
    both added tokens): chat.encode_chat then renders MiniMind's rules, think blocks and tools
    included. Without a chat_template, "llama2" with [INST] spelled as text. None for any other
    template: pretraining works, and encode_chat refuses rather than render it wrongly."""
    template = config.get("chat_template")
    if template is None:
        return "llama2"
    if isinstance(template, str) and "<|im_start|>" in template and {"<|im_start|>", "<|im_end|>"} <= set(added):
        return "chatml"
    return None


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json holding a byte-level BPE, such as MiniMind's, run by tiktoken
    with ranks rebuilt from its vocab and merges and its own pre-tokenisation regex.

    encode(text) gives the ids the tokenizers library gives for
    encode(text, add_special_tokens=False) on text that holds no added token: the library matches
    added tokens inside text (special ones unless split_special_tokens, and the non-special ones,
    like MiniMind's <think>, always); nanomind never does, so "<|im_start|>" in data stays text.
    Added tokens wherever their ids are (MiniMind's: 0-35) are in added_tokens, for chat templates,
    and decode() writes them out (the library's skip_special_tokens=False).
    """

    def __init__(self, directory: Path):
        file, config_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            if not isinstance(data.get("model"), dict):
                ours = "; it is nanomind's: tokenizer.tiktoken is missing" if "pattern" in data else ""
                raise TokenizerError(f"not a Hugging Face tokenizer.json (no model){ours}")
            _check_no_normalizer(data.get("normalizer"))
            if config.get("add_prefix_space"):  # transformers would turn it on in ByteLevel
                raise TokenizerError("tokenizer_config.json: add_prefix_space=true is not supported")
            self.added_tokens = {t["content"]: t["id"] for t in data.get("added_tokens") or []}
            ranks = _hf_ranks(data["model"], set(self.added_tokens.values()))
            # added tokens go in as tiktoken specials only so decode() knows them: encode_ordinary
            # never matches them
            pattern = _hf_pattern(data.get("pre_tokenizer"))
            self.enc = tiktoken.Encoding(name=str(directory), pat_str=pattern, mergeable_ranks=ranks,
                                         special_tokens=self.added_tokens)
            self.bos_id, self.eos_id, self.pad_id = _hf_bos_eos_pad(config, self.added_tokens)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # ValueError: ours too
            detail = f"no {e} field" if isinstance(e, KeyError) else e
            raise TokenizerError(f"cannot load Hugging Face tokenizer {file}: {detail}") from e
        self.vocab_size = self.enc.max_token_value + 1  # ids may have gaps: the embedding covers all
        # a file without chat pieces (MiniMind's) spells "[INST]" as ordinary text, as LLaMA-2 does
        self.chat_tokens = {t: [self.added_tokens[t]] if t in self.added_tokens else self.encode(t)
                            for t in CHAT_TOKENS}
        self.chat_template = _hf_chat_template(config, self.added_tokens)
        self.fingerprint = _fingerprint(*(f for f in (file, config_file) if f.is_file()))

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(ids, errors="replace")  # a cut multi-byte char becomes U+FFFD


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """None: the default, MiniMind's, in vocab/minimind/. A .model file: SentencePiece. A directory holding
    tokenizer.tiktoken: nanomind's tiktoken format; else tokenizer.model: SentencePiece; else a
    Hugging Face tokenizer.json (+ tokenizer_config.json): its byte-level BPE run by tiktoken."""
    p = DEFAULT_DIR if path is None else Path(path)
    if p.suffix == ".model" and p.is_file():
        return SentencePieceTokenizer(p)
    found = [f for f in ("tokenizer.tiktoken", "tokenizer.model") if (p / f).is_file()]
    if len(found) > 1:
        raise FileNotFoundError(f"{p}: holds both tokenizer.tiktoken and tokenizer.model; keep one")
    if found == ["tokenizer.tiktoken"]:
        return TiktokenTokenizer(p)
    if found == ["tokenizer.model"]:
        return SentencePieceTokenizer(p / "tokenizer.model")
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(p)
    raise FileNotFoundError(f"{p}: expected a .model file, or a directory holding tokenizer.tiktoken, "
                            "tokenizer.model or a Hugging Face tokenizer.json (found none)")
