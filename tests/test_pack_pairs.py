"""Preference pairs packed into rows (DPO, the reward model): each pair's log-probs and rewards as padding gives
them, with the same gradients; a precomputed reference equal to the live one; training and resuming with pack=True."""
import math

import pytest
import torch

from conftest import assert_resumes_exactly, read_metrics, tiny
from data import DPOData, Loader, PackedDPOData
from errors import DataError
from losses import pair_logprobs
from reward_model import RewardModel, batch_scores, bradley_terry_loss
from test_dpo import dpo
from test_reward_model import reward
from token_cache import tokenize_file

CONTEXT = 64  # the tiny models' max_seq_len: prompts and answers of 32 make sequences of up to 63 inputs


@pytest.fixture(scope="module")
def pairs(demo_dir, tok):
    return tokenize_file(f"{demo_dir}/dpo.jsonl", tok, "dpo", max_prompt_length=32, max_completion_length=32,
                         verbose=False)


def packed_and_padded(pairs, tok, whole: bool, rows: int = 6):
    """The first rows of packed pairs, and the same pairs in the same order padded, a row each."""
    packed = Loader(PackedDPOData(pairs, CONTEXT, whole), rows, tok.pad_id).batch(range(rows))
    padded = Loader(DPOData(pairs), rows, tok.pad_id).batch(packed.items)
    assert packed.X.shape == (rows, 2 * CONTEXT) and len(packed.items) >= 2 * rows  # rows hold several pairs
    assert packed.tokens == padded.tokens + (len(packed.ends) if whole else 0)  # whole: each piece's last id too
    return packed, padded


def assert_packed_as_padded(model, pairs, tok, whole: bool, pair_values, loss_of, apart: float):
    """pair_values(model, batch) -> (chosen, rejected) of each pair; loss_of(chosen, rejected) -> a loss. On the
    packed batch and on the same pairs padded: the same values within 1e-5 (chosen and rejected at least `apart`
    apart, so that a swap or a shift between pairs would show) and the same gradients of the loss."""
    results = []
    for batch in packed_and_padded(pairs, tok, whole):
        model.zero_grad()
        chosen, rejected = pair_values(model, batch)
        loss_of(chosen, rejected).backward()
        results.append(((chosen.detach(), rejected.detach()), [p.grad.clone() for p in model.parameters()]))
    ((chosen, rejected), packed_grads), ((expected_chosen, expected_rejected), padded_grads) = results
    torch.testing.assert_close(chosen, expected_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, expected_rejected, rtol=1e-5, atol=1e-5)
    assert (chosen - rejected).abs().min() > apart
    assert_gradients_close(packed_grads, padded_grads)


def assert_gradients_close(grads, expected):
    """Each tensor within float32 rounding of sums over many tokens added in another order (rows of 128 against rows
    of 64): 1e-4 of its largest element. In float64 the two agree to 1e-14; a token seeing another sequence's
    moves them by percents."""
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("length_norm", [False, True])
@pytest.mark.parametrize("flash", [False, True])
def test_packed_pairs_have_the_padded_pairs_logprobs_and_gradients(pairs, tok, flash, length_norm):
    """float32: each pair's chosen and rejected log-prob within 1e-5, the gradients of a loss weighing every one
    differently within rounding; chosen and rejected apart (a swap or a shift between pairs would show)."""
    model = tiny(vocab_size=tok.vocab_size, max_seq_len=CONTEXT, flash=flash)
    assert_packed_as_padded(model, pairs, tok, False, lambda model, batch: pair_logprobs(model, batch, length_norm),
                            lambda c, r: (torch.linspace(-1.0, 1.0, len(c)) * (c - 2 * r)).sum(), apart=1e-3)


@pytest.mark.parametrize("flash", [False, True])
def test_packed_pairs_get_the_padded_pairs_rewards_and_gradients(pairs, tok, flash):
    """The reward model reads each whole sequence's last token, packed or padded: the same rewards, the same
    Bradley-Terry gradients."""
    model = RewardModel(tiny(vocab_size=tok.vocab_size, max_seq_len=CONTEXT, flash=flash))
    torch.nn.init.normal_(model.score_head.weight, generator=torch.Generator().manual_seed(0))  # a zero head says 0
    assert_packed_as_padded(model, pairs, tok, True, batch_scores, lambda c, r: bradley_terry_loss(c, r)[0],
                            apart=1e-4)


def test_a_pair_longer_than_the_context_is_refused(pairs):
    with pytest.raises(DataError, match="a pair's sequence of \\d+ positions exceeds max_seq_len=12"):
        PackedDPOData(pairs, 12)


def test_packed_dpo_starts_at_ln2_and_a_precomputed_reference_gives_the_live_trajectory(tiny_sft, demo_dir, tmp_path):
    dpo(tiny_sft, demo_dir, tmp_path / "live", "--pack=True", "--batch_size=4", "--max_steps=6", "--eval_interval=3")
    dpo(tiny_sft, demo_dir, tmp_path / "pre", "--pack=True", "--batch_size=4", "--max_steps=6", "--eval_interval=3",
        "--precompute_ref=True")
    live, pre = read_metrics(tmp_path / "live"), read_metrics(tmp_path / "pre")
    assert live[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and 0 < live[0]["pad_frac"] < 0.5
    assert len(live) == len(pre)
    for a, b in zip(live, pre):
        for k in ("loss", "reward_margin", "chosen_reward", "rejected_reward", "val_loss", "val_reward_margin"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-5), (a["step"], k)


def test_packed_dpo_resumes_exactly(tiny_sft, demo_dir, tmp_path):
    def run(out_dir, *flags):
        dpo(tiny_sft, demo_dir, out_dir, "--pack=True", "--batch_size=4", "--max_steps=6", "--save_interval=3",
            "--eval_interval=3", *flags)

    assert_resumes_exactly(run, tmp_path / "full", tmp_path / "resumed", saved=3, last=6)


def test_packed_reward_training_resumes_exactly(tiny_sft, demo_dir, tmp_path):
    def run(out_dir, *flags):
        reward(tiny_sft, f"{demo_dir}/dpo.jsonl", out_dir, "--pack=True", "--batch_size=4", "--max_steps=6",
               "--save_interval=3", "--eval_interval=3", *flags)

    assert_resumes_exactly(run, tmp_path / "full", tmp_path / "resumed", saved=3, last=6)
