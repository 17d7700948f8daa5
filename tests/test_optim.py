"""optim.py: the learning-rate schedule (warmup, cosine, floor) and AdamW's parameter groups (weight decay on
matrices only, every parameter once)."""
import pytest

from conftest import tiny
from optim import configure_optimizer, get_lr


def test_get_lr_warmup_cosine_and_floor():
    kw = dict(lr=5e-4, min_lr=1e-5, warmup_steps=100, max_steps=1100)
    assert get_lr(0, **kw) == 0.0
    assert get_lr(50, **kw) == pytest.approx(2.5e-4)
    assert get_lr(100, **kw) == pytest.approx(5e-4)
    assert get_lr(600, **kw) == pytest.approx(2.55e-4)  # cosine midpoint: (lr + min_lr) / 2
    assert get_lr(1100, **kw) == pytest.approx(1e-5)
    assert get_lr(5000, **kw) == pytest.approx(1e-5)
    lrs = [get_lr(s, **kw) for s in range(100, 1101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay after warmup


def test_weight_decay_applies_to_matrices_only_and_covers_every_parameter_once():
    model = tiny()
    opt = configure_optimizer(model, weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    # the tied LM head / embedding matrix appears once
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps"])
def test_adamw_is_fused_wherever_torch_has_the_kernel_so_a_skipped_step_needs_no_host_sync(device_type):
    assert configure_optimizer(tiny(), 0.1, 1e-3, (0.9, 0.95), device_type).defaults["fused"]
