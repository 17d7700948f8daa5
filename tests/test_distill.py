"""
Distillation: the loss is the formula (KL by hand, zero for equal logits); alpha = 0 is exactly SFT's
cross-entropy training; a teacher of another tokenizer or vocabulary is a one-line error; a run resumes exactly.
"""

import pytest
import torch
import torch.nn.functional as F

import train_distill
import train_sft
from checkpoint import load_checkpoint
from conftest import TINY_CONTEXT, TINY_RUN, assert_resumes_exactly, final_weights, read_metrics, train_losses
from errors import ConfigError
from train_distill import distill_loss

STUDENT = ["--dim=16", "--n_layers=2", "--n_heads=2", "--n_kv_heads=1", "--max_seq_len=64"]  # half the tiny width


def test_the_kl_term_by_hand_and_zero_for_equal_logits():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), 3 * torch.randn(2, 5, 11, generator=g)
    ce, mask = torch.rand(2, 5, generator=g), torch.tensor([[1.0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    loss, kl, ce_sum = distill_loss(student, teacher, ce, mask, alpha=0.3, temperature=2.0)
    by_hand = F.kl_div(F.log_softmax(student / 2, -1), F.log_softmax(teacher / 2, -1), log_target=True,
                       reduction="none").sum(-1)  # sum_v p_t (log p_t - log p_s), per token
    assert kl.item() == pytest.approx((by_hand * mask).sum().item(), rel=1e-6) and kl > 0
    assert ce_sum.item() == pytest.approx((ce * mask).sum().item())
    assert loss.item() == pytest.approx(0.3 * 4 * kl.item() + 0.7 * ce_sum.item(), rel=1e-6)
    _, kl_same, _ = distill_loss(teacher, teacher.clone(), ce, mask, alpha=0.3, temperature=2.0)
    assert kl_same.item() == 0.0


def sft_flags(demo_dir, out_dir):
    return [f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out_dir}", *TINY_RUN, "--batch_size=8", "--lr=5e-3",
            "--min_lr=5e-4", "--warmup_steps=2", "--weight_decay=0.1", "--val_fraction=0.05", "--max_steps=6",
            "--eval_interval=6", "--dropout=0.1"]


@pytest.mark.parametrize("pack", [False, True])
def test_alpha_zero_is_exactly_sft_cross_entropy_training(tiny_pretrained, demo_dir, tiny_sft, tmp_path, pack):
    train_sft.main([f"--init_from={tiny_pretrained}", *sft_flags(demo_dir, tmp_path / "sft"),
                    f"--max_seq_len={TINY_CONTEXT}", "--warmup_ratio=None", f"--pack={pack}"])
    train_distill.main([f"--init_from={tiny_pretrained}", *sft_flags(demo_dir, tmp_path / "distill"),
                        f"--teacher={tiny_sft}", "--data_kind=sft", "--alpha=0", f"--pack={pack}"])
    sft, distilled = train_losses(tmp_path / "sft"), train_losses(tmp_path / "distill")
    assert sft.keys() == distilled.keys() == set(range(1, 7)) and sft == distilled  # bit-identical
    a, b = final_weights(tmp_path / "sft", 6), final_weights(tmp_path / "distill", 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(r["kl"] > 0 for r in read_metrics(tmp_path / "distill") if "kl" in r)  # computed, weighted 0


def distill(demo_dir, out_dir, teacher, *flags):
    train_distill.main([f"--teacher={teacher}", f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out_dir}",
                        *STUDENT, *TINY_RUN, "--batch_size=8", "--lr=3e-3", "--warmup_steps=2", "--val_fraction=0.2",
                        *flags])


def test_a_teacher_of_another_tokenizer_or_vocabulary_is_an_error(tiny_pretrained, demo_dir, tmp_path):
    state = load_checkpoint(str(tiny_pretrained))
    state["config"]["tokenizer_path"] = "vocab/nanomind"  # nanomind's own tokenizer: 6400 ids too, other ones
    torch.save(state, tmp_path / "nanomind_teacher.pt")
    with pytest.raises(ConfigError, match=r"nanomind_teacher\.pt was trained with the tokenizer vocab/nanomind"):
        distill(demo_dir, tmp_path / "a", tmp_path / "nanomind_teacher.pt", "--max_steps=1")
    with pytest.raises(ConfigError, match="has vocab_size 6400, the student 8000"):
        distill(demo_dir, tmp_path / "b", tiny_pretrained, "--max_steps=1", "--vocab_size=8000")


def test_distillation_resumes_exactly_and_learns_from_the_teacher(tiny_pretrained, demo_dir, tmp_path):
    full = tmp_path / "full"
    flags = ["--max_steps=8", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=4", "--dropout=0.1"]
    assert_resumes_exactly(lambda out, *more: distill(demo_dir, out, tiny_pretrained, *flags, *more), full,
                           tmp_path / "resumed", saved=4, last=8)
    val = [r["val_kl"] for r in read_metrics(full) if "val_kl" in r]
    assert val[0] > val[1] > val[2]  # the student moves towards the teacher (steps 0, 4, 8)
