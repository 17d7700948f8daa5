"""plot.py: each rule fires alone on a run made to trigger it and none fires on healthy runs; PNGs of the expected
size, a run still being written, smoothing that ignores NaN and does not lag."""
import json
import math

import matplotlib.image
import numpy as np
import pytest

import plot


def lm_rows(n=200, seed=0, eval_every=50, sft=False, split=True):
    """A healthy language-model run: loss falling from ~9 to ~3 with 1% noise, validation close to train.
    split: log the step-time fractions (frac_*)."""
    rng = np.random.default_rng(seed)
    rows = [{"step": 0, "val_loss": 9.0, "val_ppl": math.exp(9.0)}] if sft else []
    for i in range(1, n + 1):
        loss = (3 + 6 * math.exp(-i / 40)) * (1 + 0.01 * rng.standard_normal())
        rows.append({"step": i, "loss": loss, "ppl": math.exp(loss), "lr": 1e-3, "grad_norm": 0.8 + 0.1 * rng.random(),
                     "tokens_per_s": 5000.0, "mfu": 0.01, "mem_gb": 0.5, "elapsed_s": i * 0.1, "eta_s": (n - i) * 0.1,
                     "skipped_steps": 0})
        if split:
            rows[-1] |= {"frac_data": 0.05, "frac_forward": 0.3, "frac_backward": 0.55, "frac_optimizer": 0.1}
        if i % eval_every == 0:
            rows.append({"step": i, "val_loss": loss * 1.05, "val_ppl": math.exp(loss * 1.05)})
    rows.append({"step": n, "layer_grad_norms": {"tok_embeddings": 0.5, "layers.0": 0.3, "layers.1": 0.2, "norm": 0.01}})
    return rows


def dpo_rows(n=100, stuck=False, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(1, n + 1):
        loss = math.log(2) + 0.002 * rng.standard_normal() if stuck else math.log(2) - 0.2 * i / n
        margin = 0.0 if stuck else 0.5 * i / n
        rows.append({"step": i, "loss": loss, "lr": 1e-6, "grad_norm": 1.0, "reward_margin": margin,
                     "reward_acc": 0.5 + 0.4 * i / n, "chosen_reward": margin / 2, "rejected_reward": -margin / 2,
                     "chosen_logp": -3.0, "rejected_logp": -3.5, "tokens_per_s": 3000.0, "mfu": 0.01, "mem_gb": 0.4,
                     "elapsed_s": i * 0.1, "eta_s": 1.0})
        if i % 25 == 0:
            rows.append({"step": i, "val_loss": loss, "val_reward_margin": margin, "val_reward_acc": 0.6,
                         "val_chosen_reward": 0.1, "val_rejected_reward": -0.1})
    return rows


def rl_rows(n=60, no_signal=False, seed=0):
    """A GRPO run: a noisy policy loss around 0 that need not fall, rewards rising (no_signal: every group alike)."""
    rng = np.random.default_rng(seed)
    rows = [{"step": 0, "val_reward": 0.1, "val_pass1": 0.1}]
    for i in range(1, n + 1):
        reward = 0.0 if no_signal else min(0.9, 0.1 + 0.02 * i)
        rows.append({"step": i, "loss": 0.05 * rng.standard_normal(), "lr": 1e-4, "grad_norm": 1.0,
                     "reward_mean": reward, "reward_std": 0.3, "clip_frac": 0.0, "completion_len": 10.0,
                     "frac_zero_adv": 1.0 if no_signal else 0.5, "skipped_steps": 0, "tokens_per_s": 3000.0,
                     "mfu": 0.01, "mem_gb": 0.4, "frac_rollout": 0.7, "frac_reward": 0.01, "frac_forward": 0.1,
                     "frac_backward": 0.17, "frac_optimizer": 0.02, "elapsed_s": i * 0.5, "eta_s": 1.0})
        if i % 10 == 0:
            rows.append({"step": i, "val_reward": reward, "val_pass1": reward})
    return rows


def write(path, rows, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)  # json.dumps writes NaN as NaN
    return path


def set_key(rows, key, fn):
    for i, r in enumerate(r for r in rows if key in r):
        r[key] = fn(i, r[key])
    return rows


TRIGGERS = {
    "loss_not_falling": lambda: set_key(lm_rows(), "loss", lambda i, v: 5.0 + 0.02 * math.sin(i)),
    "overfitting": lambda: set_key(lm_rows(), "val_loss", lambda i, v: v * 1.5),
    "oscillation": lambda: set_key(lm_rows(), "loss", lambda i, v: v * (1 + 0.3 * (-1) ** i)),
    "non_finite": lambda: set_key(lm_rows(), "loss", lambda i, v: float("nan") if i == 120 else v),
    "grad_explosion": lambda: set_key(lm_rows(), "grad_norm", lambda i, v: 500.0),
    "grad_vanishing": lambda: set_key(lm_rows(), "grad_norm", lambda i, v: 1e-9),
    "dpo_stuck": lambda: dpo_rows(stuck=True),
    "rl_no_signal": lambda: rl_rows(no_signal=True),
}


@pytest.mark.parametrize("rule", sorted(TRIGGERS))
def test_each_rule_fires_alone_on_a_run_made_to_trigger_it(rule, tmp_path):
    rows = plot.read_metrics(str(write(tmp_path / "run" / "metrics.jsonl", TRIGGERS[rule]())))
    found = plot.verdicts(rows)
    assert [v.name for v in found] == [rule]
    assert found[0].message and found[0].causes_and_remedies


def test_skipped_steps_count_as_non_finite():
    rows = set_key(lm_rows(), "skipped_steps", lambda i, v: 1 if i >= 100 else 0)
    assert [v.name for v in plot.verdicts(rows)] == ["non_finite"]


# "short": 30 rows of a fast fall; std/mean of the raw losses is 0.12, but a falling loss is no oscillation
# "rl": a policy loss jumping around 0 is no oscillation, nor a loss that does not fall
@pytest.mark.parametrize("rows", [lm_rows(), lm_rows(sft=True), lm_rows(n=30), dpo_rows(), rl_rows()],
                         ids=["pretrain", "sft", "short", "dpo", "rl"])
def test_healthy_runs_fire_no_rule(rows, tmp_path, capsys):
    path = write(tmp_path / "run" / "metrics.jsonl", rows)
    rows = plot.read_metrics(str(path))
    assert plot.verdicts(rows) == []
    plot.print_verdict("run", rows)
    assert capsys.readouterr().out == "run: healthy, no rule fired\n"


def png_size(path) -> tuple[int, int]:
    image = matplotlib.image.imread(path)
    assert image.std() > 0.01  # not a blank canvas
    return image.shape[:2]


@pytest.mark.parametrize("kind, rows, n_panels", [
    ("pretrain", lm_rows(), 6),  # loss, lr, grad norm, tokens/s, memory, time split
    ("sft", lm_rows(sft=True, split=False), 5),  # no frac_* fields: no time split
    ("dpo", dpo_rows(), 7),  # + reward margin, reward accuracy
    ("rl", rl_rows(), 8),  # loss, lr, grad norm, tokens/s, memory, rewards, equal-reward groups, time split
])
def test_plot_writes_pngs_of_the_expected_size(kind, rows, n_panels, tmp_path, capsys):
    run = write(tmp_path / kind / "metrics.jsonl", rows)
    out = tmp_path / "plots"
    plot.main([str(run.parent), f"--out={out}", "--smooth=10"])
    n_rows = math.ceil(n_panels / plot.COLUMNS)
    assert png_size(out / "training.png") == (n_rows * plot.PANEL_H * plot.DPI, plot.COLUMNS * plot.PANEL_W * plot.DPI)
    assert (out / "grad_flow.png").exists() == (kind not in ("dpo", "rl"))  # only the LM runs log layer_grad_norms
    if kind not in ("dpo", "rl"):
        assert png_size(out / "grad_flow.png")[0] == 4 * plot.DPI
    assert f"{kind}: healthy" in capsys.readouterr().out


def test_partial_last_line_and_nan_rows_while_a_run_is_writing(tmp_path, capsys):
    rows = set_key(lm_rows(n=60), "loss", lambda i, v: float("nan") if i == 30 else v)
    run = write(tmp_path / "live" / "metrics.jsonl", rows, tail='{"step": 61, "loss": 3.1, "gra')
    assert len(plot.read_metrics(str(run))) == len(rows)  # the half-written line is left out
    new = write(tmp_path / "new" / "metrics.jsonl", [])  # a run that has not logged yet
    plot.main([str(run), str(new.parent), f"--out={tmp_path / 'plots'}"])  # a file and a dir, overlaid
    assert png_size(tmp_path / "plots" / "training.png")[1] == plot.COLUMNS * plot.PANEL_W * plot.DPI
    out = capsys.readouterr().out
    assert "live: non_finite" in out and "new: no training rows yet" in out


def test_smooth_ignores_nan_and_does_not_lag_short_runs():
    values = np.array([4.0, np.nan, 2.0, 2.0] + [1.0] * 36)
    smoothed = plot.smooth(values, window=20)  # 40 rows: the window shrinks to 4
    assert np.isfinite(smoothed).all()
    assert smoothed[2] == pytest.approx(3.0) and smoothed[-1] == pytest.approx(1.0)
