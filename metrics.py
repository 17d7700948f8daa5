"""
What a run reports: tokens/s, MFU and the time split of its steps, the rows of metrics.jsonl with one short
console line each, the gradient norms per layer (plot.py's gradient flow), and an optional profile.
"""
import dataclasses
import json
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch

from errors import OutOfMemoryError
from fileio import append_line
from memory import MemoryWatch, is_out_of_memory, out_of_memory, peak_since_reset
from runtime import Run, all_reduce_mean, print0, synchronize


def peak_memory_gb(device: torch.device) -> float:
    """CUDA's peak allocated; on a CPU this process's peak resident set (memory.peak_since_reset). Where Linux's
    VmHWM is missing, getrusage's ru_maxrss, which keeps the peak of a process it was forked from across exec."""
    if (peak := peak_since_reset(device)) is not None:
        return peak / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9


def measure_peak_flops(device: torch.device, dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in dtype on device: the attainable peak MFU is measured against. The size
    doubles from 256 up to n while the next size's measurement would take under 2 s (float16 on most CPUs runs
    at a few GFLOP/s, and finding that out should take seconds, not minutes). Its random matrices come from a
    generator of its own: it draws a timing-dependent number of them, which must not shift training's RNG."""
    generator = torch.Generator(device).manual_seed(0)

    def rate(size: int, calls: int) -> float:
        a, b = (torch.randn(size, size, device=device, dtype=getattr(torch, dtype), generator=generator) for _ in "ab")
        a @ b  # warm-up: first-call allocations and kernel choice
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            a @ b
        synchronize(device)
        return 2 * size**3 * calls / (time.perf_counter() - t0)

    size = 256
    while size < n and 8 * (repeats + 1) * 2 * size**3 / rate(size, 1) < 2.0:
        size *= 2
    return rate(size, repeats)


class StepTimer:
    """Tokens/s, MFU and the data/forward/backward/optimizer split of the steps since the last read(). On CUDA
    the phases are timed with events, read at the next log step, so timing never waits for the GPU. It also watches
    the memory in use at each read (MemoryWatch) and turns running out of memory in a phase into one error line."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, run: Run, peak_flops: float, start_step: int, max_steps: int, phases: tuple = PHASES):
        """peak_flops: the device's, for MFU; 0: measured now (measure_peak_flops). phases: the step's parts
        (RL adds its rollouts and rewards)."""
        self.run, self.start_step, self.max_steps, self.phases = run, start_step, max_steps, phases
        self.peak_flops = peak_flops or measure_peak_flops(run.device, run.dtype)
        self.t_start = self.t_last = time.time()
        self.tokens = self.flops = 0  # this rank's, since the last read
        self.real = None  # the real tokens among them, where the batches count them
        self.last_read = start_step
        self.seconds = dict.fromkeys(phases, 0.0)
        self.events: list = []  # CUDA: (phase, start event, end event)
        self.step, self.shape = start_step + 1, None  # the step under way and its last batch's shape
        self.memory = MemoryWatch(run.device, start_step)

    def begin(self, step: int):
        """A step starts (its number as the log shows it: step + 1): an out-of-memory error names it."""
        self.step = step + 1

    @contextmanager
    def phase(self, name: str):
        """Time a part of the step."""
        with self.memory_errors(name):
            if self.run.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.seconds[name] += time.perf_counter() - t0

    @contextmanager
    def memory_errors(self, where: str):
        """The device running out of memory in here is one error line: the step, where, the batch, the memory."""
        try:
            yield
        except Exception as e:
            if isinstance(e, OutOfMemoryError) or not is_out_of_memory(e):
                raise
            raise out_of_memory(e, self.step, where, self.shape, self.run.device) from e

    def count(self, X: torch.Tensor, flops_per_token: float, real: int | None = None):
        """Once per micro-batch: the tokens it fed the model, how many of them are real (not padding; None: not
        counted, the log shows no padding figures), and the training FLOPs they took."""
        self.tokens += X.numel()
        self.real = None if real is None else (self.real or 0) + real
        self.flops += flops_per_token * X.numel()
        self.shape = tuple(X.shape)

    @contextmanager
    def paused(self):
        """Time spent here (evaluation, saving) is not training time."""
        t0 = time.time()
        with self.memory_errors("evaluation or saving"):
            yield
        self.t_last += time.time() - t0

    def read(self, step: int) -> dict[str, float]:
        """tokens_per_s (all ranks, padding included), mfu, mem_gb, frac_<phase>, elapsed_s, eta_s, and where the
        batches count them real_tokens (per step, all ranks) and pad_frac; then start a new interval.
        Call after a host sync (a .item()), so that the CUDA events have completed."""
        for name, start, end in self.events:
            self.seconds[name] += start.elapsed_time(end) / 1000
        now, busy = time.time(), sum(self.seconds.values()) or 1.0
        interval, elapsed = now - self.t_last, now - self.t_start
        row = {"tokens_per_s": self.tokens * self.run.world_size / interval,
               "mfu": self.flops / interval / self.peak_flops, "mem_gb": peak_memory_gb(self.run.device),
               **{f"frac_{p}": s / busy for p, s in self.seconds.items()}, "elapsed_s": elapsed,
               "eta_s": elapsed / (step - self.start_step) * (self.max_steps - step)}
        if self.real is not None:
            row |= {"real_tokens": self.real * self.run.world_size / max(step - self.last_read, 1),
                    "pad_frac": 1 - self.real / max(self.tokens, 1)}
        self.t_last, self.tokens, self.real, self.flops, self.last_read = now, 0, None, 0, step
        self.seconds, self.events = dict.fromkeys(self.phases, 0.0), []
        if warning := self.memory.sample(step):
            print0(warning)
        return row


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def console_line(row: dict, max_steps: int) -> str:
    """What a person watches, in their units, on one line; the full row goes to metrics.jsonl (skipped updates
    get a line of their own from NonFiniteGuard.report)."""
    parts = [f"step {row['step']}/{max_steps}"]
    if "loss" not in row:  # an evaluation row
        parts += [f"{k} {v:.4g}" for k, v in row.items() if k.startswith("val_") and "logp" not in k]
        return " | ".join(parts)
    parts += [f"loss {row['loss']:.4g}", f"lr {row['lr']:.1e}", f"grad {row['grad_norm']:.3g}"]
    if "reward_margin" in row:  # DPO's reward_acc, the reward model's pair_acc
        parts.append(f"acc {row.get('reward_acc', row.get('pair_acc')):.0%} margin {row['reward_margin']:.3g}")
    if "reward_mean" in row:  # RL's
        parts.append(f"reward {row['reward_mean']:.3g} ± {row['reward_std']:.2g} len {row['completion_len']:.3g}")
    if "value_loss" in row:  # PPO's critic: its loss, and how much of the returns' variance it explains
        parts.append(f"value loss {row['value_loss']:.3g} expl var {row['explained_var']:.2f}")
    tokens = row["tokens_per_s"]
    parts += [f"{tokens / 1e3:.1f}k tok/s" if tokens >= 1e3 else f"{tokens:.0f} tok/s", f"MFU {row['mfu']:.0%}"]
    if row.get("pad_frac", 0) >= 0.005:  # fine-tuning's padded batches: how much of that speed is padding
        parts.append(f"pad {row['pad_frac']:.0%}")
    return " | ".join(parts + [f"{clock(row['elapsed_s'])} / ETA {clock(row['eta_s'])}"])


def parse_row(line: str) -> dict | None:
    """A metrics.jsonl row; None for a blank line or one a crash cut short (the last line of a killed run)."""
    try:
        row = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (or of the one in a run directory) that describe the run as it went on: a
    restart row {"step": N, "restart": ...} drops the rows before it of steps the restarted run writes again (after
    N when it resumed at N; all of them when it started over at 0). Works while a run is still writing the file."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for row in filter(None, map(parse_row, f)):
            if "restart" in row:
                rows = [r for r in rows if r["step"] < row["step"] or r["step"] == row["step"] > 0]
            else:
                rows.append(row)
    return rows


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON row per log step and per evaluation, and a short line on the console.
    Rank 0 writes, and only ever appends: a run that resumes at step N (or starts over at 0) in a folder that has
    rows adds a restart row, and read_metrics drops the rows it supersedes."""

    def __init__(self, cfg, run: Run, start_step: int, max_steps: int):
        self.path, self.run, self.max_steps, self.wandb = os.path.join(cfg.out_dir, "metrics.jsonl"), run, max_steps, None
        if not run.master:
            return
        if os.path.exists(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"  # a crash or a full disk ended the last row midway: end it, parse_row skips it
            append_line(self.path, ("\n" if cut else "") + json.dumps({"step": start_step, "restart": "resumed" if
                                                                       start_step else "started over"}))
        if cfg.wandb:
            import wandb  # optional: only when asked for

            self.wandb = wandb.init(project="nanomind", name=os.path.basename(os.path.normpath(cfg.out_dir)),
                                    config=dataclasses.asdict(cfg))

    def grad_flow(self, step: int, model, interval: int):
        """Every `interval` steps (0: never) a row of per-layer gradient norms. Call after clipping."""
        if interval and step % interval == 0:
            self.write({"step": step, "layer_grad_norms": group_grad_norms(model)}, echo=False)

    def write(self, row: dict, echo: bool = True):
        if not self.run.master:
            return
        append_line(self.path, json.dumps(row))
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])
        if echo:
            print0(console_line(row, self.max_steps))


def experts_row(model, aux_loss: torch.Tensor, run: Run) -> dict:
    """A log row's aux_loss (the experts' load-balancing loss, mean over ranks) for a model with experts."""
    return {"aux_loss": all_reduce_mean(aux_loss, run).item()} if model.config.n_experts else {}


def group_grad_norms(model) -> dict[str, float]:
    """Gradient norm per top-level part: tok_embeddings, layers.0 .. layers.N-1, norm (the gradient flow)."""
    squares: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            parts = name.removeprefix("module.").removeprefix("_orig_mod.").split(".")
            group = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            squares[group] = squares.get(group, 0) + p.grad.float().pow(2).sum()
    return {k: v.sqrt().item() for k, v in squares.items()}


def start_profiler(cfg, run: Run):
    """With profile=True, on rank 0: torch.profiler over steps 3-5 (2 to settle), then a Chrome trace in out_dir
    and the top operators on the console. Call .step() after every optimizer step."""
    if not (cfg.profile and run.master):
        return None

    def trace_ready(profiler):
        path = os.path.join(cfg.out_dir, "trace.json")
        profiler.export_chrome_trace(path)
        print0(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print0(f"profile of 3 steps written to {path} (open it in chrome://tracing or ui.perfetto.dev)")

    profiler = torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
                                      on_trace_ready=trace_ready, record_shapes=True)
    profiler.start()
    return profiler
