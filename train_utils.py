"""
The mechanics every train_*.py shares, written once. The loops stay in the scripts: each says when it logs,
evaluates and saves; the pieces it calls are here.

  configuration  TrainConfig, FinetuneConfig, load_config (defaults <- config file <- --key=value), --help, cli()
  processes      setup (device, dtype, torchrun, seeds), Run, print0, all_reduce_mean, teardown
  the step       get_lr, set_lr, clip_gradients, NonFiniteGuard (skip a NaN/Inf update), StepTimer
  checkpoints    Checkpoints (save, rotate, resume), load_checkpoint, model_from_checkpoint (LoRA ones merged onto
                 their base), checkpoint_tokenizer, EarlyStopping
  output         MetricsLog (metrics.jsonl and the console line), evaluate, validation_loss (loss, ppl,
                 bits per byte: count_token_bytes, lm_sums), StopSignal
"""
import ast
import ctypes
import dataclasses
import glob
import inspect
import json
import math
import os
import random
import re
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

from data import DataError, file_digest
from lora import TARGETS, adapter_state, add_lora, lora_layers, merge_lora, trainable_params
from model import ModelConfig, Transformer
from tokenizer import TokenizerError, load_tokenizer


# -----------------------------------------------------------------------------
# configuration: dataclass defaults <- config file <- --key=value flags

class ConfigError(ValueError):
    pass


@dataclasses.dataclass
class TrainConfig:
    """The keys every training stage has. A stage's Config adds its own and overrides defaults."""
    # --- I/O
    out_dir: str = "out"  # checkpoints and metrics.jsonl
    resume: bool = False  # continue from the latest checkpoint in out_dir
    # --- data
    data_path: str = "data/train.jsonl"  # a file, a glob (data/pretrain_*.jsonl) or several, comma-separated
    val_data_path: str | None = None  # the same; None: hold out the last val_fraction of the records
    val_fraction: float = 0.01
    tokenizer_path: str | None = None  # None: the tokenizer shipped in tokenizer/
    # --- training length
    batch_size: int = 64  # per rank: the global batch is batch_size x accum_steps x ranks
    accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # None: `epochs` passes over the training data
    epochs: int = 1
    # --- optimizer: AdamW, weight decay on matrices only
    lr: float = 5e-4
    min_lr: float = 1e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0  # 0 disables clipping
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 1000
    warmup_ratio: float | None = None  # if set: warmup_steps = warmup_ratio * max_steps
    # --- logging, evaluation, checkpoints
    log_interval: int = 10  # a console line and a metrics.jsonl row every this many steps
    eval_interval: int = 2000  # validation loss (and best.pt) every this many steps, and at the end
    eval_steps: int = 50  # validation batches per evaluation
    save_interval: int = 5000  # out_dir/step_NNNNNNN.pt every this many steps, at the end and on Ctrl-C
    keep_checkpoints: int = 3  # the newest step checkpoints kept
    grad_log_interval: int = 0  # per-layer gradient norms every this many steps (plot.py's gradient flow); 0: off
    profile: bool = False  # torch.profiler over steps 3-5: a Chrome trace in out_dir and the top ops table
    wandb: bool = False  # also log to Weights & Biases (needs `pip install wandb`)
    # --- system
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (bfloat16 on GPUs that have it, else float16; float32 on a CPU) | float32 | bfloat16 | float16
    compile: bool = False  # torch.compile the model
    seed: int = 1337
    max_bad_steps: int = 10  # stop after this many non-finite (skipped) steps in a row
    peak_flops: float = 0.0  # per device, the MFU denominator; 0: measure a large matmul at startup

    def __post_init__(self):
        positive = ("batch_size", "accum_steps", "epochs", "log_interval", "eval_interval", "eval_steps",
                    "save_interval", "keep_checkpoints", "max_bad_steps")
        for key in positive + ("max_steps",) * (self.max_steps is not None):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key {key!r} must be at least 1, got {getattr(self, key)}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"config key 'val_fraction' must be between 0 and 1, got {self.val_fraction}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"config key 'dtype' must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")


@dataclasses.dataclass
class FinetuneConfig(TrainConfig):
    """SFT and DPO: start from a checkpoint and keep its architecture."""
    # --- I/O
    init_from: str = "out/pretrain/best.pt"  # the checkpoint to start from; its model config is used
    # --- data
    val_fraction: float = 0.05
    tokenizer_path: str | None = None  # None: the init_from checkpoint's tokenizer (another one is refused)
    skip_bad: bool = False  # skip (and count) malformed records instead of stopping at the first
    # --- model switches (the architecture comes from init_from)
    flash: bool | None = None  # None: SDPA on CUDA, the math path elsewhere (see ModelConfig)
    grad_checkpoint: bool = False  # recompute each block in backward: less memory, more compute
    dropout: float = 0.0
    freeze_embeddings: bool = False  # keep the (tied) token embedding as it was: see configs/demo_sft.py
    # --- LoRA: train small low-rank adapters on the frozen init_from model instead of the model itself (lora.py)
    lora_rank: int = 0  # r of every adapter; 0: off, full fine-tuning
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "wq,wk,wv,wo,w1,w2,w3"  # comma-separated: the projections that get adapters
    # --- logging, evaluation, checkpoints
    eval_interval: int = 500  # and at every epoch end
    save_interval: int = 1000
    early_stopping_patience: int = 3  # stop after this many evaluations without an improvement of ...
    early_stopping_threshold: float = 0.0  # ... this much in val_loss

    def __post_init__(self):
        super().__post_init__()
        if self.lora_rank < 0:
            raise ConfigError(f"config key 'lora_rank' must be 0 (off) or more, got {self.lora_rank}")
        unknown = set(self.lora_targets.split(",")) - set(TARGETS)
        if unknown:
            raise ConfigError(f"config key 'lora_targets' names {sorted(unknown)}; choose from {','.join(TARGETS)}")


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


def field_docs(schema) -> dict[str, tuple[str, str]]:
    """{field: (group, comment)} from the dataclass source: groups are its `# --- name` lines, a field's comment
    the `# ...` beside it. A subclass's line overrides its base's, keeping the base's comment if it has none."""
    docs: dict[str, tuple[str, str]] = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):
        group = ""
        for line in inspect.getsource(cls).splitlines():
            if line.strip().startswith("# ---"):
                group = line.strip()[5:].strip()
            elif m := re.match(r"\s+(\w+): [^#]*?(?:  # (.*))?$", line):
                docs[m[1]] = (group, m[2] or docs.get(m[1], ("", ""))[1])
    return docs


def help_text(schemas, ignored) -> str:
    """--help: every key of the schemas with its default and comment, grouped as in the dataclasses."""
    script = os.path.basename(sys.modules[schemas[0].__module__].__file__ or "script.py")
    lines = [f"usage: python {script} [config_file.py] [--key=value ...]",
             "A config file's `key = value` lines override the defaults below; --key=value flags override both."]
    for schema in schemas:
        docs, groups = field_docs(schema), {}
        for f in dataclasses.fields(schema):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            group, comment = docs.get(f.name, ("", ""))
            groups.setdefault(group, []).append((f"--{f.name}={default}", comment))
        for group, rows in groups.items():
            lines.append(f"\n{group or schema.__name__}:")
            width = max(len(flag) for flag, _ in rows)
            lines += [f"  {flag:<{width}}  {comment}".rstrip() for flag, comment in rows]
    if ignored:
        lines.append(f"\nAccepted and ignored (training keys): {', '.join(sorted(ignored))}")
    return "\n".join(lines)


def load_config(argv: list[str], *schemas, ignored=()):
    """Build one instance of each dataclass in schemas from `[config_file] [--key=value ...]`. Every key must
    belong to one of the schemas (or to a dataclass in `ignored`: accepted, named in one line, then dropped)
    and match its field's type. -h / --help prints every key and exits."""
    argv = list(argv or [])
    fields = {f.name: (schema, f.type) for schema in schemas for f in dataclasses.fields(schema)}
    skip = {f.name for schema in ignored for f in dataclasses.fields(schema)} - set(fields)
    if "-h" in argv or "--help" in argv:
        print(help_text(schemas, skip))
        raise SystemExit(0)
    settings = []  # (key, value, source), applied in order: the file first, then the flags
    if argv and not argv[0].startswith("--"):
        path = argv.pop(0)
        settings += [(k, v, path) for k, v in read_config_file(path).items()]
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        settings.append((key, parse_flag_value(text), "command line"))
    values: dict = {schema: {} for schema in schemas}
    dropped = sorted({key for key, _, _ in settings if key in skip})
    if dropped:
        print0(f"ignoring training keys that do not apply here: {', '.join(dropped)}")
    for key, value, source in settings:
        if key in skip:
            continue
        if key not in fields:
            raise ConfigError(f"unknown config key {key!r} (from {source}); known keys: {', '.join(sorted(fields))}")
        schema, annotation = fields[key]
        values[schema][key] = check_type(key, value, annotation, source)
    try:
        return tuple(schema(**values[schema]) for schema in schemas)
    except ValueError as e:  # a dataclass's own check (ModelConfig's shapes, TrainConfig's ranges)
        raise ConfigError(str(e)) from None


class CheckpointError(RuntimeError):
    pass


class NonFiniteError(RuntimeError):
    pass


def cli(main):
    """The entry point of a script: a user's mistake (config, data, checkpoint, a diverging run) is one line
    `error: ...` and exit status 2; a traceback means a bug."""
    try:
        main(sys.argv[1:])
    except (ConfigError, CheckpointError, DataError, TokenizerError, NonFiniteError, FileNotFoundError) as e:
        if master_process():
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


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

    def no_sync(self, model, last_micro_step: bool):
        """DDP all-reduces the gradients in the backward of the last micro-step only."""
        return nullcontext() if last_micro_step or not self.ddp else model.no_sync()

    @contextmanager
    def rank0_first(self, waiting: str = "waiting for rank 0"):
        """Rank 0 runs the block first (e.g. builds a data cache), the other ranks then run it (and read it)."""
        if self.ddp and not self.master:
            if self.rank == 1:  # one line for all the waiting ranks, not silence
                print(f"ranks 1..{self.world_size - 1}: {waiting}", flush=True)
            dist.barrier()
        yield
        if self.ddp and self.master:
            dist.barrier()


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def pick_dtype(dtype: str, device_type: str) -> str:
    """auto: bfloat16 where the device computes it natively, float16 (with its GradScaler) on older GPUs,
    float32 on a CPU (bfloat16 autocast on a CPU is faster only with AVX512-BF16 or AMX: ask for it)."""
    if dtype != "auto":
        return dtype
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device_type == "mps":
        return "bfloat16" if torch.backends.mps.is_macos_or_newer(14, 0) else "float16"
    return "float32"


def keep_freed_memory():
    """On a CPU, glibc returns every freed buffer over 32 MB to the kernel, and each step then page-faults its
    logits and attention buffers in again; keep freed memory in the heap for reuse instead (figures:
    docs/performance.md)."""
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
    device = pick_device(device)
    run = Run(torch.device(device), pick_dtype(dtype, torch.device(device).type))
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


def all_reduce_sum(t: torch.Tensor, run: Run) -> torch.Tensor:
    if run.ddp:
        t = t.clone()
        dist.all_reduce(t)
    return t


def all_reduce_mean(t: torch.Tensor, run: Run) -> torch.Tensor:
    return all_reduce_sum(t, run) / run.world_size if run.ddp else t


def print_run(cfg, model_cfg, run: Run):
    print0(f"config: {dataclasses.asdict(cfg)}\nmodel: {dataclasses.asdict(model_cfg)}\n"
           f"device {run.device}, dtype {run.dtype}, {run.world_size} rank(s)")
    if run.device.type == "cpu" and run.dtype == "float16":
        print0("warning: most CPUs emulate float16 matmuls, far slower than float32: use bfloat16 or float32")


def schedule_length(cfg, loader, val_loader, run: Run) -> tuple[int, int, int]:
    """(max_steps, warmup_steps, steps_per_epoch), printed with the data's size: max_steps if set, else epochs
    of whole accumulated steps."""
    steps_per_epoch = max(1, len(loader) // cfg.accum_steps)
    max_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup_steps = round(cfg.warmup_ratio * max_steps) if cfg.warmup_ratio is not None else cfg.warmup_steps
    print0(f"{len(loader.dataset):,} {loader.name} and {len(val_loader.dataset):,} {val_loader.name}; {max_steps:,} "
           f"steps of {cfg.batch_size} x {cfg.accum_steps} accum x {run.world_size} rank(s), {steps_per_epoch:,} "
           f"per epoch, {warmup_steps:,} of warmup")
    return max_steps, warmup_steps, steps_per_epoch


def wrap(model, cfg, run: Run):
    """The model the loop trains: compiled if asked, DDP-wrapped under torchrun. Keep the unwrapped one too."""
    if cfg.compile:
        model = torch.compile(model)
    if run.ddp:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


# -----------------------------------------------------------------------------
# the optimizer step

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


def clip_gradients(model, optimizer, scaler, max_grad_norm: float) -> torch.Tensor:
    """Unscale (float16), clip to max_grad_norm (0: no clipping), and return the norm before clipping."""
    scaler.unscale_(optimizer)  # clip the true gradients, not the float16-scaled ones
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))


def group_grad_norms(model) -> dict[str, float]:
    """Gradient norm per top-level part: tok_embeddings, layers.0 .. layers.N-1, norm (the gradient flow)."""
    squares: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            parts = name.removeprefix("module.").removeprefix("_orig_mod.").split(".")
            group = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
            squares[group] = squares.get(group, 0) + p.grad.float().pow(2).sum()
    return {k: v.sqrt().item() for k, v in squares.items()}


class NonFiniteGuard:
    """Skips an update whose loss or gradient norm is NaN/Inf, deciding on the device (no host sync per step);
    the skips, and the first parameter with a non-finite gradient, are read at log steps."""

    def __init__(self, model, max_bad_steps: int, device):
        self.model, self.max_bad_steps = model, max_bad_steps
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.in_a_row = torch.zeros((), dtype=torch.long, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)  # index into the trainable parameters
        self.reported = 0

    def step(self, optimizer, scaler, loss: torch.Tensor, grad_norm: torch.Tensor):
        """optimizer.step() unless the loss or the gradient norm is non-finite; then zero the gradients."""
        bad = ~torch.isfinite(loss + grad_norm)
        self.skipped += bad
        self.in_a_row = (self.in_a_row + 1) * bad
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # = the trainable ones, in order
        first = (~torch.stack(torch._foreach_norm(grads)).isfinite()).int().argmax()
        self.first_bad = torch.where(bad & (self.first_bad < 0), first, self.first_bad)
        if scaler.is_enabled():  # float16: GradScaler skips a step with inf/NaN gradients itself
            scaler.step(optimizer)
        elif optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()  # GradScaler's signal: fused AdamW then skips the whole update
            optimizer.step()
        elif not bad.item():  # other optimizers cannot skip on the device: one host sync
            optimizer.step()
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def report(self, step: int, loss: float, grad_norm: float):
        """At a log step: print the steps skipped since the last report; stop after max_bad_steps in a row."""
        skipped, in_a_row, first = int(self.skipped), int(self.in_a_row), int(self.first_bad)
        if skipped > self.reported:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            where = f"; first non-finite gradient in {names[first]}" if 0 <= first < len(names) else ""
            print0(f"step {step}: {skipped - self.reported} update(s) skipped for a non-finite loss or gradient "
                   f"norm (now loss {loss}, grad norm {grad_norm}){where}; {in_a_row} in a row")
            self.reported = skipped
            self.first_bad.fill_(-1)
        if in_a_row >= self.max_bad_steps:
            raise NonFiniteError(f"{in_a_row} optimizer steps in a row had a non-finite loss or gradient: "
                                 f"lower lr, check the data, or use bfloat16 instead of float16")

    def state_dict(self) -> dict:
        return {"skipped": int(self.skipped)}

    def load_state_dict(self, state: dict):
        self.skipped.fill_(state["skipped"])
        self.reported = state["skipped"]


# -----------------------------------------------------------------------------
# checkpoints

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


def load_model_state(model, state_dict: dict, source: str, adapters_only: bool = False):
    """Every weight of the model (adapters_only: every LoRA adapter) from state_dict, strictly: an error lists
    every missing, unexpected or reshaped key."""
    own = adapter_state(model) if adapters_only else model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    reshaped = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
                for k, v in own.items() if k in state_dict and state_dict[k].shape != v.shape]
    if missing or unexpected or reshaped:
        raise CheckpointError(f"weights in {source} do not fit this model: missing {missing}, unexpected "
                              f"{unexpected}, other shape {reshaped}")
    with torch.no_grad():
        for k, v in state_dict.items():
            own[k].copy_(v)  # state_dict() tensors share the parameters' storage


def model_from_checkpoint(path: str, device="cpu", **overrides):
    """(Transformer with the checkpoint's architecture -- model_config updated by overrides such as flash or
    dropout -- and its weights, loaded strictly; the checkpoint itself). A LoRA checkpoint's adapters come
    merged onto its base, so that every caller (sampling, evaluation, export, fine-tuning) takes it as it is."""
    state = load_checkpoint(path)
    if "lora" in state:
        return merge_lora(lora_model(state, path, **overrides)).to(device), state
    model = Transformer(ModelConfig(**{**state["model_config"], **overrides}))
    load_model_state(model, state["model"], path)
    return model.to(device), state


def checkpoint_tokenizer(state: dict, tokenizer_path: str | None = None):
    """The tokenizer a checkpoint was trained with: the one its config names (None: the shipped one), or
    tokenizer_path, which must hold the same files: other ids would turn its output into wrong text, silently."""
    path = tokenizer_path if tokenizer_path is not None else state.get("config", {}).get("tokenizer_path")
    tokenizer = load_tokenizer(path)
    recorded = state.get("tokenizer")  # absent from checkpoints written before it was recorded
    if recorded and recorded["fingerprint"] != tokenizer.fingerprint:
        raise TokenizerError(f"tokenizer {path or 'tokenizer/'} is not the one the checkpoint was trained with "
                             f"({recorded['path'] or 'tokenizer/'}, {recorded['chat_template']} chat template)")
    return tokenizer


def lora_model(state: dict, path: str, **overrides):
    """A LoRA checkpoint (state, read from path) as the model it trained, unmerged: its base checkpoint, which
    must be the very file it was trained on (same digest), with the adapters on top."""
    lora = state["lora"]
    if not os.path.isfile(lora["base"]):
        raise CheckpointError(f"{path} holds LoRA adapters for the base checkpoint {lora['base']}, which is not there")
    if file_digest(lora["base"]) != lora["base_digest"]:
        raise CheckpointError(f"{path} holds LoRA adapters trained on another {lora['base']} (digest "
                              f"{lora['base_digest']}, that file's is now {file_digest(lora['base'])})")
    model, _ = model_from_checkpoint(lora["base"], **overrides)
    add_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"].split(","))
    load_model_state(model, state["model"], path, adapters_only=True)
    return model


def lora_record(cfg) -> dict:
    """What a LoRA checkpoint holds besides its adapters: the base it was trained on and the adapters' shape."""
    return {"base": cfg.init_from, "base_digest": file_digest(cfg.init_from), "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout, "targets": cfg.lora_targets}


def finetune_model(cfg, run: Run) -> Transformer:
    """SFT and DPO: the init_from model (strictly: every key, every shape) with this run's switches (flash,
    grad_checkpoint, dropout) and, with freeze_embeddings, its token embedding frozen; with lora_rank, all of it
    frozen under fresh adapters. Sets cfg.tokenizer_path to the checkpoint's tokenizer when it is None, and refuses
    another tokenizer."""
    model, state = model_from_checkpoint(cfg.init_from, run.device, flash=cfg.flash,
                                         grad_checkpoint=cfg.grad_checkpoint, dropout=cfg.dropout)
    if cfg.tokenizer_path is None:
        cfg.tokenizer_path = state.get("config", {}).get("tokenizer_path")
    checkpoint_tokenizer(state, cfg.tokenizer_path)
    model.tok_embeddings.weight.requires_grad_(not cfg.freeze_embeddings)
    if cfg.lora_rank:  # everything frozen, adapters added
        total = model.num_params()
        add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets.split(","))
        print0(f"LoRA rank {cfg.lora_rank} on {cfg.lora_targets}: {trainable_params(model):,} parameters train, "
               f"{total:,} stay frozen")
    return model


def latest_checkpoint(out_dir: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(out_dir, "step_*.pt")))
    return paths[-1] if paths else None


def checkpoint_to_resume(cfg) -> str | None:
    """Create out_dir; the checkpoint to resume from with --resume=True, None for a fresh run. A fresh run
    refuses an out_dir that holds checkpoints: nothing already written is overwritten."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    latest = latest_checkpoint(cfg.out_dir)
    if latest and not cfg.resume:
        raise ConfigError(f"{cfg.out_dir} already holds checkpoints: pass --resume=True to continue, or another out_dir")
    return latest if cfg.resume else None


class Checkpoints:
    """Everything a resume needs, in out_dir: full-precision weights, optimizer, GradScaler, data position, every
    rank's RNG states, the configs and the loop's own state (step, guard, early stopping). A LoRA run (lora: its
    lora_record) saves only the adapters and the record: a few MB."""

    def __init__(self, cfg, model_cfg, stage: str, run: Run, model, optimizer, scaler, loader, guard, early,
                 lora: dict | None = None):
        self.cfg, self.model_cfg, self.stage, self.run, self.lora = cfg, model_cfg, stage, run, lora
        tokenizer = load_tokenizer(cfg.tokenizer_path)  # recorded: sampling, serving and export use the same
        self.tokenizer = {"path": cfg.tokenizer_path, "fingerprint": tokenizer.fingerprint,
                          "chat_template": tokenizer.chat_template}
        self.parts = {"model": model, "optimizer": optimizer, "scaler": scaler, "loader": loader, "guard": guard,
                      "early_stopping": early}

    def save(self, name: str, step: int):
        """Write out_dir/name atomically (every rank must call this: RNG states are gathered; rank 0 writes);
        after a step_*.pt, keep only the newest keep_checkpoints of them."""
        state = {key: part.state_dict() for key, part in self.parts.items()}
        state |= {"step": step, "stage": self.stage, "config": dataclasses.asdict(self.cfg), "tokenizer": self.tokenizer,
                  "model_config": dataclasses.asdict(self.model_cfg), "rng": gather_rng_states(self.run)}
        if self.lora:
            state |= {"model": adapter_state(self.parts["model"]), "lora": self.lora}
        if self.run.ddp:  # DDP keeps replicas identical; prove it rather than checkpoint one of many
            state["rank_weight_diff"] = rank_weight_diff(self.parts["model"], self.run)
            if state["rank_weight_diff"] > 0:
                raise RuntimeError(f"ranks hold different weights (max |diff| {state['rank_weight_diff']:.3g})")
        if not self.run.master:
            return
        if not all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()):
            raise NonFiniteError("refusing to save a model with non-finite weights")
        atomic_save(state, os.path.join(self.cfg.out_dir, name))
        if name.startswith("step_"):
            for old in sorted(glob.glob(os.path.join(self.cfg.out_dir, "step_*.pt")))[: -self.cfg.keep_checkpoints]:
                os.remove(old)

    def resume(self, path: str | None) -> int:
        """Load the checkpoint at path into every part and the RNGs; the step to continue from (0: fresh). The RNGs
        continue the interrupted run's streams: nothing but training may draw from them after this."""
        if path is None:
            return 0
        state = load_checkpoint(path)
        if bool(self.lora) != ("lora" in state):
            raise CheckpointError(f"{path} is {'a LoRA' if 'lora' in state else 'a full'} checkpoint but this run is "
                                  f"{'LoRA' if self.lora else 'full'} fine-tuning: keep its lora_rank")
        if self.lora and state["lora"]["base_digest"] != self.lora["base_digest"]:
            raise CheckpointError(f"{path} trained its adapters on another {state['lora']['base']} than this "
                                  f"run's {self.lora['base']} (digest {state['lora']['base_digest']} vs "
                                  f"{self.lora['base_digest']})")
        load_model_state(self.parts["model"], state["model"], path, adapters_only=bool(self.lora))
        for key, part in self.parts.items():
            if key != "model":
                part.load_state_dict(state[key])
        set_rng_state(state["rng"][self.run.rank])
        print0(f"resumed from {path} at step {state['step']}")
        return state["step"]


class EarlyStopping:
    """Tracks the best validation loss; with a patience, says when to stop (that many evaluations in a row
    without an improvement of more than threshold)."""

    def __init__(self, patience: int | None = None, threshold: float = 0.0):
        self.patience, self.threshold = patience, threshold
        self.best, self.stale = float("inf"), 0

    def update(self, val_loss: float) -> bool:
        """Record an evaluation; True when it is a new best."""
        self.stale = 0 if val_loss < self.best - self.threshold else self.stale + 1
        improved = val_loss < self.best
        self.best = min(self.best, val_loss)
        return improved

    @property
    def should_stop(self) -> bool:
        if self.patience is not None and self.stale >= self.patience:
            print0(f"early stopping: {self.stale} evaluations without an improvement of {self.threshold}; "
                   f"best val_loss {self.best:.4f}")
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best, "stale": self.stale}

    def load_state_dict(self, state: dict):
        self.best, self.stale = state["best"], state["stale"]


def prepare_training(cfg, model_cfg, stage: str, run: Run, model, loader, early):
    """(optimizer, scaler, guard, checkpoints) for a built model: AdamW (over the trainable parameters: a LoRA
    model's adapters), the GradScaler (enabled for float16 only: bfloat16 has float32's range), the non-finite
    guard, and the checkpoints that save them all."""
    seed_rank(cfg.seed, run)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), run.device.type)
    scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")
    guard = NonFiniteGuard(model, cfg.max_bad_steps, run.device)
    lora = lora_record(cfg) if lora_layers(model) else None
    checkpoints = Checkpoints(cfg, model_cfg, stage, run, model, optimizer, scaler, loader, guard, early, lora)
    return optimizer, scaler, guard, checkpoints


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop checks it between optimizer steps, saves and exits."""

    def __init__(self):
        self.received = False
        self.previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self):
        """Give the signals back (a process that goes on after training, e.g. a notebook, gets Ctrl-C back)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        if self.received:  # a second Ctrl-C: the user means it
            raise KeyboardInterrupt
        self.received = True
        print(f"\nreceived signal {signum}: saving a checkpoint after this step, then exiting", file=sys.stderr, flush=True)

    def requested(self, run: Run, step: int) -> bool:
        """All ranks agree, so no rank leaves the loop while another waits in a collective. A collective: call
        it where every rank does (at log steps)."""
        stop = self.received
        if run.ddp:
            flag = torch.tensor([float(self.received)], device=run.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            print0(f"stopped at step {step}; continue with --resume=True")
        return stop


# -----------------------------------------------------------------------------
# measurement, evaluation, output

def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
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


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class StepTimer:
    """Tokens/s, MFU and the data/forward/backward/optimizer split of the steps since the last read(). On CUDA
    the phases are timed with events, read at the next log step, so timing never waits for the GPU."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, run: Run, peak_flops: float, start_step: int, max_steps: int):
        """peak_flops: the device's, for MFU; 0: measured now (measure_peak_flops)."""
        self.run, self.start_step, self.max_steps = run, start_step, max_steps
        self.peak_flops = peak_flops or measure_peak_flops(run.device, run.dtype)
        self.t_start = self.t_last = time.time()
        self.tokens = self.flops = 0  # this rank's, since the last read
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.events: list = []  # CUDA: (phase, start event, end event)

    @contextmanager
    def phase(self, name: str):
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

    def count(self, X: torch.Tensor, flops_per_token: float):
        """Once per micro-batch: the tokens it fed the model, and the training FLOPs they took."""
        self.tokens += X.numel()
        self.flops += flops_per_token * X.numel()

    @contextmanager
    def paused(self):
        """Time spent here (evaluation, saving) is not training time."""
        t0 = time.time()
        yield
        self.t_last += time.time() - t0

    def read(self, step: int) -> dict[str, float]:
        """tokens_per_s (all ranks), mfu, mem_gb, frac_<phase>, elapsed_s, eta_s; then start a new interval.
        Call after a host sync (a .item()), so that the CUDA events have completed."""
        for name, start, end in self.events:
            self.seconds[name] += start.elapsed_time(end) / 1000
        now, busy = time.time(), sum(self.seconds.values()) or 1.0
        interval, elapsed = now - self.t_last, now - self.t_start
        row = {"tokens_per_s": self.tokens * self.run.world_size / interval,
               "mfu": self.flops / interval / self.peak_flops, "mem_gb": peak_memory_gb(self.run.device),
               **{f"frac_{p}": s / busy for p, s in self.seconds.items()}, "elapsed_s": elapsed,
               "eta_s": elapsed / (step - self.start_step) * (self.max_steps - step)}
        self.t_last, self.tokens, self.flops = now, 0, 0
        self.seconds, self.events = dict.fromkeys(self.PHASES, 0.0), []
        return row


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def console_line(row: dict, max_steps: int) -> str:
    """What a person watches, in their units, on one line; the full row goes to metrics.jsonl (skipped updates
    get a line of their own from NonFiniteGuard.report)."""
    parts = [f"step {row['step']}/{max_steps}"]
    if "val_loss" in row:  # an evaluation row
        parts += [f"{k} {v:.4g}" for k, v in row.items() if k.startswith("val_") and "logp" not in k]
        return " | ".join(parts)
    parts += [f"loss {row['loss']:.4g}", f"lr {row['lr']:.1e}", f"grad {row['grad_norm']:.3g}"]
    if "reward_acc" in row:  # DPO
        parts.append(f"acc {row['reward_acc']:.0%} margin {row['reward_margin']:.3g}")
    tokens = row["tokens_per_s"]
    parts += [f"{tokens / 1e3:.1f}k tok/s" if tokens >= 1e3 else f"{tokens:.0f} tok/s", f"MFU {row['mfu']:.0%}"]
    return " | ".join(parts + [f"{clock(row['elapsed_s'])} / ETA {clock(row['eta_s'])}"])


def parse_row(line: str) -> dict | None:
    """A metrics.jsonl row; None for a blank line or one a crash cut short (the last line of a killed run)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON row per log step and per evaluation, and a short line on the console.
    Rank 0 writes. On resume, rows after the checkpoint's step are dropped: the run writes them again."""

    def __init__(self, cfg, run: Run, start_step: int, max_steps: int):
        self.path, self.run, self.max_steps, self.wandb = os.path.join(cfg.out_dir, "metrics.jsonl"), run, max_steps, None
        if not run.master:
            return
        kept = []
        if start_step and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                kept = [line for line in f if (row := parse_row(line)) and row["step"] <= start_step]
        with open(f"{self.path}.tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(f"{self.path}.tmp", self.path)
        if cfg.wandb:
            import wandb  # optional: only when asked for

            self.wandb = wandb.init(project="nanomind", name=os.path.basename(os.path.normpath(cfg.out_dir)),
                                    config=dataclasses.asdict(cfg))

    def grad_flow(self, step: int, model, interval: int):
        """Every `interval` steps (0: never) a row of per-layer gradient norms. Call after clip_gradients."""
        if interval and step % interval == 0:
            self.write({"step": step, "layer_grad_norms": group_grad_norms(model)}, echo=False)

    def write(self, row: dict, echo: bool = True):
        if not self.run.master:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])
        if echo:
            print0(console_line(row, self.max_steps))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700))


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


def count_token_bytes(tokenizer) -> torch.Tensor:
    """(vocab_size,) int64: how many UTF-8 bytes of text each id stands for; 0 for special tokens (<s>, </s>,
    <pad>, [INST], <|im_end|> and other added tokens), which are markup, not text. Bits per byte divide by these."""
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    if hasattr(tokenizer, "sp"):  # SentencePiece: byte pieces are one byte, "▁" is a space
        sp = tokenizer.sp
        for i in range(sp.vocab_size()):
            if not sp.is_control(i):
                counts[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("▁", " ").encode())
        return counts
    enc = tokenizer.enc  # tiktoken runs nanomind's BPE and Hugging Face's byte-level BPE alike
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    for i in range(min(enc.n_vocab, tokenizer.vocab_size)):
        if i not in special:
            try:
                counts[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # an id no token has (Hugging Face vocabularies may have gaps)
                pass
    return counts


def lm_sums(model, X, Y, loss_mask, token_bytes: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward pass: the masked mean cross-entropy ("loss", as training computes it) and, for bits per byte,
    the summed cross-entropy of the scored targets in nats and the UTF-8 bytes those targets stand for."""
    _, ce = model(X, Y, reduction="none")  # (B, T) nats per target
    return {"loss": (ce * loss_mask).sum() / loss_mask.sum().clamp(min=1), "nats": (ce * loss_mask).sum(),
            "bytes": (token_bytes.to(Y.device)[Y] * loss_mask).sum()}


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Summed cross-entropy in bits per UTF-8 byte: comparable between tokenizers (special tokens' loss counts,
    their bytes are 0)."""
    return nats / math.log(2) / max(n_bytes, 1)


def validation_loss(model, loader, steps: int, run: Run, token_bytes: torch.Tensor) -> dict[str, float]:
    """{val_loss, val_ppl, val_bpb} on the first `steps` validation batches: val_loss is the language-model loss
    (masked mean cross-entropy, per batch, averaged), val_bpb the summed cross-entropy of all their scored targets
    over their bytes."""
    model.eval()
    with run.autocast():
        sums = evaluate(lambda X, Y, M, _: lm_sums(model, X, Y, M, token_bytes), loader, steps, run)
    model.train()
    # evaluate() averages every entry over the batches alike, so nats / bytes is the ratio of the totals
    return {"val_loss": sums["loss"], "val_ppl": perplexity(sums["loss"]),
            "val_bpb": bits_per_byte(sums["nats"], sums["bytes"])}
