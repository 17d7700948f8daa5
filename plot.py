"""
Training curves and a health verdict from out_dir/metrics.jsonl; works while a run is still writing the file.

    python plot.py out/pretrain                            # plots/training.png, the verdict printed
    python plot.py out/pretrain out/pretrain_lr1e-3 --out=plots/ --smooth=50   # runs overlaid

training.png: loss (train raw + smoothed, validation), lr, gradient norm, tokens/s, memory; DPO runs add reward
margin and accuracy, RL runs their rewards; runs that log frac_* add their step-time split. grad_flow.png: the latest per-layer gradient
norms of runs that log them (grad_log_interval). The verdict: rules of thumb for a sick run (NaN, a loss that does
not fall, overfitting, oscillation, exploding or vanishing gradients, a stuck DPO loss, RL groups that teach
nothing), each with likely causes and remedies. An RL loss is no progress measure: its rules watch the rewards.
"""
import math
import os
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from config import load_config, usage, words  # noqa: E402
from errors import ConfigError, cli  # noqa: E402
from metrics import read_metrics  # noqa: E402

PANEL_W, PANEL_H, DPI, COLUMNS = 5.0, 3.5, 100, 3  # training.png is COLUMNS panels wide, 100 px per inch


@dataclass
class Config:
    # --- I/O
    runs: list[str] = words("RUN...")  # run directories or metrics.jsonl files, overlaid
    out: str = "plots"  # directory for the PNGs
    # --- curves
    smooth: int = 20  # moving-average window, in log rows


def run_name(path: str) -> str:
    path = os.path.normpath(path)
    return os.path.basename(os.path.dirname(path) if path.endswith(".jsonl") else path)


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that hold key; values as float, NaN/Inf kept."""
    picked = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return np.array([s for s, _ in picked], dtype=int), np.array([v for _, v in picked], dtype=float)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over the last `window` rows, of their finite values (a NaN row does not poison its
    neighbours). The window is at most a tenth of the series: a short run smoothed over most of its length would
    lag far behind."""
    window = max(1, min(window, len(values) // 10))
    ok = np.isfinite(values)
    total = np.concatenate([[0.0], np.cumsum(np.where(ok, values, 0.0))])
    count = np.concatenate([[0], np.cumsum(ok)])
    hi = np.arange(1, len(values) + 1)
    lo = np.maximum(hi - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total[hi] - total[lo]) / (count[hi] - count[lo])


def is_dpo(rows: list[dict]) -> bool:
    return any("reward_margin" in r or "val_reward_margin" in r for r in rows)


def is_rl(rows: list[dict]) -> bool:
    return any("reward_mean" in r for r in rows)


# -----------------------------------------------------------------------------
# the verdict

@dataclass
class Verdict:
    name: str
    message: str
    causes_and_remedies: str


def verdicts(rows: list[dict], window: int = 20) -> list[Verdict]:
    """Every rule that fires on these rows; [] when the run looks healthy."""
    return loss_verdicts(rows, window) + gradient_verdicts(rows)


def loss_verdicts(rows: list[dict], window: int) -> list[Verdict]:
    """The rules on the losses: non-finite values, a loss that does not fall, overfitting, oscillation."""
    out = []
    steps, loss = series(rows, "loss")
    _, grad_norm = series(rows, "grad_norm")
    val_steps, val_loss = series(rows, "val_loss")
    skipped = max((r.get("skipped_steps", 0) for r in rows), default=0)
    bad = int((~np.isfinite(loss)).sum() + (~np.isfinite(grad_norm)).sum() + (~np.isfinite(val_loss)).sum())
    if bad or skipped:
        out.append(Verdict("non_finite", f"{bad} NaN/Inf values in loss or grad_norm, {skipped} optimizer steps skipped",
                           "likely: lr too high, bad data (NaN/Inf), float16 overflow (loss scaling), a division by "
                           "zero; try: lower lr, gradient clipping, check the data, bfloat16 or float32"))
    finite = loss[np.isfinite(loss)]
    smoothed = smooth(loss, window)
    dpo, rl = is_dpo(rows), is_rl(rows)
    # a DPO loss starts at ln 2 and falls little; the ln 2 rule below watches it instead; an RL loss need not fall
    if not dpo and not rl and len(finite) >= 10 and smoothed[-1] > 0.9 * finite[0]:
        out.append(Verdict("loss_not_falling", f"smoothed train loss {smoothed[-1]:.3f} > 0.9 x first {finite[0]:.3f}",
                           "likely: lr too small, or so large it diverged; broken data; bad initialisation; "
                           "try: lr between 1e-5 and 1e-3 (diagnose.py lr_find), check the grad norm and the data "
                           "(diagnose.py data, overfit)"))
    if len(val_loss) and np.isfinite(val_loss[-1]) and len(finite):
        near = int(np.argmin(np.abs(steps - val_steps[-1])))  # the train row closest to the latest evaluation
        train_then = smoothed[near]
        if val_loss[-1] - train_then > 0.3 * train_then:
            out.append(Verdict("overfitting", f"val loss {val_loss[-1]:.3f} at step {val_steps[-1]} exceeds the "
                               f"train loss {train_then:.3f} by more than 30%",
                               "likely: model too large for the data, too few examples, too many epochs; try: "
                               "dropout, weight decay, more data, early stopping, a smaller model"))
    last = finite[-100:]
    if len(last) >= 10 and not rl:
        # step-to-step noise around the trend: a loss falling fast is not an oscillation, so std/mean is taken
        # of the differences, not of the losses (std(diff)/sqrt(2) is the std of the noise itself)
        volatility = np.std(np.diff(last)) / math.sqrt(2) / abs(np.mean(last))
        if volatility > 0.1:
            out.append(Verdict("oscillation", f"train loss noise {volatility:.2f} x its mean over the last "
                               f"{len(last)} rows (> 0.1)",
                               "likely: lr too high, batch too small, exploding gradients; try: lower lr, larger "
                               "batch (accum_steps), gradient clipping, (longer) warmup"))
    return out


def gradient_verdicts(rows: list[dict]) -> list[Verdict]:
    """The rules on the gradients and on what they move: exploding, vanishing, DPO stuck at ln 2, RL without signal."""
    out = []
    _, loss = series(rows, "loss")
    _, grad_norm = series(rows, "grad_norm")
    finite = loss[np.isfinite(loss)]
    dpo, rl = is_dpo(rows), is_rl(rows)
    recent = grad_norm[np.isfinite(grad_norm)][-100:]
    mean_norm = f"mean grad norm {np.mean(recent):.3g} over the last {len(recent)} rows" if len(recent) else ""
    if len(recent) and np.mean(recent) > 100:
        out.append(Verdict("grad_explosion", f"{mean_norm} (> 100)",
                           "try: gradient clipping (max_grad_norm), lower lr, check the data for outliers, "
                           "normalisation layers"))
    if len(recent) and np.mean(recent) < 1e-7:
        out.append(Verdict("grad_vanishing", f"{mean_norm} (< 1e-7)",
                           "likely: saturated activations, broken residual path, a detached loss; try: check the "
                           "loss reaches every layer (grad_flow), residual connections, normalisation, fewer layers"))
    if dpo and len(finite) > 10 and np.all(np.abs(finite[-10:] - math.log(2)) < 0.01):
        out.append(Verdict("dpo_stuck", f"the DPO loss has stayed within 0.01 of ln 2 = {math.log(2):.3f} for "
                           "the last 10 rows: the policy does not move away from the reference",
                           "likely: lr or beta too small, chosen == rejected, the reference is the policy itself "
                           "(shared weights); try: larger lr or beta, check the pairs differ"))
    _, zero_adv = series(rows, "frac_zero_adv")
    if rl and len(zero_adv) >= 10 and np.all(zero_adv[-10:] == 1):
        out.append(Verdict("rl_no_signal", "in the last 10 rows every group's completions got equal rewards: the "
                           "advantages, and so the gradients, are all 0",
                           "likely: the task is too hard (all rewards 0) or already solved (all 1), the "
                           "completions are alike (temperature too low), max_new_tokens cuts the answers; try: easier "
                           "prompts or more SFT, a higher temperature, larger group_size, a graded reward"))
    return out


def print_verdict(name: str, rows: list[dict], window: int = 20):
    found = verdicts(rows, window)
    if not any("loss" in r for r in rows):
        print(f"{name}: no training rows yet")
    elif not found:
        print(f"{name}: healthy, no rule fired")
    for v in found:
        print(f"{name}: {v.name}: {v.message}\n    {v.causes_and_remedies}")


# -----------------------------------------------------------------------------
# the pictures

def plot_runs(runs: dict[str, list[dict]], out_dir: str, window: int = 20) -> list[str]:
    """Write training.png (and grad_flow.png if any run logs it) to out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    colors = {name: f"C{i % 10}" for i, name in enumerate(runs)}
    panels = [("loss", "loss", False), ("lr", "learning rate", False), ("grad_norm", "gradient norm", True),
              ("tokens_per_s", "tokens/s", False), ("mem_gb", "peak memory (GB)", False)]
    if any("val_bpb" in r for rows in runs.values() for r in rows):
        panels.append(("bpb", "validation bits per byte", False))  # across tokenizers, unlike the loss
    if any(is_dpo(rows) for rows in runs.values()):
        panels += [("reward_margin", "reward margin (chosen - rejected)", False), ("reward_acc", "reward accuracy", False)]
    if any(is_rl(rows) for rows in runs.values()):
        panels += [("reward", "reward (train: rollouts' mean; val: greedy)", False),
                   ("frac_zero_adv", "groups with equal rewards", False)]
    split_runs = [name for name, rows in runs.items() if any("frac_forward" in r for r in rows)]
    panels += [(f"split:{name}", f"step time split, {name}", False) for name in split_runs]
    n_rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(n_rows, COLUMNS, figsize=(COLUMNS * PANEL_W, n_rows * PANEL_H), dpi=DPI, squeeze=False)
    for ax, (key, title, log_y) in zip(axes.flat, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key.startswith("split:"):
            time_split(ax, runs[key[len("split:"):]])
            continue
        for name, rows in runs.items():
            steps, values = series(rows, "reward_mean" if key == "reward" else key)  # RL's train reward
            if key == "loss" and len(values):
                ax.plot(steps, values, color=colors[name], alpha=0.25, lw=0.8)  # raw: faint
                ax.plot(steps, smooth(values, window), color=colors[name], label=f"{name} train")
            elif len(values):
                ax.plot(steps, values, color=colors[name], label=name)
            val_steps, val_values = series(rows, "val_" + key)  # val_loss, val_bpb, val_reward_margin, ...
            if len(val_values):
                ax.plot(val_steps, val_values, "o--", color=colors[name], ms=4, label=f"{name} val")
        if log_y and ax.has_data():
            ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    found = {name: verdicts(rows, window) for name, rows in runs.items()}
    fig.suptitle("   ".join(f"{name}: {', '.join(v.name for v in f) or 'healthy'}" for name, f in found.items()))
    fig.tight_layout()
    paths = [os.path.join(out_dir, "training.png")]
    fig.savefig(paths[0])
    plt.close(fig)
    flows = {name: [r for r in rows if isinstance(r.get("layer_grad_norms"), dict)] for name, rows in runs.items()}
    flows = {name: rows[-1] for name, rows in flows.items() if rows}
    if flows:
        paths.append(os.path.join(out_dir, "grad_flow.png"))
        grad_flow(flows, colors, paths[-1])
    return paths


def time_split(ax, rows: list[dict]):
    """Stacked fractions of each log interval spent on each phase the run logs (data, forward, backward, optimizer;
    RL: rollout, reward, forward, backward, optimizer)."""
    phases = [k[len("frac_"):] for k in next(r for r in rows if "frac_forward" in r) if k.startswith("frac_")
              and k != "frac_zero_adv"]
    rows = [r for r in rows if all(f"frac_{p}" in r for p in phases)]
    steps = [r["step"] for r in rows]
    ax.stackplot(steps, [[r[f"frac_{p}"] for r in rows] for p in phases], labels=phases, alpha=0.8)
    ax.set_ylim(0, 1.2)  # room for the legend above the stack
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1])
    ax.set_ylabel("fraction of step time")
    ax.legend(fontsize=7, loc="upper center", ncols=4)


def grad_flow(flows: dict[str, dict], colors: dict[str, str], path: str):
    """Bars of each run's latest per-layer gradient norms, inputs on the left, log scale."""
    layers = list(dict.fromkeys(k for row in flows.values() for k in row["layer_grad_norms"]))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(layers) * len(flows)), 4), dpi=DPI)
    width = 0.8 / len(flows)
    for i, (name, row) in enumerate(flows.items()):
        norms = [row["layer_grad_norms"].get(k, np.nan) for k in layers]
        ax.bar(np.arange(len(layers)) + i * width, norms, width, color=colors[name], label=f"{name}, step {row['step']}")
    ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2, layers, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("gradient norm")
    ax.set_title("gradient flow (a layer far below the others barely learns)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]):
    (args,) = load_config(argv, Config)
    if not args.runs:
        raise ConfigError(f"{usage([Config])}: name at least one run")
    runs = {}
    for path in args.runs:  # runs are named by their directory; the full path tells two "pretrain"s apart
        runs[run_name(path) if run_name(path) not in runs else os.path.normpath(path)] = read_metrics(path)
    for path in plot_runs(runs, args.out, args.smooth):
        print(f"wrote {path}")
    for name, rows in runs.items():
        print_verdict(name, rows, args.smooth)


if __name__ == "__main__":
    cli(main)
