"""Training memory: the batch-size finder's answer trains within its budget and twice it does not, a leak is warned
about and a normal run is not, running out of memory is one error line with the checkpoints intact."""
import json
import os
import subprocess
import sys

import pytest
import torch

import memory
from checkpoint import load_checkpoint
from conftest import REPO, TINY_MODEL, TINY_RUN
from errors import ConfigError

# a model whose step memory is mostly activations (the head's logits over 6,400 ids at 256 positions), so that the
# batch size moves the peak well above the noise of a CPU's resident memory
WIDE = ["--dim=64", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", "--max_seq_len=256"]
BUDGET_GB = 0.75


def peak_gb(out_dir) -> float:
    """A run's peak resident memory in GiB: the largest mem_gb its metrics.jsonl logged (VmHWM, in GB)."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return max(r["mem_gb"] for r in rows if "mem_gb" in r) * 1e9 / 2**30


def test_the_batch_size_found_trains_within_its_budget_and_twice_the_largest_does_not(demo_dir, tmp_path):
    found = subprocess.run([sys.executable, "diagnose.py", "batch_size", *WIDE, "--batch_size=48", "--accum_steps=1",
                            "--device=cpu", f"--max_memory_gb={BUDGET_GB}"], cwd=REPO, capture_output=True, text=True,
                           timeout=1200)  # a fresh process per size tried: minutes on a loaded machine
    assert found.returncode == 0, found.stderr[-2000:]
    lines = found.stdout.strip().splitlines()
    largest = int(lines[-2].split("largest that fits: ")[1].split(";")[0])
    flags = dict(f[2:].split("=") for f in lines[-1].split())
    batch_size, accum_steps = int(flags["batch_size"]), int(flags["accum_steps"])
    assert batch_size * accum_steps == 48 and 1 <= batch_size <= largest < 48
    peaks = {}
    for rows in sorted({batch_size, largest, 2 * largest}):
        out = tmp_path / f"b{rows}"
        ran = subprocess.run([sys.executable, "train_pretrain.py", f"--data_path={demo_dir}/pretrain.jsonl",
                              f"--out_dir={out}", *TINY_RUN, *WIDE, f"--batch_size={rows}", "--max_steps=3",
                              "--eval_steps=1", "--eval_interval=3"], cwd=REPO, capture_output=True, text=True,
                             timeout=1200)
        assert ran.returncode == 0, ran.stderr[-2000:]
        peaks[rows] = peak_gb(out)
    assert peaks[batch_size] < BUDGET_GB and peaks[largest] < BUDGET_GB, (lines, peaks)
    assert peaks[2 * largest] > BUDGET_GB, (lines, peaks)


@pytest.mark.parametrize("limit, peaks, expected, tried", [
    (64, {}, 22, [1, 2, 4, 8, 16, 32, 24, 20, 22, 23]),  # doubles, then bisects 16 .. 32
    (12, {}, 12, [1, 2, 4, 8, 12]),  # the global batch fits: no larger size is tried
    (64, {4: None}, 3, [1, 2, 4, 3]),  # out of memory is not fitting
])
def test_the_finder_doubles_then_bisects_to_the_largest_size_within_the_margin(limit, peaks, expected, tried,
                                                                              monkeypatch):
    budget = 1000
    linear = lambda size: 100 + 35 * size  # noqa: E731 -- 22 rows take 870 bytes, 23 take 905 > 0.9 x 1000
    calls = []

    def step_peak(model_cfg, size, run, optimizer, seed):
        calls.append(size)
        return peaks.get(size, linear(size))

    monkeypatch.setattr(memory, "step_peak", step_peak)
    cfg = type("Cfg", (), {"batch_size": limit, "accum_steps": 1, "optimizer": "adamw", "seed": 0})
    assert memory.find_batch_size(None, cfg, None, budget, report=lambda line: None) == expected
    assert calls == tried


def test_a_model_that_fits_no_batch_is_a_config_error(monkeypatch):
    monkeypatch.setattr(memory, "step_peak", lambda *args: None)
    cfg = type("Cfg", (), {"batch_size": 8, "accum_steps": 1, "optimizer": "adamw", "seed": 0})
    with pytest.raises(ConfigError, match="not even batch_size=1 fits"):
        memory.find_batch_size(None, cfg, None, 1000, report=lambda line: None)


@pytest.mark.parametrize("fits, global_batch, expected", [(14, 48, (12, 4)), (14, 64, (8, 8)), (64, 64, (64, 1)),
                                                          (100, 64, (64, 1)), (5, 7, (1, 7)), (1, 12, (1, 12))])
def test_the_global_batch_is_kept_with_the_largest_micro_batch_that_fits(fits, global_batch, expected):
    assert memory.split_global_batch(fits, global_batch) == expected


# --- a leak ---------------------------------------------------------------------------------------

# train_pretrain.py with every forward's outputs kept in a list when LEAK: each step's graph (logits and all) stays
# alive, as a loss summed without .detach() keeps it. In a process of its own, as a run is: a long-lived process
# (pytest's) has freed heap resident from earlier work, which a leak fills before the resident memory grows
CHILD = """
import os, resource, sys
import torch
import model, train_pretrain
from errors import cli
from memory import proc_status
kept, forward = [], model.Transformer.forward
if os.environ["LEAK"] == "1":
    model.Transformer.forward = lambda self, *a, **k: kept.append(forward(self, *a, **k)) or kept[-1]
torch.ones(256, 256) @ torch.ones(256, 256)  # the thread pool exists before the limit
if os.environ.get("LIMIT_MB"):
    limit = proc_status("VmSize") + int(os.environ["LIMIT_MB"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.argv = ["train_pretrain.py", *sys.argv[1:]]
cli(train_pretrain.main)
"""


def run_child(demo_dir, out_dir, *flags, **env):
    return subprocess.run([sys.executable, "-c", CHILD, f"--data_path={demo_dir}/pretrain.jsonl",
                           f"--out_dir={out_dir}", *TINY_MODEL, *TINY_RUN, "--max_seq_len=16", "--batch_size=4",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **env})


@pytest.mark.parametrize("leak", [True, False])
def test_memory_that_grows_at_every_log_row_is_warned_about_once_and_a_normal_run_is_not(leak, demo_dir, tmp_path):
    ran = run_child(demo_dir, tmp_path, "--max_steps=60", "--eval_interval=1000", LEAK=str(int(leak)))
    assert ran.returncode == 0, ran.stderr[-2000:]
    warnings = [line for line in ran.stdout.splitlines() if line.startswith("warning: memory in use grew")]
    assert len(warnings) == (1 if leak else 0), ran.stdout[-3000:]
    if leak:
        assert "MiB per 100 steps" in warnings[0] and ".detach()" in warnings[0]


# --- out of memory -----------------------------------------------------------------------------------

def test_running_out_of_memory_is_one_error_line_naming_step_batch_and_memory_and_checkpoints_survive(demo_dir,
                                                                                                     tmp_path):
    """A run that leaks under an address-space limit runs out of memory for real, after it saved checkpoints."""
    ran = run_child(demo_dir, tmp_path, "--max_steps=100000", "--save_interval=5", "--eval_interval=100000",
                    LEAK="1", LIMIT_MB="300")
    assert ran.returncode == 2, ran.stderr[-3000:]
    *_, line = ran.stderr.strip().splitlines()  # after the data's summary line
    assert sum(x.startswith("error:") for x in ran.stderr.splitlines()) == 1 and "Traceback" not in ran.stderr
    assert line.startswith("error: out of memory on cpu at step ") and "batch 4 x 16" in line, line
    assert "GiB in use" in line and "diagnose.py batch_size" in line and "grad_checkpoint=True" in line, line
    step = int(line.split(" at step ")[1].split()[0])
    saved = sorted(p for p in os.listdir(tmp_path) if p.startswith("step_"))
    assert saved and saved[-1] == f"step_{(step - 1) // 5 * 5:07d}.pt", (saved, line)
    state = load_checkpoint(str(tmp_path / saved[-1]))
    assert state["step"] == (step - 1) // 5 * 5 and all(torch.isfinite(v).all() for v in state["model"].values())
