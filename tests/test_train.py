import os
import subprocess
import sys

import pytest
import torch

import train_pretrain
from checkpoint import load_checkpoint, load_model_state
from config import PretrainConfig
from config import load_config
from conftest import TINY_MODEL, TINY_RUN, final_weights, read_metrics, train_losses
from errors import CheckpointError, ConfigError, NonFiniteError
from model import ModelConfig, Transformer
from optim import get_lr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pretrain(demo_dir, out_dir, *flags):
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out_dir}", *TINY_MODEL, *TINY_RUN,
                         "--batch_size=8", "--lr=3e-3", "--warmup_steps=3", *flags])


# --- schedule -------------------------------------------------------------------------------------

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


# --- configuration --------------------------------------------------------------------------------

def test_config_file_then_flags_and_int_for_float(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("dim = 128\nlr = 1\n# a comment\nn_layers = 3\n")
    cfg, model_cfg = load_config([str(path), "--n_layers=5", "--lr=3e-4", "--resume=true", "--out_dir=out/x"],
                                 PretrainConfig, ModelConfig)
    assert (model_cfg.dim, model_cfg.n_layers, cfg.lr, cfg.resume, cfg.out_dir) == (128, 5, 3e-4, True, "out/x")
    (cfg,) = load_config(["--lr=1"], PretrainConfig)
    assert cfg.lr == 1.0 and type(cfg.lr) is float


@pytest.mark.parametrize("argv, key", [
    (["--learning_rate=3e-4"], "learning_rate"),
    (["--batch_size=3.5"], "batch_size"),
    (["--batch_size=True"], "batch_size"),
    (["--resume=maybe"], "resume"),
    (["--max_steps=ten"], "max_steps"),
])
def test_unknown_keys_and_wrong_types_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(argv, PretrainConfig, ModelConfig)


def test_a_wrong_key_in_a_config_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("dim = 64\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"'n_layer' \(from .*bad\.py\)"):
        load_config([str(path)], PretrainConfig, ModelConfig)


# --- the training loop ----------------------------------------------------------------------------

def test_loss_falls_and_the_schedule_steps_once_per_optimizer_step(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=40", "--accum_steps=2", "--batch_size=4", "--warmup_ratio=0.25",
             "--eval_interval=20")
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for r in rows:  # the row of step s reports the lr its update used: get_lr(s - 1), warmup 10 = 0.25 * 40
        assert r["lr"] == pytest.approx(get_lr(r["step"] - 1, lr=3e-3, min_lr=1e-5, warmup_steps=10, max_steps=40))
    val = [r["val_loss"] for r in read_metrics(tmp_path) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    assert sum(r["loss"] for r in rows[-5:]) < 0.8 * sum(r["loss"] for r in rows[:5])


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(demo_dir, tmp_path):
    common = [f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, *TINY_RUN, "--lr=3e-3", "--warmup_steps=3",
              "--max_steps=5", "--accum_steps=2"]
    pretrain_args = ["--batch_size=4", f"--out_dir={tmp_path / 'single'}"]
    train_pretrain.main(common + pretrain_args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train_pretrain.py"), *common, "--batch_size=2", f"--out_dir={tmp_path / 'ddp'}"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert set(a) == set(b) and all(abs(a[s] - b[s]) <= 1e-5 for s in a)
    ckpt = load_checkpoint(str(tmp_path / "ddp" / "step_0000005.pt"))
    assert ckpt["rank_weight_diff"] == 0.0  # both ranks hold identical weights
    assert len(ckpt["rng"]) == 2
    single = final_weights(tmp_path / "single", 5)
    assert max((single[k] - ckpt["model"][k]).abs().max().item() for k in single) <= 1e-5


def test_a_fresh_run_refuses_an_out_dir_with_checkpoints(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=2")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        pretrain(demo_dir, tmp_path, "--max_steps=2")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_truncated_checkpoint_is_a_clear_error_and_the_previous_one_survives(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=6", "--save_interval=3", "--eval_interval=100")
    latest = tmp_path / "step_0000006.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step_0000006\.pt is not a readable checkpoint.*step_0000003\.pt"):
        pretrain(demo_dir, tmp_path, "--max_steps=6", "--resume=True")
    assert load_checkpoint(str(tmp_path / "step_0000003.pt"))["step"] == 3


def test_weights_of_another_shape_are_an_error_naming_the_keys():
    small = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    other = Transformer(ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=64, max_seq_len=16))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attention\.wq\.weight.*layers\.0\.attention\.wk\.weight"):
        load_model_state(small, other.state_dict(), "other.pt")


def poisoned_model(bad_steps: set[int]):
    """The real model, whose tok_embeddings gradient is NaN in the backward passes of bad_steps (1-based; one
    backward per step here): a non-finite step by construction, not by one CPU's rounding of a diverging run."""

    class Poisoned(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.backwards = 0
            self.tok_embeddings.weight.register_hook(self.poison)

        def poison(self, grad):
            self.backwards += 1
            return grad * float("nan") if self.backwards in bad_steps else grad

    return Poisoned


@pytest.mark.parametrize("flash", [True, False])
def test_non_finite_steps_are_skipped_named_and_then_stop_the_run(demo_dir, tmp_path, capsys, monkeypatch, flash):
    monkeypatch.setattr(train_pretrain, "Transformer", poisoned_model({3, 5, 6, 7}))
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row"):
        pretrain(demo_dir, tmp_path, "--max_steps=20", "--max_bad_steps=3", "--save_interval=1", "--keep_checkpoints=100",
                 f"--flash={flash}")
    out = capsys.readouterr().out
    assert "step 3: 1 update(s) skipped" in out and "step 5: 1 update(s) skipped" in out
    assert "first non-finite gradient in tok_embeddings.weight" in out
    # step 4 was good again: the count in a row starts over, and the run stops at step 7, the third in a row
    assert [r["skipped_steps"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 0, 1, 1, 2, 3]
    weights = {step: final_weights(tmp_path, step) for step in range(1, 7)}
    for before, after, changed in ((2, 3, False), (3, 4, True), (4, 5, False), (5, 6, False)):
        assert all(torch.equal(weights[before][k], weights[after][k]) for k in weights[before]) != changed
