"""Mixed precision on each device: bfloat16 autocast trains like float32, and only float16 keeps a GradScaler state
(float16 against float32 with its GradScaler on a GPU: tests/test_devices.py)."""
import torch

from conftest import on_device, pretrain_short, train_losses


def test_bfloat16_autocast_trains_like_float32(demo_dir, tmp_path, device):
    flags = on_device(device, "--lr=1e-2", "--max_steps=30", "--eval_interval=30", "--save_interval=30")
    pretrain_short(demo_dir, tmp_path / "fp32", *flags)
    pretrain_short(demo_dir, tmp_path / "bf16", *flags, "--dtype=bfloat16")
    fp32, bf16 = train_losses(tmp_path / "fp32"), train_losses(tmp_path / "bf16")
    assert set(bf16) == set(fp32) == set(range(1, 31))
    gaps = [abs(bf16[s] - fp32[s]) / fp32[s] for s in fp32]
    # measured on this setup: at most 0.06% apart over the 30 steps; 0.5% leaves room for other CPUs' kernels (and
    # for a GPU's: its float32 run multiplies in TF32)
    assert max(gaps) < 5e-3
    assert max(gaps) > 0  # bfloat16 rounding shows: autocast did run in bfloat16
    assert bf16[30] < 0.8 * bf16[1] and fp32[30] < 0.8 * fp32[1]  # both learn (8.78 -> ~4.5)
    assert torch.load(tmp_path / "bf16" / "step_0000030.pt", weights_only=False)["scaler"] == {}  # float16 only
