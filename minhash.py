"""
Near duplicates: MinHash signatures of character n-grams, LSH banding for candidate pairs, and which records to keep.
dedup.py writes a corpus without them; diagnose.py data counts them.

  shingle_hashes   a text -> one 32-bit hash per character 5-gram of its normalised form
  MinHash          texts -> signatures: per hash function, the least value over a text's shingles
  similarity       two signatures -> the estimated Jaccard similarity of the shingle sets: the share of equal minima
  record_text      what a JSONL record is compared on: its text, or a conversation's contents joined
  DuplicateFinder  records added in order, batch by batch; find() -> the earlier record each one duplicates (exact
                   copy, or estimated similarity >= threshold to a record kept), -1 for the first of each cluster

Deterministic across runs and machines: a fixed polynomial hash of code points (Python's hash() is salted per
process) and hash functions drawn from np.random.default_rng(seed).
"""
import hashlib
import unicodedata
from bisect import bisect_right
from typing import NamedTuple

import numpy as np

from errors import BadRecord

SHINGLE = 5  # characters: a short Chinese phrase or about one English word; one edit changes at most 5 shingles
NUM_PERM = 128  # hash functions: an estimate's standard error is at most 0.5 / sqrt(128) = 0.044
BLOCK = 8192  # shingles hashed at once: a (128, 8192) uint64 buffer, 8 MB, whatever the texts' lengths
ROLL = np.uint64(0x100000001B3)  # FNV's 64-bit prime: the base of the polynomial hashes (mod 2^64)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit, so the top 32 bits are a good hash."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def normalise(text: str) -> str:
    """NFKC (full-width letters, digits and punctuation as ASCII: ，-> ,), case folded, each run of whitespace one
    space: copies that differ only in those are the same text."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def shingle_hashes(text: str, n: int = SHINGLE) -> np.ndarray:
    """uint64 values below 2^32, one per character n-gram of normalise(text): a polynomial hash of its n code points,
    mixed. A non-empty text shorter than n characters is one shingle; an empty text has none."""
    points = np.frombuffer(normalise(text).encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    m = max(len(points) - n + 1, min(len(points), 1))  # the number of shingles
    h = np.zeros(m, np.uint64)
    for k in range(min(n, len(points))):
        h = h * ROLL + points[k : k + m]
    return _mix(h) >> np.uint64(32)


class MinHash:
    """num_perm hash functions h(x) = (a x + b mod 2^64) >> 32, a odd: Dietzfelbinger's multiply-add-shift, a
    universal family that needs no division (a x + b mod p ran at half the speed in numpy)."""

    def __init__(self, num_perm: int = NUM_PERM, seed: int = 0):
        rng = np.random.default_rng(seed)  # never the global RNG: the same functions on every machine and run
        self.a = rng.integers(0, 2**64, num_perm, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**64, num_perm, dtype=np.uint64)

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint32: per hash function, the least value over each text's shingles (all ones for
        an empty text). The texts' shingles are hashed together, BLOCK at a time: many short texts cost as few
        numpy calls as one long one."""
        hashes = [shingle_hashes(t) for t in texts]
        lengths = np.array([len(h) for h in hashes], dtype=np.int64)
        ends = np.cumsum(lengths)
        begins = ends - lengths
        x = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        minima = np.full((len(self.a), len(texts)), np.iinfo(np.uint64).max, np.uint64)  # (num_perm, texts)
        buffer = np.empty((len(self.a), min(BLOCK, len(x))), np.uint64)  # reused: allocating it was half the time
        for start in range(0, len(x), BLOCK):
            stop = min(start + BLOCK, len(x))
            rows = np.arange(np.searchsorted(ends, start, "right"), np.searchsorted(begins, stop, "left"))
            rows = rows[lengths[rows] > 0]  # the texts with shingles in this block, in order
            h = np.multiply(self.a[:, None], x[start:stop], out=buffer[:, : stop - start])  # (num_perm, block)
            h += self.b[:, None]  # a x + b mod 2^64
            block_minima = np.minimum.reduceat(h, np.maximum(begins[rows], start) - start, axis=1)
            minima[:, rows] = np.minimum(minima[:, rows], block_minima)
        # the top 32 bits of the least 64-bit value are the least top 32 bits: no shift over the whole block
        return np.ascontiguousarray((minima >> np.uint64(32)).astype(np.uint32).T)


def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The estimated Jaccard similarity of signatures a and b (broadcast over leading axes): the share of hash
    functions whose minima agree, which is the chance that the least shingle of the union lies in both texts."""
    return np.mean(a == b, axis=-1)


def lsh_bands(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band): the most rows (the fewest chance candidates to verify) with which two texts exactly at
    the threshold still share a whole band with probability >= 0.99, that is 1 - (1 - t^rows)^bands. Pairs more
    similar are found more surely; 0.8 gives 21 bands of 6 rows."""
    for rows in range(num_perm, 1, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= 0.99:
            return bands, rows
    return num_perm, 1


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(N, bands) uint32: a hash of each band's rows. Two texts with equal keys in some band are candidates (equal
    32-bit keys by chance are a few more candidates, which verification turns away)."""
    banded = signatures[:, : bands * rows].reshape(len(signatures), bands, rows).astype(np.uint64)
    h = np.zeros((len(signatures), bands), np.uint64)
    for r in range(rows):
        h = h * ROLL + banded[:, :, r]
    return (_mix(h) >> np.uint64(32)).astype(np.uint32)


def text_digest(text: str) -> int:
    """64 bits of blake2b of the text: equal digests are exact copies (a chance collision in 10^8 records: 3e-4)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def record_text(record: dict, field: str) -> str:
    """What a record is compared on: its string field, or (field "conversations") its messages' contents joined by
    newlines, so SFT records that differ only in roles, system fields or tool metadata are the same text."""
    value = record.get(field)
    if field != "conversations":
        if not isinstance(value, str):
            raise BadRecord(f"missing field {field!r}" if value is None
                            else f"{field!r} must be a string, got {type(value).__name__}")
        return value
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise BadRecord("missing field 'conversations'" if value is None
                        else "'conversations' must be a list of messages")
    contents = [m.get("content") or "" for m in value]  # a tool call's message may have no content
    if not all(isinstance(c, str) for c in contents):
        raise BadRecord("a message's 'content' must be a string")
    return "\n".join(contents)


def snippets(a: str, b: str, width: int = 60) -> tuple[str, str]:
    """Both texts on one line each, from a little before where they first differ (the beginnings of near duplicates
    are often the same), cut to width characters."""
    a, b = " ".join(a.split()), " ".join(b.split())
    start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) if a != b else 0)
    start = max(start - width // 3, 0)
    return tuple(("…" if start else "") + t[start : start + width] + ("…" if len(t) > start + width else "")
                 for t in (a, b))


# -----------------------------------------------------------------------------
# which records to keep

class Duplicates(NamedTuple):
    of: np.ndarray  # (N,) int64: the earlier record each one duplicates; -1 for a record kept
    similarity: np.ndarray  # (N,) float32: its estimated Jaccard similarity to that record (1 for an exact copy)
    exact: np.ndarray  # (N,) bool: an exact copy (the same text) of record `of`


class DuplicateFinder:
    """Records are added in file order, batch by batch, and find() decides: a record is a duplicate if its text
    equals an earlier record's, or if its estimated similarity to an earlier kept record is >= threshold; the first
    of each cluster is kept. Only comparing with kept records keeps a chain of small edits from removing a text
    far from the one kept. Memory per record, whatever its length: an 8-byte digest, a 4-byte key per band and the
    low 16 bits of each minimum (chance matches of those add under 2^-16 to an estimate), 348 bytes at the defaults."""

    def __init__(self, threshold: float = 0.8, num_perm: int = NUM_PERM, seed: int = 0):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.minhash = MinHash(num_perm, seed)
        self.bands, self.rows = lsh_bands(threshold, num_perm)
        self.digests, self.keys, self.sketches = [], [], []  # one array per batch
        self.starts = [0]  # the index of each batch's first record, then the count

    def __len__(self) -> int:
        return self.starts[-1]

    def add(self, texts: list[str]):
        if not texts:
            return
        signatures = self.minhash.signatures(texts)
        self.digests.append(np.array([text_digest(t) for t in texts], dtype=np.uint64))
        self.keys.append(band_keys(signatures, self.bands, self.rows))
        self.sketches.append(signatures.astype(np.uint16))
        self.starts.append(self.starts[-1] + len(texts))

    def sketch(self, i: int) -> np.ndarray:
        k = bisect_right(self.starts, i) - 1
        return self.sketches[k][i - self.starts[k]]

    def find(self) -> Duplicates:
        n = len(self)
        of, sim, exact = np.full(n, -1, np.int64), np.zeros(n, np.float32), np.zeros(n, bool)
        if n == 0:
            return Duplicates(of, sim, exact)
        # exact copies: each record whose digest an earlier record has points at the first with it
        digests = np.concatenate(self.digests)
        order = np.argsort(digests, kind="stable")  # stable: equal digests in file order
        sorted_digests = digests[order]
        first = np.r_[True, sorted_digests[1:] != sorted_digests[:-1]]
        first_of_run = order[np.flatnonzero(first)][np.cumsum(first) - 1]
        of[order[~first]], sim[order[~first]], exact[order[~first]] = first_of_run[~first], 1.0, True
        del digests, order, sorted_digests
        # LSH over the rest: per band, the bucket of each record that shares it with another record (-1: alone)
        originals = np.flatnonzero(~exact)
        buckets = np.full((n, self.bands), -1, np.int32 if n < 2**31 else np.int64)
        for band in range(self.bands):
            keys = np.concatenate([k[:, band] for k in self.keys])[originals]
            order = np.argsort(keys, kind="stable")
            sorted_keys = keys[order]
            bucket = np.cumsum(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]) - 1
            shared = np.bincount(bucket)[bucket] > 1
            buckets[originals[order[shared]], band] = bucket[shared]
        # in file order: compare with the kept records found in the same buckets; a record with none there is kept
        kept_in: dict[tuple[int, int], list[int]] = {}  # (band, bucket) -> the kept records in it, in order
        for i in np.flatnonzero(~exact & (buckets >= 0).any(axis=1)).tolist():
            mine = [(band, b) for band, b in enumerate(buckets[i].tolist()) if b >= 0]
            candidates = sorted({j for key in mine for j in kept_in.get(key, ())})
            if candidates:
                s = similarity(np.stack([self.sketch(j) for j in candidates]), self.sketch(i))
                best = int(np.argmax(s))  # ties: the earliest
                if s[best] >= self.threshold:
                    of[i], sim[i] = candidates[best], s[best]
                    continue
            for key in mine:
                kept_in.setdefault(key, []).append(i)
        return Duplicates(of, sim, exact)
