"""SFT rows packed with whole conversations: the packer against a plain reference, the packed batch against the
padded one (the same loss and gradients), and training and resuming with pack=True."""
import numpy as np
import pytest
import torch

from conftest import TINY_CONTEXT, assert_resumes_exactly, read_metrics, sft, tiny
from data import Loader, Packed, PackedSFTData, SFTData, best_fit, pack_rows, pad_rows
from errors import DataError
from token_cache import tokenize_file


def best_fit_reference(lengths, capacity):
    """Best fit decreasing as the textbook has it: every bin scanned for the least room that takes the item."""
    bins, rooms, when = [], [], []
    for t, i in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        fitting = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fitting:
            b = min(fitting, key=lambda b: (rooms[b], -when[b]))  # among equal rooms: the one that got it last
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
            when.append(t)
        bins[b].append(i)
        rooms[b] -= lengths[i]
        when[b] = t
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_packs_every_item_once_within_capacity_as_the_textbook_does(seed):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.0, 0.9, 400).astype(int) + 1, 64)
    bins = best_fit(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(400))
    assert all(lengths[b].sum() <= 64 for b in bins)
    assert bins == best_fit_reference(lengths.tolist(), 64)


def test_best_fit_refuses_an_item_longer_than_a_row():
    with pytest.raises(DataError, match="an item of 9 does not fit rows of 8"):
        best_fit([3, 9, 2], 8)


def test_packed_rows_hold_each_conversation_as_padding_would_with_positions_restarting():
    rng = np.random.default_rng(0)
    pieces = [(rng.integers(3, 50, n), rng.integers(0, 2, n).astype(np.uint8)) for n in (5, 9, 4, 2)]
    X, Y, M, P, ends = pack_rows([Packed(pieces[:3], [0, 1, 2]), Packed(pieces[3:], [3])], pad_id=0, T=20)
    assert X.shape == Y.shape == M.shape == P.shape == (2, 20)
    row, at = 0, 0
    for k, piece in enumerate(pieces):
        if k == 3:
            row, at = 1, 0
        x, y, m = pad_rows([piece], pad_id=0)
        n = len(piece[0]) - 1
        assert torch.equal(X[row, at:at + n], x[0]) and torch.equal(Y[row, at:at + n], y[0])
        assert torch.equal(M[row, at:at + n], m[0]) and P[row, at:at + n].tolist() == list(range(n))
        at += n
    assert M[0, 15:].sum() == 0 and P[0, 15:].tolist() == [0] * 5 and X[0, 15:].tolist() == [0] * 5  # padding
    assert ends.tolist() == [3, 11, 14, 20]  # each piece's last input in X.flatten()


@pytest.fixture(scope="module")
def conversations(demo_dir, tok):
    return tokenize_file(f"{demo_dir}/sft.jsonl", tok, "sft", max_len=TINY_CONTEXT + 1)


def test_a_packed_epoch_holds_every_conversation_once_in_rows_of_max_seq_len(conversations, tok):
    data = PackedSFTData(conversations, TINY_CONTEXT)
    loader = Loader(data, 8, tok.pad_id, seed=3)
    seen = []
    for _ in range(len(loader)):
        X, Y, M, items, P, _, tokens = loader.next_batch()
        assert X.shape == P.shape == (8, TINY_CONTEXT)
        assert tokens == sum(conversations.lengths()[items] - 1) <= X.numel()  # the real inputs, padding not
        seen += items.tolist()  # the conversations in the rows
    full = len(loader) * 8
    assert len(seen) == len(set(seen)) == sum(len(data.rows[i]) for i in loader.order(0)[:full])
    lengths = conversations.lengths() - 1
    assert sum(lengths) / (len(data) * TINY_CONTEXT) > 0.9  # rows are full: padding under 10%


@pytest.mark.parametrize("flash", [False, True])
def test_the_packed_step_has_the_padded_steps_loss_and_gradients(conversations, tok, flash):
    """Conversations as packed rows and as one padded row each: the same summed loss over the answer tokens and the
    same gradients, within float32 rounding."""
    data = PackedSFTData(conversations, TINY_CONTEXT)
    rows = [data[i][0] for i in range(6)]
    model = tiny(vocab_size=tok.vocab_size, max_seq_len=TINY_CONTEXT, flash=flash)
    X, Y, M, P, _ = pack_rows(rows, tok.pad_id, TINY_CONTEXT)
    packed = model(X, Y, M, reduction="sum", positions=P)[1]
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    X, Y, M = pad_rows([piece for row in rows for piece in row], tok.pad_id)
    padded = model(X, Y, M, reduction="sum")[1]
    padded.backward()
    assert packed.item() == pytest.approx(padded.item(), rel=1e-5)
    for a, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


def test_sft_trains_and_resumes_exactly_with_packed_rows(tiny_pretrained, demo_dir, tmp_path):
    def run(out_dir, *flags):
        sft(tiny_pretrained, demo_dir, out_dir, "--pack=True", "--max_steps=8", "--save_interval=4",
            "--eval_interval=4", *flags)

    assert_resumes_exactly(run, tmp_path / "full", tmp_path / "resumed", saved=4, last=8)


def test_sft_learns_with_packed_rows(tiny_pretrained, demo_dir, tmp_path):
    sft(tiny_pretrained, demo_dir, tmp_path, "--pack=True", "--max_steps=30", "--eval_interval=30")
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_a_packed_and_a_padded_dataset_hold_the_same_conversations(conversations):
    packed, padded = PackedSFTData(conversations, TINY_CONTEXT), SFTData(conversations)
    assert sorted(j for row in packed.rows for j in row) == list(range(len(padded)))
