"""DPO: the loss and its gradient by hand, log-probabilities of the answer alone, ln 2 at step zero, a precomputed
reference equal to the live one and cached per dtype and attention path, reward accuracy that rises."""
import math

import numpy as np
import pytest
import torch

import train_dpo
from conftest import TINY_RUN, on_device, read_metrics
from data import pad_rows
from losses import sequence_logprobs
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer
from train_dpo import dpo_loss


def dpo(tiny_sft, demo_dir, out_dir, *flags):
    train_dpo.main([f"--init_from={tiny_sft}", f"--data_path={demo_dir}/dpo.jsonl", f"--out_dir={out_dir}", *TINY_RUN,
                    "--batch_size=8", "--lr=1e-3", "--warmup_steps=0", "--max_prompt_length=32",
                    "--max_completion_length=32", "--eval_steps=4", *flags])


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -0.5])
    rc, rr = torch.tensor([-1.5, -1.0]), torch.tensor([-2.0, -1.5])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # pair 0: 0.5 * ((-1 + 1.5) - (-3 + 2)) = 0.75 > 0; pair 1: 0.5 * ((-2 + 1) - (-0.5 + 1.5)) = -1.0 < 0
    expected = (-math.log(1 / (1 + math.exp(-0.75))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["reward_margin"].item() == pytest.approx((0.75 - 1.0) / 2)
    assert m["reward_acc"].item() == 0.5
    assert m["chosen_reward"].item() == pytest.approx((0.25 - 0.5) / 2)
    assert m["rejected_reward"].item() == pytest.approx((-0.5 + 0.5) / 2)


def test_the_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)  # beta * sigmoid(0)


def pair_batch(tok, prompt_ids, chosen_ids, rejected_ids):
    prompt = np.array(prompt_ids)
    rows = [(np.concatenate([prompt, a]), np.concatenate([np.zeros(len(prompt)), np.ones(len(a))]))
            for a in (np.array(chosen_ids), np.array(rejected_ids))]
    return pad_rows(rows, tok.pad_id)


def test_sequence_logprobs_exclude_the_prompt_and_normalise_by_the_answer_length(device):
    tok = load_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).to(device)
    X, Y, M = (t.to(device) for t in pair_batch(tok, [tok.bos_id, 10, 11, 12, 13], [20, 21, 22, tok.eos_id],
                                                [30, tok.eos_id]))
    summed = sequence_logprobs(model, X, Y, M, length_norm=False)
    logits, _ = model(X, Y)
    per_token = logits.log_softmax(-1).gather(-1, Y[..., None])[..., 0]  # log p of each target
    assert torch.allclose(summed, (per_token * M).sum(-1))
    answer_lengths = torch.tensor([4.0, 2.0], device=device)
    assert torch.allclose(sequence_logprobs(model, X, Y, M, length_norm=True), summed / answer_lengths)
    changed = Y.clone()
    changed[:, 1] = 99  # a target inside the prompt
    assert torch.equal(sequence_logprobs(model, X, changed, M, length_norm=False), summed)
    changed[0, 5] = 99  # the chosen answer's second token
    assert not torch.equal(sequence_logprobs(model, X, changed, M, length_norm=False)[0], summed[0])


@pytest.mark.parametrize("flash", [False, True])  # the SFT checkpoint was saved with flash=None (math path on a CPU)
def test_at_step_zero_the_loss_is_ln2_and_every_margin_is_zero(tiny_sft, demo_dir, tmp_path, flash, device):
    dpo(tiny_sft, demo_dir, tmp_path, *on_device(device, "--max_steps=1", "--lr=0", "--min_lr=0", f"--flash={flash}"))
    (row,) = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-6)
    if device == "cpu":
        assert row["reward_margin"] == 0.0 and row["chosen_reward"] == 0.0 and row["reward_acc"] == 0.0
    else:  # a GPU's kernels for a forward with and without autograd may round apart: margins of ~1e-7 either way
        assert abs(row["reward_margin"]) <= 1e-6 and abs(row["chosen_reward"]) <= 1e-6


def test_precomputed_and_on_the_fly_reference_give_the_same_trajectory(tiny_sft, demo_dir, tmp_path):
    dpo(tiny_sft, demo_dir, tmp_path / "live", "--max_steps=6", "--eval_interval=3")
    dpo(tiny_sft, demo_dir, tmp_path / "pre", "--max_steps=6", "--eval_interval=3", "--precompute_ref=True")
    live, pre = read_metrics(tmp_path / "live"), read_metrics(tmp_path / "pre")
    assert len(live) == len(pre)
    for a, b in zip(live, pre):
        # continuous metrics only: reward_acc counts margins > 0, and at step 1 every margin is 0 up to rounding
        for k in ("loss", "reward_margin", "chosen_reward", "rejected_reward", "val_loss", "val_reward_margin"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-5), (a["step"], k)
    assert list((demo_dir).glob("dpo.jsonl.ref-*.pt"))  # the cache beside the data


def test_the_reference_cache_is_kept_per_dtype_and_attention_path(tiny_sft, demo_dir, tmp_path):
    pairs = tmp_path / "dpo.jsonl"  # a copy: only these runs' caches lie beside it
    pairs.write_text(open(f"{demo_dir}/dpo.jsonl", encoding="utf-8").read(), encoding="utf-8")
    runs = [("float32", False), ("bfloat16", False), ("float32", False), ("float32", True)]  # run 2 reuses run 0's
    for i, (dtype, flash) in enumerate(runs):
        dpo(tiny_sft, demo_dir, tmp_path / f"run{i}", f"--data_path={pairs}", "--max_steps=1", "--precompute_ref=True",
            f"--dtype={dtype}", f"--flash={flash}")
    caches = sorted(tmp_path.glob("dpo.jsonl.ref-*.pt"), key=lambda c: c.stat().st_mtime_ns)  # runs 0, 1, 3
    assert len(caches) == 3
    math32, bf16, sdpa32 = (torch.load(c)["train"] for c in caches)  # the training pairs' (chosen, rejected) log-probs
    assert math32.shape == bf16.shape and not torch.equal(math32, bf16)  # bfloat16 log-probs are not float32 ones
    assert torch.allclose(math32, sdpa32, atol=1e-4)  # the same sums, rounded differently


def test_a_few_dpo_steps_raise_reward_accuracy_on_the_training_pairs(tiny_sft, demo_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"  # 32 training pairs, also used as the evaluation set
    pairs.write_text("".join(open(f"{demo_dir}/dpo.jsonl", encoding="utf-8").readlines()[:32]), encoding="utf-8")
    dpo(tiny_sft, demo_dir, tmp_path, f"--data_path={pairs}", f"--val_data_path={pairs}", "--max_steps=48",
        "--eval_interval=48", "--eval_steps=100", "--lr=3e-3")
    evals = [r for r in read_metrics(tmp_path) if "val_reward_acc" in r]
    assert evals[-1]["val_reward_acc"] >= 0.85 and evals[-1]["val_reward_margin"] > 0  # at step 0 every margin is 0
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] < math.log(2)
