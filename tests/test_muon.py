"""optim.py's Muon (optimizer=muon): the Newton-Schulz orthogonalisation, one step against a reference written
from the formulas, the AdamW half against torch's AdamW, which tensors get Muon, and Muon through the training
scripts: accumulation and ranks, exact resume, float16 and bfloat16, LoRA, the config and resume errors."""
import math

import numpy as np
import pytest
import torch

import train_pretrain
from checkpoint import load_checkpoint
from conftest import (TINY_MODEL, TINY_RUN, assert_resumes_exactly, bound, final_weights, lora_sft, on_device, pretrain,
                      pretrain_ddp_matches_one_process, pretrain_short, tiny, train_losses)
from errors import CheckpointError, ConfigError
from lora import add_lora
from model import ModelConfig, Transformer
from optim import MuonAdamW, configure_optimizer, newton_schulz, set_lr, uses_muon
from reward_model import RewardModel

MUON = ["--optimizer=muon", "--muon_lr=0.02"]


def with_singular_values(rows: int, cols: int, values: torch.Tensor, seed: int):
    """(U diag(values) V^T, U, V) for random orthonormal U (rows x k) and V (cols x k), k = len(values)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    k = len(values)
    return u[:, :k] @ torch.diag(values.double()) @ v[:, :k].T, u[:, :k], v[:, :k]


@pytest.mark.parametrize("rows, cols", [(64, 64), (48, 160), (160, 48)])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_singular_values_near_1(rows, cols):
    """Singular values spread over a factor of 100 all come out in [0.6, 1.25] (nanochat's coefficients trade
    exact 1s for speed), with the input's singular vectors: the output is U S' V^T."""
    k = min(rows, cols)
    G, U, V = with_singular_values(rows, cols, torch.logspace(0, -2, k), seed=rows + cols)
    X = newton_schulz(G.float()).double()
    core = U.T @ X @ V  # diagonal for U S' V^T
    s = torch.diagonal(core)
    assert (core - torch.diag(s)).abs().max() < 1e-4
    assert 0.6 <= s.min() and s.max() <= 1.25, (s.min(), s.max())
    assert torch.linalg.matrix_rank(X[:k, :k] if rows == cols else X) == k
    # the scale of G does not matter: only its direction
    assert torch.allclose(newton_schulz(1000 * G.float()), X.float(), atol=1e-5)


def quintic_on_singular_values(G: np.ndarray, steps: int = 5) -> np.ndarray:
    """The reference: G = U S V^T by SVD, each s / ||G||_F through p(x) = a x + b x^3 + c x^5 `steps` times."""
    a, b, c = 3.4445, -4.7750, 2.0315
    u, s, vt = np.linalg.svd(G, full_matrices=False)
    x = s / (np.linalg.norm(G) + 1e-7)
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return u @ np.diag(x) @ vt


def test_two_muon_steps_equal_a_reference_written_from_the_formulas(device):
    """Nesterov momentum, the quintic on the singular values, lr x sqrt(max(1, rows / cols)): a tall matrix."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((12, 5)).astype(np.float32)
    grads = [rng.standard_normal((12, 5)).astype(np.float32) for _ in range(2)]
    lr, momentum = 0.05, 0.9
    p = torch.nn.Parameter(torch.tensor(w0, device=device))
    opt = MuonAdamW([{"params": [p], "kind": "muon", "momentum": momentum}], lr=lr, betas=(0.9, 0.95))
    w, buf = w0.astype(np.float64), np.zeros_like(w0, dtype=np.float64)
    for g in grads:
        p.grad = torch.tensor(g, device=device)
        opt.step()
        buf = momentum * buf + (1 - momentum) * g
        nesterov = (1 - momentum) * g + momentum * buf
        w = w - lr * math.sqrt(12 / 5) * quintic_on_singular_values(nesterov)
        np.testing.assert_allclose(p.detach().cpu().numpy(), w, atol=bound(2e-5, device))
        np.testing.assert_allclose(opt.state[p]["momentum_buffer"].cpu().numpy(), buf, atol=bound(1e-6, device))


def test_the_adamw_half_equals_torchs_adamw():
    torch.manual_seed(0)
    ours, theirs = tiny(), tiny()
    theirs.load_state_dict(ours.state_dict())
    opt = configure_optimizer(ours, 0.1, 1e-2, (0.9, 0.95), "cpu", optimizer="muon")
    ref = torch.optim.AdamW([{"params": [p for p in theirs.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in theirs.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), foreach=False)
    adamw = {n for n, p in ours.named_parameters() if not uses_muon(n, p)}
    for _ in range(3):  # the same gradients for both (a backward would differ after Muon's first step)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step(), ref.step()
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert adamw == {"tok_embeddings.weight", "norm.weight"} | {f"layers.{i}.{n}.weight" for i in range(2)
                                                                 for n in ("attention_norm", "ffn_norm")}
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in adamw)
    assert not any(torch.allclose(a[n], b[n], atol=1e-3) for n in a.keys() - adamw)  # Muon's took other steps


def muon_names(model) -> set[str]:
    opt = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="muon")
    muon, *adamw = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(trainable)  # each once
    assert muon["kind"] == "muon" and all(g["kind"] == "adamw" for g in adamw)
    return {names[id(p)] for p in muon["params"]}


def test_muon_trains_the_blocks_matrices_and_adamw_the_embedding_head_and_gains():
    cfg = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    blocks = {f"layers.{i}.attention.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    ffn = {f"layers.{i}.feed_forward.{w}.weight" for i in range(2) for w in ("w1", "w2", "w3")}
    assert muon_names(Transformer(ModelConfig(**cfg))) == blocks | ffn  # tied head = the embedding: AdamW
    untied = Transformer(ModelConfig(**cfg, tie_embeddings=False, qk_norm=True))
    assert muon_names(untied) == blocks | ffn  # output.weight and q_norm/k_norm stay with AdamW
    moe = Transformer(ModelConfig(**cfg, n_experts=2))
    experts = {f"layers.{i}.feed_forward.experts.{e}.{w}.weight" for i in range(2) for e in range(2)
               for w in ("w1", "w2", "w3")}
    assert muon_names(moe) == blocks | experts | {f"layers.{i}.feed_forward.gate.weight" for i in range(2)}
    assert muon_names(RewardModel(Transformer(ModelConfig(**cfg)))) == {f"body.{n}" for n in blocks | ffn}
    lora = add_lora(Transformer(ModelConfig(**cfg)), rank=4, alpha=8, dropout=0.0, targets=("wq", "w2"))
    assert muon_names(lora) == {f"layers.{i}.{m}.lora_{ab}" for i in range(2) for m in ("attention.wq",
                                                                                          "feed_forward.w2")
                                for ab in "ab"}


def test_set_lr_runs_muon_on_the_same_schedule_at_its_own_peak():
    opt = configure_optimizer(tiny(), 0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="muon", muon_lr=0.02)
    set_lr(opt, 5e-4)  # half way down from the peak
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 5e-4, 5e-4])


def test_accumulation_and_two_ranks_equal_one_big_batch(demo_dir, tmp_path):
    """DDP averages the gradients before the step: each rank orthogonalises the same matrix."""
    ckpt = pretrain_ddp_matches_one_process(demo_dir, tmp_path, *MUON, "--max_grad_norm=0")
    assert ckpt["optimizer"]["param_groups"][0]["kind"] == "muon"
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, *TINY_RUN, *MUON, "--lr=3e-3",
                         "--warmup_steps=3", "--max_steps=5", "--accum_steps=1", "--batch_size=8",
                         "--max_grad_norm=0", f"--out_dir={tmp_path / 'no_accum'}"])
    a, b = final_weights(tmp_path / "single", 5), final_weights(tmp_path / "no_accum", 5)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


def test_a_muon_run_resumes_exactly_with_its_momentum(demo_dir, tmp_path):
    flags = [*MUON, "--max_steps=10", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=5",
             "--dropout=0.1"]
    assert_resumes_exactly(lambda out, *more: pretrain(demo_dir, out, *flags, *more), tmp_path / "full",
                           tmp_path / "resumed", saved=4, last=10)
    state = load_checkpoint(str(tmp_path / "full" / "step_0000004.pt"))["optimizer"]["state"]
    assert sum("momentum_buffer" in s for s in state.values()) == 14  # 7 matrices in each of 2 blocks


def test_a_resume_with_another_optimizer_is_refused(demo_dir, tmp_path):
    pretrain_short(demo_dir, tmp_path, "--max_steps=2")
    with pytest.raises(CheckpointError, match="trained with optimizer adamw, this run asks for muon"):
        pretrain_short(demo_dir, tmp_path, "--max_steps=4", *MUON, "--resume=True")


@pytest.mark.parametrize("flags, message", [(["--optimizer=sgd"], "'optimizer' must be adamw or muon, got 'sgd'"),
                                            ([*MUON, "--muon_momentum=1"], "muon_momentum 1.0"),
                                            ([*MUON, "--lr=0"], "needs lr > 0")])
def test_bad_optimizer_keys_are_one_line_errors(demo_dir, tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        pretrain_short(demo_dir, tmp_path, "--max_steps=2", *flags)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_muon_trains_under_autocast_and_the_grad_scaler(demo_dir, tmp_path, dtype, device):
    pretrain(demo_dir, tmp_path, *on_device(device, *MUON, f"--dtype={dtype}", "--max_steps=30", "--eval_interval=30"))
    losses = train_losses(tmp_path)
    assert all(math.isfinite(v) for v in losses.values())
    assert np.mean([losses[s] for s in range(26, 31)]) < np.mean([losses[s] for s in range(1, 6)]) - 0.5
    scaler = load_checkpoint(str(tmp_path / "step_0000030.pt"))["scaler"]
    assert (scaler.get("scale", 0) > 0) == (dtype == "float16")  # float16's GradScaler was on


def test_lora_adapters_train_with_muon_and_the_base_stays(tiny_pretrained, demo_dir, tmp_path):
    lora_sft(tiny_pretrained, demo_dir, tmp_path, *MUON, "--max_steps=20", "--eval_interval=20")
    ckpt = load_checkpoint(str(tmp_path / "step_0000020.pt"))
    assert ckpt["model"] and all(".lora_" in k for k in ckpt["model"])  # only the adapters are saved
    kinds = [g["kind"] for g in ckpt["optimizer"]["param_groups"]]
    assert kinds == ["muon"]  # every adapter is a matrix in a block: no AdamW group is left
    assert any(v.abs().max() > 0 for k, v in ckpt["model"].items() if k.endswith("lora_b"))  # B left its zeros
    losses = train_losses(tmp_path)
    assert np.mean([losses[s] for s in range(16, 21)]) < np.mean([losses[s] for s in range(1, 6)])
