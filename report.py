"""
eval.py's report beside a checkpoint: report.json (every figure) and report.md (for a person). Each sub-command
adds its section to those already there for the same checkpoint; both files also hold the checkpoint's config, a
training summary from its metrics.jsonl and links to plot.py's pictures.
"""
import glob
import json
import os

from fileio import atomic_write
from metrics import read_metrics


def training_summary(state: dict, metrics_path: str) -> dict:
    """Steps, data seen, wall time and validation losses of the run that wrote the checkpoint."""
    cfg, stage, step = state["config"], state["stage"], state["step"]
    ranks = len(state.get("rng", [None]))  # one RNG state per rank
    per_step = cfg["batch_size"] * cfg["accum_steps"] * ranks
    seen = ({"tokens": step * per_step * state["model_config"]["max_seq_len"]} if stage == "pretrain"
            else {{"dpo": "pairs", "reward": "pairs", "grpo": "prompts"}.get(stage, "conversations"): step * per_step})
    summary = {"stage": stage, "checkpoint_step": step, "ranks": ranks} | seen
    if not os.path.exists(metrics_path):
        return summary | {"metrics": f"no {metrics_path}"}
    rows = read_metrics(metrics_path)
    val = [r for r in rows if "val_loss" in r]
    wall, last = 0.0, 0.0  # elapsed_s restarts at a resume: add up the stretches
    for r in rows:
        if "elapsed_s" in r:
            wall += r["elapsed_s"] - last if r["elapsed_s"] >= last else r["elapsed_s"]
            last = r["elapsed_s"]
    summary |= {"steps": max((r["step"] for r in rows), default=0), "wall_time_s": round(wall, 1)}
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        summary |= {"final_val_loss": val[-1]["val_loss"], "final_val_step": val[-1]["step"],
                    "best_val_loss": best["val_loss"], "best_val_step": best["step"]}
        if "val_bpb" in val[-1]:
            summary["final_val_bpb"] = val[-1]["val_bpb"]
    return summary


def write_report(cfg, state: dict, key: str, section: dict, renderers: dict) -> str:
    """Add `section` under `key` to out/report.json (keeping other sections of the same checkpoint), render
    report.md from it (renderers: {sub-command: its section's render}); both written atomically. Returns report.md's
    path."""
    run_dir = os.path.dirname(os.path.abspath(cfg.ckpt))
    out = cfg.out or run_dir
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    report = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    if report.get("checkpoint") != os.path.abspath(cfg.ckpt):
        report = {"checkpoint": os.path.abspath(cfg.ckpt), "sections": {}}
    plots_dir = cfg.plots or run_dir
    report |= {"stage": state["stage"], "step": state["step"], "model_config": state["model_config"],
               "config": state["config"], "training": training_summary(state, os.path.join(run_dir, "metrics.jsonl")),
               "plots": [os.path.relpath(p, out) for p in sorted(glob.glob(os.path.join(plots_dir, "*.png")))]}
    report["sections"][key] = section
    for where, text in [(path, json.dumps(report, indent=1, ensure_ascii=False) + "\n"),
                        (os.path.join(out, "report.md"), render(report, renderers))]:
        with atomic_write(where, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"report: {os.path.join(out, 'report.md')}")
    return os.path.join(out, "report.md")


def render(report: dict, renderers: dict) -> str:
    """report.md: the checkpoint, its training summary and plots, each section by renderers[its sub-command], the
    config."""
    t = report["training"]
    seen = next(f"{t[k]:,} {k}" for k in ("tokens", "conversations", "pairs", "prompts") if k in t)
    here = os.path.relpath(report["checkpoint"])
    md = [f"# {report['checkpoint'] if here.startswith('..') else here}", "",
          f"{report['stage']} checkpoint at step {report['step']} ({seen} seen, {t['ranks']} rank(s))"
          + (f" of a {t['steps']}-step run of {t['wall_time_s'] / 60:.1f} min." if "steps" in t else f"; {t['metrics']}."),
          ""]
    if "final_val_loss" in t:
        bpb = f", val_bpb {t['final_val_bpb']:.4f}" if "final_val_bpb" in t else ""
        md += [f"The run's validation loss: final {t['final_val_loss']:.4f} (step {t['final_val_step']}{bpb}), best "
               f"{t['best_val_loss']:.4f} (step {t['best_val_step']}).", ""]
    md += [f"![{os.path.basename(p)}]({p})" for p in report["plots"]] + [""] * bool(report["plots"])
    for key, s in report["sections"].items():
        md += renderers[key.split("/")[0]](s) + [""]
    md += ["<details><summary>config</summary>", "", "```json",
           json.dumps({k: report[k] for k in ("config", "model_config")}, indent=1, ensure_ascii=False),
           "```", "</details>", ""]
    return "\n".join(md)
