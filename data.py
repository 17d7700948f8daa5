"""
The batches the training scripts consume: Batch(X, Y, loss_mask, items, positions, ends, tokens) on the device.

  PretrainData   documents packed end to end, cut into windows of max_seq_len + 1 tokens
  SFTData        one conversation per item, loss on what the assistant writes
  PackedSFTData  whole conversations packed into rows of max_seq_len (best_fit), attention kept inside each
  DPOData        one preference pair per item: prompt + chosen, prompt + rejected
  PackedDPOData  whole pairs packed into rows of 2 x max_seq_len (the reward model's pieces whole)
  Loader         Batches in a seeded order, split over ranks, resumable; padded to the batch's longest row
  pretrain_loaders, sft_loaders, dpo_loaders   a stage's training and validation loaders from its config
  Prompt, read_prompts, prompt_loaders         RL's prompts (train_grpo.py): item indices, in the same order
"""
import bisect
import dataclasses
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from chat import check_messages, encode_chat, json_field, json_type
from errors import BadRecord, CheckpointError, DataError
from token_cache import Records, expand_paths, held_out, load_split, parse_line, text_lines
from tools import check_tools


# -----------------------------------------------------------------------------
# datasets: item i -> a tuple of rows; a row is (ids, loss_mask or None for "all ones")

class PretrainData:
    """Documents packed end to end, cut into windows of max_seq_len + 1 tokens (consecutive windows share
    one token, so every token is a target exactly once); the tail that fills no window is dropped. Several
    files are one stream: a window may run from one file's last document into the next file's first."""

    def __init__(self, records: Records, max_seq_len: int):
        self.spans = records.token_spans()  # memory-mapped, one per file
        self.starts = [0]  # (n_spans + 1,): where each span starts in the stream
        for span in self.spans:
            self.starts.append(self.starts[-1] + len(span))
        self.max_seq_len = max_seq_len

    def __len__(self):
        return max(self.starts[-1] - 1, 0) // self.max_seq_len

    def __getitem__(self, i):
        start = i * self.max_seq_len
        end, s = start + self.max_seq_len + 1, bisect.bisect_right(self.starts, start) - 1
        if end <= self.starts[s + 1]:  # within one file (nearly always): a view, no copy
            return ((self.spans[s][start - self.starts[s] : end - self.starts[s]], None),)
        pieces = []
        while start < end:
            pieces.append(self.spans[s][start - self.starts[s] : end - self.starts[s]])
            start, s = self.starts[s + 1], s + 1
        return ((np.concatenate(pieces), None),)


class SFTData:
    """Item i -> one row: conversation i's (ids, loss_mask)."""

    def __init__(self, records: Records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return (self.records[i],)


class DPOData(SFTData):
    """Item i -> two rows: (prompt + chosen, prompt + rejected), loss_mask 1 on the answers only."""

    def __getitem__(self, i):
        return pair_pieces(*self.records[i])


def pair_pieces(prompt, chosen, rejected) -> tuple:
    """A preference pair's two sequences, (ids, loss_mask) each: the prompt, then the answer, which alone has loss."""
    masked = np.zeros(len(prompt), dtype=np.uint8)
    return tuple((np.concatenate([prompt, a]), np.concatenate([masked, np.ones(len(a), np.uint8)]))
                 for a in (chosen, rejected))


class PackedSFTData:
    """Item i -> one row of whole conversations, at most max_seq_len tokens in all (best_fit), each its own
    (ids, loss_mask) piece: the loader shifts each piece on its own and restarts its positions, and the model keeps
    attention inside it. Which conversations share a row depends on their lengths alone, so it is the same on every
    rank and after a resume; the loader shuffles the rows."""

    def __init__(self, records: Records, max_seq_len: int):
        self.records, self.row_length = records, max_seq_len
        self.rows = best_fit(records.lengths() - 1, max_seq_len)  # a conversation of n ids feeds n - 1 positions

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return (Packed((self.records[j] for j in self.rows[i]), self.rows[i]),)


class PackedDPOData:
    """Item i -> one row of whole preference pairs, at most 2 x max_seq_len tokens (a pair's two sequences, each up
    to max_seq_len, share a row, so its log-probs are computed together): the pieces prompt + chosen, prompt +
    rejected of each pair in turn, as DPOData has them. whole (the reward model, which reads a sequence's last token):
    each piece gets a dummy last target (its last id again, loss_mask 0), so that every id of it is an input."""

    def __init__(self, records: Records, max_seq_len: int, whole: bool = False):
        self.records, self.row_length, self.whole = records, 2 * max_seq_len, whole
        prompt, chosen, rejected = (records.lengths(array) for array in range(3))  # (n,) each
        pieces = np.stack([prompt + chosen, prompt + rejected]) - (0 if whole else 1)  # input positions of each
        if pieces.max(initial=0) > max_seq_len:
            raise DataError(f"a pair's sequence of {pieces.max()} positions exceeds max_seq_len={max_seq_len}")
        self.rows = best_fit(pieces.sum(axis=0), self.row_length)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        pieces = [piece for j in self.rows[i] for piece in pair_pieces(*self.records[j])]
        if self.whole:
            pieces = [(np.append(ids, ids[-1]), np.append(mask, np.uint8(0))) for ids, mask in pieces]
        return (Packed(pieces, self.rows[i]),)


class Packed(list):
    """A row of several (ids, loss_mask) pieces, each a conversation of its own; items: the dataset's item indices
    they come from, in order (a DPO pair gives two pieces, one item)."""

    def __init__(self, pieces, items):
        super().__init__(pieces)
        self.items = items


def best_fit(lengths, capacity: int) -> list[list[int]]:
    """Best fit decreasing: items by length, longest first (ties: the earlier first), each into the bin with the
    least room left that still takes it, or a new bin; bins of item indices in the order placed. Rooms are found
    with a bit mask (bit r: some bin has room r), so a million items take seconds."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and not 1 <= lengths.min() <= lengths.max() <= capacity:
        raise DataError(f"an item of {lengths.min() if lengths.min() < 1 else lengths.max()} does not fit rows of "
                        f"{capacity}")
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # bins by the room they have left
    rooms, bins = 0, []
    for i in np.lexsort((np.arange(len(lengths)), -lengths)).tolist():
        n = int(lengths[i])
        if fits := rooms >> n:
            room = n + (fits & -fits).bit_length() - 1  # the least room that takes n
            b = by_room[room].pop()
            if not by_room[room]:
                rooms &= ~(1 << room)
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        by_room[room - n].append(b)
        rooms |= 1 << (room - n)
    return bins


def pad_rows(rows, pad_id: int):
    """Rows of ids -> X, Y (n, T) int64 and loss_mask (n, T) float32, padded to the longest row in the batch
    (T = its length - 1); padded positions have mask 0."""
    T = max(len(ids) for ids, _ in rows) - 1
    X = np.full((len(rows), T), pad_id, dtype=np.int64)
    Y = np.full((len(rows), T), pad_id, dtype=np.int64)
    M = np.zeros((len(rows), T), dtype=np.float32)
    for r, (ids, mask) in enumerate(rows):
        n = len(ids) - 1
        X[r, :n], Y[r, :n] = ids[:-1], ids[1:]
        M[r, :n] = 1.0 if mask is None else mask[1:]
    return torch.from_numpy(X), torch.from_numpy(Y), torch.from_numpy(M)


def pack_rows(rows: list[Packed], pad_id: int, T: int):
    """Packed rows -> X, Y (n, T) int64, loss_mask (n, T) float32, positions (n, T) int64 and ends (pieces,) int64:
    each piece shifted on its own (its last id is no input, its first no target), its positions 0, 1, ...; the tail
    after the last piece is padding, mask 0, each pad at position 0 (a conversation of its own, for the model's
    attention). ends: where each piece's last position is in X.flatten(), the pieces in row order."""
    X = np.full((len(rows), T), pad_id, dtype=np.int64)
    Y = np.full((len(rows), T), pad_id, dtype=np.int64)
    M = np.zeros((len(rows), T), dtype=np.float32)
    P = np.zeros((len(rows), T), dtype=np.int64)
    ends = []
    for r, pieces in enumerate(rows):
        at = 0
        for ids, mask in pieces:
            n = len(ids) - 1
            X[r, at : at + n], Y[r, at : at + n], P[r, at : at + n] = ids[:-1], ids[1:], np.arange(n)
            M[r, at : at + n] = 1.0 if mask is None else mask[1:]
            at += n
            ends.append(r * T + at - 1)
    return (torch.from_numpy(X), torch.from_numpy(Y), torch.from_numpy(M), torch.from_numpy(P),
            torch.tensor(ends, dtype=torch.int64))


class Batch(NamedTuple):
    """What a loader hands the loop. items: the item indices it holds (conversations, windows, pairs). Packed rows
    (else None): positions, each token's position in its own piece; ends (pieces,), each piece's last position in
    X.flatten(), the pieces in items' order (a DPO pair's chosen, then its rejected). tokens: the real (non-pad)
    inputs in X, for the log's padding fraction."""
    X: torch.Tensor
    Y: torch.Tensor
    loss_mask: torch.Tensor
    items: torch.Tensor
    positions: torch.Tensor | None
    ends: torch.Tensor | None
    tokens: int


class Loader:
    """Batches in a seeded order that every rank computes alike; rank r takes every world_size-th item of each
    global batch, so the ranks' batches together are exactly the batch a single process would see.
    Epochs are reshuffled; the position (epoch, batch) is saved and restored for an exact resume."""

    def __init__(self, dataset, batch_size: int, pad_id: int, device="cpu", seed: int = 0, rank: int = 0,
                 world_size: int = 1, name: str = "data"):
        self.dataset, self.batch_size, self.pad_id, self.device = dataset, batch_size, pad_id, torch.device(device)
        self.seed, self.rank, self.world_size, self.name = seed, rank, world_size, name
        self.epoch, self.pos = 0, 0
        self._order = (None, None)  # (epoch, its item order)
        if len(dataset) < world_size:
            raise DataError(f"{name}: {len(dataset)} items, fewer than the {world_size} ranks")

    def __len__(self):
        """Full batches per epoch (per rank)."""
        return len(self.dataset) // (self.batch_size * self.world_size)

    def order(self, epoch: int) -> np.ndarray:
        """The item order of an epoch, a pure function of (seed, epoch); computed once per epoch."""
        if self._order[0] != epoch:
            self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        return self._order[1]

    def next_batch(self):
        """The next training Batch, on the device."""
        if len(self) == 0:
            raise DataError(f"{self.name}: {len(self.dataset)} items cannot fill one batch of "
                             f"{self.batch_size} x {self.world_size} rank(s)")
        if self.pos == len(self):
            self.epoch, self.pos = self.epoch + 1, 0
        step = self.batch_size * self.world_size
        items = self.order(self.epoch)[self.pos * step : (self.pos + 1) * step][self.rank :: self.world_size]
        self.pos += 1
        return self.batch(items)

    def batches(self, limit: int):
        """For evaluation: this rank's share of the items in file order, at most `limit` batches (the last may
        be short). Leaves the training position alone."""
        mine = np.arange(self.rank, len(self.dataset), self.world_size)
        for start in range(0, min(len(mine), limit * self.batch_size), self.batch_size):
            yield self.batch(mine[start : start + self.batch_size])

    def batch(self, indices) -> Batch:
        """Items -> a Batch on the device: rows padded to the longest, or packed rows of the dataset's row_length."""
        items = [self.dataset[int(i)] for i in indices]
        rows = [item[j] for j in range(len(items[0])) for item in items]  # DPO: all chosen rows, then all rejected
        tokens = sum(len(ids) - 1 for row in rows for ids, _ in (row if isinstance(row, Packed) else [row]))
        if isinstance(rows[0], Packed):
            X, Y, M, positions, ends = pack_rows(rows, self.pad_id, self.dataset.row_length)
            indices = [i for row in rows for i in row.items]
        else:
            (X, Y, M), positions, ends = pad_rows(rows, self.pad_id), None, None
        batch = Batch(X, Y, M, torch.as_tensor(np.asarray(indices, dtype=np.int64)), positions, ends, tokens)
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return Batch(*(t.pin_memory().to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                           for t in batch))
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "items": len(self.dataset), "batch": self.batch_size * self.world_size}

    def load_state_dict(self, state: dict):
        """The position of a checkpoint's run, on the same items; with another batch_size x ranks it is mapped onto
        this run's batches (the same items in the same order), said so, or refused where it falls inside a batch."""
        items, batch = state.get("items", len(self.dataset)), state.get("batch", self.batch_size * self.world_size)
        if items != len(self.dataset):
            raise CheckpointError(f"{self.name}: the checkpoint's run had {items:,}, this run has {len(self.dataset):,}: "
                                  "resume on the data it trained on (data_path, val_data_path, val_fraction, "
                                  "max_seq_len), or start a new run from it with init_from")
        step, done = self.batch_size * self.world_size, state["pos"] * batch  # done: this epoch's items trained on
        if done % step:
            raise CheckpointError(f"{self.name}: the checkpoint's run took {batch} per batch (batch_size x ranks) and "
                                  f"stopped {done:,} into epoch {state['epoch']}, which this run's {step} "
                                  f"({self.batch_size} x {self.world_size} rank(s)) does not divide: resume with "
                                  f"batch_size x ranks = {batch}")
        if step != batch and self.rank == 0:
            print(f"{self.name}: batches of {batch} before, {step} now (batch_size x ranks): resuming {done:,} into "
                  f"epoch {state['epoch']}, at batch {done // step} of {len(self)}", flush=True)
        self.epoch, self.pos = state["epoch"], done // step


# -----------------------------------------------------------------------------
# a stage's loaders, from its config

def stage_loaders(cfg, tokenizer, run, kind: str, dataset, items: str, **options) -> tuple[Loader, Loader]:
    """Training and validation loaders of kind's records from cfg.data_path (and val_data_path), each record set
    wrapped in dataset(records); rank 0 tokenises (or finds the cache) first, the other ranks then read it."""
    with run.rank0_first("waiting for rank 0 to tokenise the data (or to find its cache)"):
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer, kind,
                                                verbose=run.master, **options)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    return (Loader(dataset(train_records), cfg.batch_size, name=f"training {items}", **loader_args),
            Loader(dataset(val_records), cfg.batch_size, name=f"validation {items}", **loader_args))


def pretrain_loaders(cfg, tokenizer, max_seq_len: int, run) -> tuple[Loader, Loader]:
    """Windows of max_seq_len + 1 tokens of packed documents."""
    return stage_loaders(cfg, tokenizer, run, "pretrain", lambda records: PretrainData(records, max_seq_len), "windows")


def sft_loaders(cfg, tokenizer, max_seq_len: int, run) -> tuple[Loader, Loader]:
    """Conversations of up to max_seq_len + 1 tokens (longer ones lose their earliest turns); with cfg.pack, rows
    of max_seq_len packed with them."""
    dataset = (lambda records: PackedSFTData(records, max_seq_len)) if cfg.pack else SFTData
    return stage_loaders(cfg, tokenizer, run, "sft", dataset, "rows" if cfg.pack else "conversations",
                         max_len=max_seq_len + 1, skip_bad=cfg.skip_bad)


def dpo_loaders(cfg, tokenizer, max_seq_len: int, run, whole: bool = False) -> tuple[Loader, Loader]:
    """Preference pairs, prompts and answers cut to cfg's max_prompt_length and max_completion_length; with
    cfg.pack, rows of 2 x max_seq_len packed with whole pairs (whole: the reward model's, PackedDPOData)."""
    dataset = (lambda records: PackedDPOData(records, max_seq_len, whole)) if cfg.pack else DPOData
    return stage_loaders(cfg, tokenizer, run, "dpo", dataset, "rows" if cfg.pack else "pairs",
                         max_prompt_length=cfg.max_prompt_length, max_completion_length=cfg.max_completion_length,
                         skip_bad=cfg.skip_bad)


# -----------------------------------------------------------------------------
# RL's prompts: few and small, read into memory whole, each with the record a reward function may look at

@dataclasses.dataclass
class Prompt:
    ids: list[int]  # the messages in the chat template, ending with its generation prompt
    messages: list[dict]  # the conversation up to its last user turn
    record: dict  # the whole JSONL record: its "answer" (or "gt") is what a checkable reward compares against
    where: str  # file:line, for errors


def read_prompts(data_path: str, tokenizer, max_prompt_length: int, need_reference: bool = False,
                 skip_bad: bool = False, verbose: bool = True) -> list[Prompt]:
    """JSONL {"conversations": [...], "answer" or "gt"} -> a Prompt per record, in file order. The prompt is the
    messages up to the last user turn (MiniMind's rlaif.jsonl ends each with an empty assistant turn); longer than
    max_prompt_length tokens, it loses its earliest turns. A bad record raises BadRecord naming file:line, or with
    skip_bad is skipped and counted."""
    prompts = []
    for path in expand_paths(data_path):
        with open(path, "rb") as f:
            lines = text_lines(f.read())
        before, skipped = len(prompts), Counter()
        for lineno, line in enumerate(lines, 1):
            try:
                record = parse_line(line)
                if record is not None:
                    prompts.append(prompt_of(record, tokenizer, max_prompt_length, need_reference, f"{path}:{lineno}"))
            except BadRecord as e:
                if not skip_bad:
                    raise BadRecord(f"{path}:{lineno}: {e}") from None
                skipped[str(e)] += 1
        if verbose:
            print(f"{path}: {len(prompts) - before:,} prompts"
                  + "".join(f"; skipped {n} x {why}" for why, n in skipped.items()))
    if not prompts:
        raise DataError(f"{data_path}: no prompts")
    return prompts


def prompt_of(record: dict, tokenizer, max_prompt_length: int, need_reference: bool, where: str) -> Prompt:
    if "conversations" not in record:
        raise BadRecord("missing field 'conversations' (a list of messages)")
    conversations = check_messages(record["conversations"])  # objects with string roles; the template checks the rest
    users = [i for i, m in enumerate(conversations) if m["role"] == "user"]
    if not users:
        raise BadRecord("no user message: the prompt is the conversation up to its last user turn")
    messages = conversations[: users[-1] + 1]
    reference = record.get("answer", record.get("gt"))
    if need_reference and reference is None:
        raise BadRecord("missing field 'answer' (or MiniMind's 'gt'): reward=answer compares the completion with it")
    values = reference if isinstance(reference, list) and reference else [reference]  # what answer_reward can compare
    if need_reference and not all(isinstance(v, str) or type(v) in (int, float) and abs(v) < float("inf")
                                  for v in values):
        raise BadRecord(f"'answer' (or 'gt') must be a string, a finite number or a non-empty list of them, got "
                        f"{json_type(reference)}")
    head = messages[:1] if messages[0]["role"] == "system" else []
    if head and head[0].get("tools"):  # a tool-use prompt (agent RL): its tools must be descriptions a model can read
        try:
            check_tools(json_field(head[0]["tools"], "'tools'"), "'tools'")
        except DataError as e:
            raise BadRecord(str(e)) from None
    last_turn, _ = encode_chat(tokenizer, head + messages[-1:], record.get("system"))
    if len(last_turn) > max_prompt_length:
        raise BadRecord(f"the last user turn alone is {len(last_turn)} tokens, more than max_prompt_length="
                        f"{max_prompt_length}")
    ids, _ = encode_chat(tokenizer, messages, record.get("system"), max_len=max_prompt_length)
    return Prompt(ids, messages, record, where)


class PromptLoader(Loader):
    """Loader's seeded, resumable, rank-split order over prompts; a batch is the item indices themselves."""

    def batch(self, indices):
        return [int(i) for i in indices]


def prompt_loaders(cfg, tokenizer, run, need_reference: bool) -> tuple[PromptLoader, PromptLoader]:
    """Training and validation prompts: val_data_path's, else the last val_fraction of data_path's."""
    read = lambda path: read_prompts(path, tokenizer, cfg.max_prompt_length, need_reference, cfg.skip_bad,  # noqa: E731
                                     verbose=run.master)
    prompts = read(cfg.data_path)
    if cfg.val_data_path:
        train, val = prompts, read(cfg.val_data_path)
    else:
        n_val = held_out(len(prompts), cfg.val_fraction, cfg.data_path, "prompts")
        train, val = prompts[:-n_val], prompts[-n_val:]
    args = dict(pad_id=tokenizer.pad_id, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    return (PromptLoader(train, cfg.batch_size, name="training prompts", **args),
            PromptLoader(val, cfg.batch_size, name="validation prompts", **args))
