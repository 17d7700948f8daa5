"""
The mechanics every train_*.py shares, written once: configuration, distributed setup, precision, the LR
schedule, the optimizer step (unscale, clip, skip non-finite), checkpoints, evaluation and the metrics log.
The training loop itself stays in each script.
"""
import ast
import ctypes
import dataclasses
import glob
import json
import math
import os
import random
import resource
import signal
import sys
import time
import types
import typing
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from model import ModelConfig, Transformer


# -----------------------------------------------------------------------------
# configuration: dataclass defaults <- config file <- --key=value flags

class ConfigError(ValueError):
    pass


def read_config_file(path: str) -> dict:
    """Run a Python config file (plain `key = value` lines) and return the names it sets."""
    namespace: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace)
    except (OSError, SyntaxError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def parse_flag_value(text: str):
    """--key=value: a Python literal when it is one (3e-4, 32, True, None), else the string itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def check_type(key: str, value, annotation, source: str):
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if type(value) in allowed:  # exact: a bool is not accepted as an int
        return value
    if type(value) is int and float in allowed:
        return float(value)
    names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"config key {key!r} (from {source}) must be {names}, got {value!r} ({type(value).__name__})")


def load_config(argv: list[str], *schemas):
    """Build one instance of each dataclass in schemas from `[config_file] [--key=value ...]`.
    Every key must belong to one of the schemas and match its field's type."""
    argv = list(argv or [])
    settings = []  # (key, value, source), applied in order: the file first, then the flags
    if argv and not argv[0].startswith("--"):
        path = argv.pop(0)
        settings += [(k, v, path) for k, v in read_config_file(path).items()]
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        settings.append((key, parse_flag_value(text), "command line"))
    fields = {f.name: (schema, f.type) for schema in schemas for f in dataclasses.fields(schema)}
    values: dict = {schema: {} for schema in schemas}
    for key, value, source in settings:
        if key not in fields:
            raise ConfigError(f"unknown config key {key!r} (from {source}); known keys: {', '.join(sorted(fields))}")
        schema, annotation = fields[key]
        values[schema][key] = check_type(key, value, annotation, source)
    return tuple(schema(**values[schema]) for schema in schemas)


# -----------------------------------------------------------------------------
# processes, devices and precision

def master_process() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def print0(*args, **kwargs):
    if master_process():
        print(*args, **kwargs, flush=True)


@dataclasses.dataclass
class Run:
    device: torch.device
    dtype: str  # float32 | bfloat16 | float16
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.dtype))

    @contextmanager
    def rank0_first(self):
        """Rank 0 runs the block first (e.g. builds a data cache), the other ranks then run it (and read it)."""
        if self.ddp and not self.master:
            dist.barrier()
        yield
        if self.ddp and self.master:
            dist.barrier()


def keep_freed_memory():
    """glibc serves allocations over 32 MB (a step's logits and their gradients, attention buffers) with fresh mmaps
    and unmaps them when freed, so every step faults its largest buffers in again, page by page: measured on
    configs/26m.py (batch 8, CPU), 80-170k page faults and 0.2-0.6 s of kernel time per step. Served from the heap
    and kept there for reuse, the 26m step is 12% (float32) to 55% (bfloat16) faster at the same peak resident set
    (bench.py), the demo 30% faster at +33-45% (1.07 -> 1.42-1.55 GB), flat over a run: memory the heap keeps."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): its allocator is left as it is
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    libc.mallopt(M_MMAP_MAX, 0)  # no mmap: every allocation from the heap
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and what is freed stays there for reuse (unless 2 GiB are free)


def setup(device: str, dtype: str, seed: int) -> Run:
    """Pick device and precision, join torchrun's process group if launched by it, and seed every RNG.
    Every rank seeds alike (the model starts identical everywhere); call seed_rank() after building it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"config key 'dtype' must be auto, float32, bfloat16 or float16, got {dtype!r}")
    run = Run(torch.device(device), dtype)
    if run.device.type == "cpu":
        keep_freed_memory()
    if "RANK" in os.environ:  # launched by torchrun: join the group or fail, never train unsynchronised
        run.rank, run.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        run.world_size = int(os.environ["WORLD_SIZE"])
        if run.device.type == "cuda":
            run.device = torch.device("cuda", run.local_rank)
            torch.cuda.set_device(run.device)
        cuda = run.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=run.device if cuda else None)
        if dist.get_world_size() != run.world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks, WORLD_SIZE says {run.world_size}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return run


def seed_rank(seed: int, run: Run):
    """After the model is built: a different random stream per rank (dropout), reproducible per rank."""
    torch.manual_seed(seed + run.rank)


def teardown(run: Run):
    if run.ddp and dist.is_initialized():
        dist.barrier()  # leave together: a rank that tears down while another still talks to it can abort (gloo)
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor, run: Run) -> torch.Tensor:
    if run.ddp:
        t = t.clone()
        dist.all_reduce(t)
        t /= run.world_size
    return t


# -----------------------------------------------------------------------------
# schedule and optimizer step

def get_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup from 0 to lr, cosine decay to min_lr at max_steps, min_lr after. step = optimizer steps taken."""
    if step < warmup_steps:
        return lr * step / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


class NonFiniteError(RuntimeError):
    pass


def group_grad_norms(model) -> dict[str, float]:
    """Gradient norm per top-level part: tok_embeddings, layers.0 .. layers.N-1, norm (the gradient flow)."""
    squares: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            parts = name.removeprefix("module.").removeprefix("_orig_mod.").split(".")
            group = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            squares[group] = squares.get(group, 0) + p.grad.float().pow(2).sum()
    return {k: v.sqrt().item() for k, v in squares.items()}


# -----------------------------------------------------------------------------
# checkpoints

class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(run: Run) -> list[dict]:
    """Every rank's RNG state, so that a resumed DDP run continues each rank's random stream."""
    if not run.ddp:
        return [rng_state()]
    states = [None] * run.world_size
    dist.all_gather_object(states, rng_state())
    return states


def rank_weight_diff(model, run: Run) -> float:
    """max |w - w on rank 0| over every weight and rank: 0.0 while the replicas are in sync."""
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def atomic_save(obj, path: str):
    """torch.save to a temp file, fsync, rename: a crash leaves the old file or the new one, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def load_checkpoint(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except Exception as e:  # truncated or garbled: torch raises several kinds
        others = sorted(set(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.pt"))) - {path})
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                              f"other checkpoints there: {others or 'none'}") from None


def load_model_state(model, state_dict: dict, source: str):
    """load_state_dict(strict=True), with an error that lists every missing, unexpected or reshaped key."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    reshaped = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
                for k, v in own.items() if k in state_dict and state_dict[k].shape != v.shape]
    if missing or unexpected or reshaped:
        raise CheckpointError(f"weights in {source} do not fit this model: missing {missing}, unexpected "
                              f"{unexpected}, other shape {reshaped}")
    model.load_state_dict(state_dict)


# -----------------------------------------------------------------------------
# signals: finish the current step, save, exit

def model_from_checkpoint(path: str, device="cpu", **overrides):
    """(Transformer with the checkpoint's architecture -- model_config updated by overrides such as flash or
    dropout -- and its weights, loaded strictly; the checkpoint itself)."""
    state = load_checkpoint(path)
    model = Transformer(ModelConfig(**{**state["model_config"], **overrides}))
    load_model_state(model, state["model"], path)
    return model.to(device), state


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop checks it between optimizer steps, saves and exits."""

    def __init__(self):
        self.received = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.received:  # a second Ctrl-C: the user means it
            raise KeyboardInterrupt
        self.received = True
        print(f"\nreceived signal {signum}: saving a checkpoint after this step, then exiting", file=sys.stderr, flush=True)

    def requested(self, run: Run) -> bool:
        """All ranks agree, so no rank leaves the loop while another waits in a collective."""
        if not run.ddp:
            return self.received
        flag = torch.tensor([float(self.received)], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# -----------------------------------------------------------------------------
# measurement, evaluation, logging

def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9


def measure_peak_flops(device: torch.device, dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in dtype on device: the attainable peak MFU is measured against. The size
    doubles from 256 up to n while the next size's measurement (8x the work per matmul) would take under 2 s:
    float16 on most CPUs runs at a few GFLOP/s, and finding that out should take seconds, not minutes."""

    def rate(size: int, calls: int) -> float:
        a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
        b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
        a @ b  # warm-up: first-call allocations and kernel choice
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 2 * size**3 * calls / (time.perf_counter() - t0)

    size = 256
    while size < n and 8 * (repeats + 1) * 2 * size**3 / rate(size, 1) < 2.0:
        size *= 2
    return rate(size, repeats)


@torch.no_grad()
def evaluate(loss_fn, loader, steps: int, run: Run) -> dict[str, float]:
    """Mean of loss_fn(X, Y, loss_mask, indices) -> {name: scalar tensor} over (up to) the first `steps` evaluation
    batches of every rank, reduced over ranks once at the end (ranks may hold one batch more or less)."""
    totals, n = None, 0
    for batch in loader.batches(steps):
        metrics = loss_fn(*batch)
        values = torch.stack([v.detach().float() for v in metrics.values()])
        totals = values if totals is None else totals + values
        n += 1
    summed = torch.cat([totals, torch.tensor([float(n)], device=totals.device)])
    if run.ddp:
        dist.all_reduce(summed)
    return {k: (v / summed[-1]).item() for k, v in zip(metrics, summed[:-1])}


def validation_loss(model, loader, steps: int, run: Run) -> float:
    """The language-model loss (masked mean cross-entropy) on the first `steps` validation batches."""
    model.eval()
    with run.autocast():
        loss = evaluate(lambda X, Y, M, _: {"loss": model(X, Y, M)[1]}, loader, steps, run)["loss"]
    model.train()
    return loss


def start(cfg, model_cfg, run: Run) -> str | None:
    """Print the final config, create out_dir, and return the checkpoint to resume from (None: a fresh run).
    A fresh run refuses an out_dir that holds checkpoints: nothing already written is overwritten."""
    print0(f"config: {dataclasses.asdict(cfg)}\nmodel: {dataclasses.asdict(model_cfg)}\n"
           f"device {run.device}, dtype {run.dtype}, {run.world_size} rank(s)")
    if run.device.type == "cpu" and run.dtype == "float16":
        print0("warning: most CPUs emulate float16 matmuls, far slower than float32: use bfloat16 or float32")
    os.makedirs(cfg.out_dir, exist_ok=True)
    latest = latest_checkpoint(cfg.out_dir)
    if latest and not cfg.resume:
        raise ConfigError(f"{cfg.out_dir} already holds checkpoints: pass --resume=True to continue, or another out_dir")
    return latest if cfg.resume else None


def latest_checkpoint(out_dir: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(out_dir, "step_*.pt")))
    return paths[-1] if paths else None


def wrap(model, cfg, run: Run):
    """The model the loop trains: compiled if asked, DDP-wrapped under torchrun. Keep the unwrapped one too."""
    if cfg.compile:
        model = torch.compile(model)
    if run.ddp:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


class Progress:
    """Everything around the optimizer step that every stage does alike: resume, the non-finite guard, phase
    timing, log lines and out_dir/metrics.jsonl rows (loss, ppl, lr, grad norm, tokens/s, MFU, memory, time
    split, ETA), gradient-flow and evaluation rows, profiling, and checkpoints: out_dir/step_0000123.pt for the
    last keep_checkpoints saves, out_dir/best.pt for the best validation loss."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, stage: str, cfg, model_cfg, run: Run, model, optimizer, scaler, loader, max_steps: int):
        self.stage, self.cfg, self.model_cfg, self.run, self.max_steps = stage, cfg, model_cfg, run, max_steps
        self.model, self.optimizer, self.scaler, self.loader = model, optimizer, scaler, loader
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.stop = StopSignal()
        self.peak_flops = cfg.peak_flops or measure_peak_flops(run.device, run.dtype)
        self.tokens = self.flops = 0  # this rank's, since the last log line
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        self.phase_events: list = []  # CUDA: (phase, start, end) events, read at the log line
        # non-finite steps, counted on the device (no sync); reported at log lines
        self.skipped = torch.zeros((), dtype=torch.long, device=run.device)
        self.bad_in_a_row = torch.zeros((), dtype=torch.long, device=run.device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=run.device)  # index into the parameters
        self.reported_skips = 0
        self.best_val_loss, self.stale_evals = float("inf"), 0
        self.profiler = None
        if cfg.profile and run.master:  # 2 steps to settle, then 3 recorded
            self.profiler = torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=3),
                                                   on_trace_ready=self._trace_ready, record_shapes=True)
            self.profiler.start()
        self.wandb = None

    def resume(self, path: str | None) -> int:
        """Load the checkpoint at path (if any) into model, optimizer, scaler, loader and the RNGs; open the
        metrics log (dropping rows past the checkpoint: they were written after it). Returns the step."""
        state = {"step": 0}
        if path:
            state = load_checkpoint(path)
            load_model_state(self.model, state["model"], path)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            self.loader.load_state_dict(state["loader"])
            set_rng_state(state["rng"][self.run.rank])
            self.skipped.fill_(state["skipped"])
            self.reported_skips = state["skipped"]
            self.best_val_loss, self.stale_evals = state["best_val_loss"], state["stale_evals"]
            print0(f"resumed from {path} at step {state['step']}")
        if self.run.master:
            kept = []
            if path and os.path.exists(self.metrics_path):
                with open(self.metrics_path, encoding="utf-8") as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= state["step"]]
            with open(f"{self.metrics_path}.tmp", "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(f"{self.metrics_path}.tmp", self.metrics_path)
            if self.cfg.wandb:
                import wandb  # optional: only when asked for

                self.wandb = wandb.init(project="nanomind", name=os.path.basename(os.path.normpath(self.cfg.out_dir)),
                                        config=dataclasses.asdict(self.cfg))
        self.t_start = self.t_log = time.time()
        self.start_step = state["step"]
        return state["step"]

    @contextmanager
    def time(self, phase: str):
        """Wall time of one phase of the step. CUDA runs asynchronously, so there events are recorded and read
        at the next log line instead of synchronising here."""
        if self.run.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.phase_events.append((phase, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.phase_s[phase] += time.perf_counter() - t0

    def count(self, X: torch.Tensor):
        """Call once per micro-batch: tokens (and FLOPs) processed, for tokens/s and MFU."""
        self.tokens += X.numel()
        self.flops += self.model.flops_per_token(X.size(1)) * X.numel()

    def skip_nonfinite(self, optimizer, scaler, loss: torch.Tensor, grad_norm: torch.Tensor):
        """Call before scaler.step(optimizer): if the loss or the gradient norm is NaN/Inf, this update is skipped
        on the device, without a host sync. Fused AdamW skips the whole update (moments and step count too) when
        optimizer.found_inf is 1 -- the mechanism GradScaler uses, and uses itself for float16. The skips, and the
        first parameter with a non-finite gradient, are reported (and max_bad_steps enforced) at the next log."""
        bad = ~torch.isfinite(loss + grad_norm)
        if not scaler.is_enabled():
            optimizer.found_inf = bad.float()
        self.skipped += bad
        self.bad_in_a_row = (self.bad_in_a_row + 1) * bad
        # every trainable parameter has a gradient here, so this indexes the trainable parameters in order
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        first = (~torch.stack(torch._foreach_norm(grads)).isfinite()).int().argmax()
        self.first_bad = torch.where(bad & (self.first_bad < 0), first, self.first_bad)

    def check_skips(self, step: int, loss: float, grad_norm: float):
        """At a log line: report the steps skipped since the last one; stop after max_bad_steps in a row."""
        skipped, in_a_row, first = int(self.skipped), int(self.bad_in_a_row), int(self.first_bad)
        if skipped > self.reported_skips:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            where = f"; first non-finite gradient in {names[first]}" if 0 <= first < len(names) else ""
            print0(f"step {step}: {skipped - self.reported_skips} update(s) skipped for a non-finite loss or gradient "
                   f"norm (now loss {loss}, grad norm {grad_norm}){where}; {in_a_row} in a row")
            self.reported_skips, self.first_bad = skipped, torch.full_like(self.first_bad, -1)
        if in_a_row >= self.cfg.max_bad_steps:
            raise NonFiniteError(f"{in_a_row} optimizer steps in a row had a non-finite loss or gradient: "
                                 f"lower lr, check the data, or use bfloat16 instead of float16")

    def grad_flow(self, step: int, model):
        """Every grad_log_interval steps (0: never), a row of per-layer gradient norms. Call after unscale_."""
        if self.cfg.grad_log_interval and step % self.cfg.grad_log_interval == 0:
            self.write({"step": step, "layer_grad_norms": group_grad_norms(model)}, echo=False)

    def perplexity(self, name: str, loss: float | None) -> dict:
        """{name: exp(loss)} for a language-model loss; nothing for DPO, whose loss is no cross-entropy."""
        return {} if loss is None or self.stage == "dpo" else {name: math.exp(min(loss, 700))}

    def write(self, row: dict, echo: bool = True):
        if not self.run.master:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])
        if echo:
            print0(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    def log(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, **extra):
        """Call after every optimizer step; every log_interval steps (and the last) it writes a row. loss is the
        mean over the accumulation window and the ranks. The .item()s here are the loop's only host syncs."""
        if self.profiler is not None:
            self.profiler.step()
        if step % self.cfg.log_interval and step != self.max_steps:
            return
        loss_value, grad_norm_value = loss.item(), grad_norm.item()
        self.check_skips(step, loss_value, grad_norm_value)
        for phase, start, end in self.phase_events:  # synchronised by .item() above
            self.phase_s[phase] += start.elapsed_time(end) / 1000
        now, busy = time.time(), sum(self.phase_s.values()) or 1.0
        seconds = now - self.t_log
        row = {"step": step, "loss": loss_value, **self.perplexity("ppl", loss_value), "lr": lr,
               "grad_norm": grad_norm_value, **{k: v.item() if torch.is_tensor(v) else v for k, v in extra.items()},
               "tokens_per_s": self.tokens * self.run.world_size / seconds, "mfu": self.flops / seconds / self.peak_flops,
               "mem_gb": peak_memory_gb(self.run.device), "skipped_steps": self.reported_skips,
               **{f"frac_{p}": s / busy for p, s in self.phase_s.items()},
               "elapsed_s": now - self.t_start,
               "eta_s": (now - self.t_start) / (step - self.start_step) * (self.max_steps - step)}
        self.write(row)
        self.t_log, self.tokens, self.flops = now, 0, 0
        self.phase_s, self.phase_events = dict.fromkeys(self.PHASES, 0.0), []

    def _trace_ready(self, profiler):
        path = os.path.join(self.cfg.out_dir, "trace.json")
        profiler.export_chrome_trace(path)
        print0(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print0(f"profile of 3 steps written to {path} (open it in chrome://tracing or ui.perfetto.dev)")
        self.profiler = None

    def stop_requested(self, step: int) -> bool:
        """A SIGINT/SIGTERM arrived; checked at log steps only, where all ranks agree without an extra sync."""
        if (step % self.cfg.log_interval == 0 or step == self.max_steps) and self.stop.requested(self.run):
            print0(f"stopped at step {step}; continue with --resume=True")
            return True
        return False

    def evaluate(self, step: int, metrics_fn) -> dict[str, float]:
        """Run metrics_fn() -> {name: value} and log it as an evaluation row (with val_ppl beside val_loss).
        Its time does not count against the training tokens/s."""
        t0 = time.time()
        metrics = metrics_fn()
        self.write({"step": step, **metrics, **self.perplexity("val_ppl", metrics.get("val_loss"))})
        self.t_log += time.time() - t0
        return metrics

    def validate(self, step: int, metrics_fn, patience: int | None = None, threshold: float = 0.0) -> bool:
        """Evaluate; save best.pt on a new lowest val_loss. With a patience: True (stop) once `patience`
        evaluations in a row have not improved on the best by more than threshold."""
        v = self.evaluate(step, metrics_fn)["val_loss"]
        self.stale_evals = 0 if v < self.best_val_loss - threshold else self.stale_evals + 1
        if v < self.best_val_loss:
            self.best_val_loss = v
            self.save(step, best=True)
        if patience is not None and self.stale_evals >= patience:
            print0(f"early stopping: {self.stale_evals} evaluations without an improvement of {threshold}; "
                   f"best val_loss {self.best_val_loss:.4f}")
            return True
        return False

    def save(self, step: int, best: bool = False):
        """Checkpoint everything a resume needs: full-precision weights, optimizer, scaler, data position, every
        rank's RNG states, config. Every rank must call this (RNG states are gathered); rank 0 writes."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict(), "loader": self.loader.state_dict(), "step": step,
                 "skipped": int(self.skipped), "best_val_loss": self.best_val_loss, "stale_evals": self.stale_evals,
                 "stage": self.stage, "config": dataclasses.asdict(self.cfg),
                 "model_config": dataclasses.asdict(self.model_cfg), "rng": gather_rng_states(self.run)}
        if self.run.ddp:  # DDP keeps replicas identical; prove it rather than checkpoint one of many
            state["rank_weight_diff"] = rank_weight_diff(self.model, self.run)
            if state["rank_weight_diff"] > 0:
                raise RuntimeError(f"ranks hold different weights (max |diff| {state['rank_weight_diff']:.3g})")
        if not self.run.master:
            return
        if not all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()):
            raise NonFiniteError("refusing to save a model with non-finite weights")
        t0 = time.time()
        atomic_save(state, os.path.join(self.cfg.out_dir, "best.pt" if best else f"step_{step:07d}.pt"))
        if not best:
            for old in sorted(glob.glob(os.path.join(self.cfg.out_dir, "step_*.pt")))[: -self.cfg.keep_checkpoints]:
                os.remove(old)
        self.t_log += time.time() - t0  # saving is not training time
