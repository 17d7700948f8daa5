"""
Rebuild the real-text half of the corpus nanomind's own tokenizer (this folder) was trained on: ~20 MB of Chinese
and English prose from Debian's documentation packages (a Debian 12 machine):

    apt-get install -y manpages-zh debian-reference-zh-cn debian-reference-en fortunes-zh debian-faq-zh-cn \
        maint-guide-zh-cn debian-edu-doc-zh-cn libreoffice-help-zh-cn gimp-help-en python3.11-doc
    python vocab/nanomind/make_corpus.py --out_dir=/tmp/corpus   # -> /tmp/corpus/train.jsonl, heldout*.txt
    python prepare_demo.py
    python train_tokenizer.py /tmp/corpus/train.jsonl data/demo/pretrain.jsonl data/demo/sft.jsonl \
        --vocab_size=6400 --out=vocab/nanomind

The held-out files (every document whose crc32 is 0 mod 20) measure compression; they are not trained on.
"""
import glob
import gzip
import html
import json
import os
import random
import re
import sys
import zlib
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository's modules
from config import load_config  # noqa: E402
from errors import cli  # noqa: E402


@dataclass
class Config:
    # --- I/O
    out_dir: str = "corpus"  # where train.jsonl and the held-out heldout*.txt go


def strip_html(s: str) -> str:
    s = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", s)
    s = html.unescape(re.sub(r"(?s)<[^>]+>", "", s))
    return re.sub(r"\n\s*\n+", "\n\n", s).strip()


def strip_roff(s: str) -> str:
    """Man page source -> its text, crudely: drop comments and request names, font and size escapes."""
    out = []
    for line in s.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith((".", "'")):
            parts = line.split(None, 1)
            line = parts[1] if len(parts) > 1 else ""
        line = re.sub(r"\\f[BIRPC]|\\f\(..|\\s[+-]?\d", "", line)
        line = line.replace("\\-", "-").replace("\\e", "\\").replace('"', "")
        out.append(re.sub(r"\\\(..|\\[&|^%]", "", line))
    return re.sub(r"\n\s*\n+", "\n\n", "\n".join(out)).strip()


def read(path: str) -> str | None:
    raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def documents() -> dict[str, list[str]]:
    docs: dict[str, list[str]] = {"zh": [], "en": []}
    for lang, pattern in [("zh", "/usr/share/man/zh_CN/man*/*.gz"), ("zh", "/usr/share/man/zh_TW/man*/*.gz"),
                          ("en", "/usr/share/man/man*/*.gz")]:
        docs[lang] += [strip_roff(t) for t in map(read, sorted(glob.glob(pattern))) if t]
    for lang, tag in [("zh", "zh-cn"), ("en", "en")]:
        text = read(f"/usr/share/debian-reference/debian-reference.{tag}.txt.gz") or ""
        docs[lang] += [c for c in re.split(r"\n(?=\d+\.\d+\. )", text) if c.strip()]  # one per section
    docs["en"] += [strip_html(read(p) or "") for p in sorted(glob.glob("/usr/share/gimp/2.0/help/en/**/*.html", recursive=True))]
    docs["zh"] += [strip_html(read(p) or "").split("Help content debug info:")[0]
                   for p in sorted(glob.glob("/usr/share/libreoffice/help/zh-CN/**/*.html", recursive=True))]
    docs["zh"] += [strip_html(read(p) or "") for p in sorted(glob.glob("/usr/share/doc/maint-guide-zh-cn/html/*.html"))
                   + ["/usr/share/doc/debian-edu-doc-zh-cn/debian-edu-bookworm-manual.html"] if os.path.exists(p)]
    docs["zh"].append(read("/usr/share/doc/debian/FAQ/debian-faq.zh-cn.txt.gz") or "")
    for p in sorted(glob.glob("/usr/share/games/fortunes/*.u8")):
        items = [x.strip() for x in (read(p) or "").split("\n%\n") if x.strip()]
        docs["zh"] += ["\n\n".join(items[i : i + 20]) for i in range(0, len(items), 20)]
    docs["en"] += [t for t in map(read, sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/**/*.txt", recursive=True))) if t]
    return docs


def main(argv: list[str]):
    (cfg,) = load_config(argv, Config)
    out_dir = cfg.out_dir
    rng = random.Random(0)
    train, held = [], {"zh": [], "en": []}
    budget = {"zh": 12.0e6, "en": 9.0e6}  # bytes per language
    for lang, docs in documents().items():
        docs = [d for d in docs if d and len(d) > 50]
        rng.shuffle(docs)
        used = 0
        for d in docs:
            if used > budget[lang]:
                break
            used += len(d.encode())
            (held[lang] if zlib.crc32(d.encode()) % 20 == 0 else train).append(d)
    rng.shuffle(train)
    os.makedirs(out_dir, exist_ok=True)
    with open(f"{out_dir}/train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in train)
    for name, docs in [("heldout", held["zh"] + held["en"]), ("heldout_zh", held["zh"]), ("heldout_en", held["en"])]:
        with open(f"{out_dir}/{name}.txt", "w", encoding="utf-8") as f:
            f.write("\n\n".join(docs))
    print(f"{out_dir}/train.jsonl: {sum(len(d.encode()) for d in train) / 1e6:.1f} MB in {len(train)} documents")


if __name__ == "__main__":
    cli(main)
