"""
Writes a JSONL corpus without its exact and near duplicates, keeping the first record of each cluster in place.

    python dedup.py data/pretrain_hq.jsonl data/pretrain_dedup.jsonl                     # {"text": ...} records
    python dedup.py data/sft_mini_512.jsonl data/sft_dedup.jsonl --field=conversations --threshold=0.9

A record is a near duplicate when the estimated Jaccard similarity of its character 5-grams to an earlier kept
record's is at least threshold (MinHash and LSH, minhash.py); conversations are compared on their messages' contents.
IN is read twice and never written: first for the records' signatures (a few hundred bytes each stay in memory,
never the texts), then to copy the kept lines byte for byte into a temp file that replaces OUT once complete.
`python dedup.py --help` lists every key.
"""
import dataclasses
import os
import time

import numpy as np

from config import help_text, load_config
from errors import BadRecord, ConfigError, DataError, cli
from fileio import atomic_write
from minhash import SHINGLE, DuplicateFinder, record_text, snippets
from token_cache import parse_line

USAGE = "usage: python dedup.py IN.jsonl OUT.jsonl [config_file.py] [--key=value ...]"
BATCH_CHARS = 1 << 20  # characters hashed per batch: amortises numpy's per-call cost, bounds the shingle buffers
EXAMPLES = 3  # removed records shown, of each kind


@dataclasses.dataclass
class Config:
    # --- data
    field: str = "text"  # the string field records are compared on; conversations: an SFT record's contents, joined
    # --- near duplicates
    threshold: float = 0.8  # estimated Jaccard similarity of character 5-grams from which a record is a near duplicate


def records(path: str, field: str):
    """(line number, the line's bytes, the text compared) of each non-blank line; a bad line is an error naming it."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = parse_line(line)
                if record is not None:
                    yield lineno, line, record_text(record, field)
            except BadRecord as e:
                raise BadRecord(f"{path}:{lineno}: {e}") from None


def find_duplicates(path: str, cfg: Config):
    finder, batch, chars = DuplicateFinder(cfg.threshold), [], 0
    for _, _, text in records(path, cfg.field):
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            finder.add(batch)
            batch, chars = [], 0
    finder.add(batch)
    return finder.find()


def write_kept(in_path: str, out_path: str, cfg: Config, duplicates, shown: set[int],
               before: os.stat_result) -> dict[int, tuple[int, str]]:
    """Copy the kept lines to OUT atomically (fileio.atomic_write): a crash, a full disk or an error leaves the old
    OUT or the complete new one, never part of one. IN must be as it was (`before`,
    its stat when the first pass began). Returns {record: (line, text)} of the records in shown."""
    of = duplicates.of
    texts, n = {}, 0
    changed = DataError(f"{in_path} changed while dedup read it; {out_path} is left as it was")
    with atomic_write(out_path) as f:
        for n, (lineno, line, text) in enumerate(records(in_path, cfg.field), 1):
            if n > len(of):
                raise changed
            if n - 1 in shown:
                texts[n - 1] = (lineno, text)
            if of[n - 1] < 0:
                f.write(line if line.endswith(b"\n") else line + b"\n")
        after = os.stat(in_path)
        if n != len(of) or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise changed
    return texts


def main(argv: list[str]):
    if "-h" in argv or "--help" in argv:
        print(USAGE + "\n" + help_text([Config], ()).split("\n", 1)[1])
        raise SystemExit(0)
    if len(argv) < 2 or any(a.startswith("--") for a in argv[:2]):
        raise ConfigError(USAGE)
    in_path, out_path = argv[:2]
    (cfg,) = load_config(argv[2:], Config)
    if not 0 < cfg.threshold <= 1:
        raise ConfigError(f"config key 'threshold' must be in (0, 1], got {cfg.threshold}")
    if not os.path.isfile(in_path):
        raise DataError(f"IN {in_path} is not a file")
    if os.path.exists(out_path) and os.path.samefile(in_path, out_path):
        raise ConfigError(f"OUT {out_path} is IN: dedup never writes over its input")
    if os.path.isdir(out_path) or not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise DataError(f"OUT {out_path} must name a file in an existing directory")

    t0, before = time.perf_counter(), os.stat(in_path)
    duplicates = find_duplicates(in_path, cfg)
    n = len(duplicates.of)
    exact, near = np.flatnonzero(duplicates.exact), np.flatnonzero((duplicates.of >= 0) & ~duplicates.exact)
    examples = [int(i) for i in [*near[:EXAMPLES], *exact[:EXAMPLES]]]
    shown = {*examples, *(int(duplicates.of[i]) for i in examples)}
    texts = write_kept(in_path, out_path, cfg, duplicates, shown, before)
    seconds, mb = time.perf_counter() - t0, os.path.getsize(in_path) / 1e6

    rate = lambda k: f"{k:,} ({k / max(n, 1):.2%})"  # noqa: E731
    print(f"{in_path}: {n:,} records, {mb:.1f} MB in {seconds:.1f} s ({mb / seconds:.1f} MB/s)")
    print(f"exact duplicates: {rate(len(exact))}; near duplicates (estimated Jaccard >= {cfg.threshold} of "
          f"character {SHINGLE}-grams): {rate(len(near))}; removed {rate(len(exact) + len(near))}")
    for i in examples:
        (line, text), (first_line, first_text) = texts[i], texts[int(duplicates.of[i])]
        if duplicates.exact[i]:
            print(f"  line {line} repeats line {first_line}: {snippets(text, text)[0]!r}")
        else:
            first_snippet, snippet = snippets(first_text, text)
            print(f"  line {line} ~ line {first_line}, similarity {duplicates.similarity[i]:.2f}:\n"
                  f"    {first_snippet!r}\n    {snippet!r}")
    print(f"wrote {out_path}: {n - len(exact) - len(near):,} records")


if __name__ == "__main__":
    cli(main)
