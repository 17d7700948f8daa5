"""
Training memory: how much a step takes (estimated and measured), the largest micro-batch that fits a device, a
watch for memory that grows step after step (a leak), and an out-of-memory error a user can act on.

  estimate_memory / measure_memory   bytes of weights, gradients, AdamW moments, activations and a step's peak
  find_batch_size                    real training steps at growing micro-batches: the largest that fits
  MemoryWatch                        one warning line when memory in use grows at every log row
  out_of_memory                      an allocator's failure as one line: step, batch, memory, what to change
"""
import ctypes
import gc
import itertools
import multiprocessing
import os
from collections import deque
from contextlib import nullcontext

import torch

from errors import ConfigError, OutOfMemoryError
from model import ATTENTION_TILE, ModelConfig, Transformer
from optim import configure_optimizer
from runtime import keep_freed_memory

GiB = 2**30


def estimate_memory(model_cfg: ModelConfig, batch_size: int, dtype: str, device_type: str) -> dict[str, int]:
    """Bytes of training. Weights, gradients and AdamW's two moments: 4 + 4 + 8 bytes per parameter, all float32
    (autocast keeps float32 weights). Activations: what autograd saves per token, counted layer by layer from
    model.py (a rule of thumb per parameter misses attention's growth with T and the head's with vocab_size)."""
    with torch.device("meta"):  # shapes only, no memory
        n_params = Transformer(model_cfg).num_params()
    c, T, tokens = model_cfg, model_cfg.max_seq_len, batch_size * model_cfg.max_seq_len
    kv_dim, w = c.n_kv_heads * c.head_dim, 2 if dtype in ("bfloat16", "float16") else 4
    # per block, float32: each of its two RMSNorms keeps x, rsqrt and x * rsqrt; compute dtype: each norm's output
    # as a matmul input (autocast casts it once per matmul: wq, wk, wv; w1, w3), attention's q, k, v, output and
    # wo input, SwiGLU's w1 and w3 outputs, silu(w1 x) and their product
    block32 = 2 * (2 * c.dim + 1)
    block_low = (5 if w == 2 else 2) * c.dim + 3 * c.dim + 2 * kv_dim + 4 * c.ffn_dim
    if c.uses_flash(device_type):
        block32 += c.n_heads  # one logsumexp per head
    else:  # the math path keeps float32 probabilities over the keys each row's tile sees (and their low-precision
        # copy under autocast), not the attention output
        tiles = [(t0, min(t0 + ATTENTION_TILE, T)) for t0 in range(0, T, ATTENTION_TILE)]  # query rows t0 .. t1-1
        keys = sum((t1 - t0) * t1 for t0, t1 in tiles) // T  # scores per query row, on average: each row sees t1
        block32 += c.n_heads * keys
        block_low += (c.n_heads * keys if w == 2 else 0) - c.dim
    block = 4 * block32 + w * block_low
    # after the blocks: the final norm (float32), its output as the head's input, the loss's log-softmax
    head = 4 * (2 * c.dim + 1 + c.vocab_size) + w * c.dim
    # grad_checkpoint: a block keeps only its float32 input, and backward recomputes one block at a time
    blocks = c.n_layers * 4 * c.dim if c.grad_checkpoint else c.n_layers * block
    # + autocast's low-precision copies of the weights: of the head's alone when the blocks are recomputed
    copies = (c.vocab_size * c.dim if c.grad_checkpoint else n_params) * w if w == 2 else 0
    activations = tokens * (blocks + head) + copies
    # the step's peak: backward starts with every activation alive (and one recomputed block) plus two float32
    # (B, T, vocab) gradients of the logits; the weight gradients grow while activations are freed
    peak = activations + tokens * (block if c.grad_checkpoint else 0) + 8 * tokens * c.vocab_size + 4 * n_params
    return {"n_params": n_params, "weights": 4 * n_params, "gradients": 4 * n_params, "adamw": 8 * n_params,
            "activations": activations, "peak": peak}


# -----------------------------------------------------------------------------
# measuring: CUDA's allocator counts its own bytes; on a CPU, Linux's /proc/self/status

def proc_status(field: str) -> int | None:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM, RssAnon); None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def in_use(device: torch.device) -> int | None:
    """Bytes this process holds now: CUDA's allocated tensors; on a CPU its anonymous resident memory (a file read
    through a memory map, as the token cache is, is not held: the kernel drops its pages when it needs them)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return proc_status("RssAnon")


def capacity(device: torch.device) -> int | None:
    """Bytes the device has: a GPU's memory, a CPU machine's RAM (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def reset_peak(device) -> int | None:
    """Start measuring a peak; returns the memory in use now (None: this system cannot measure a CPU peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: return freed heap to the OS, or its reuse hides the peak
        with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak resident set (VmHWM) to the current
            f.write("5")
        return proc_status("VmRSS")
    except (OSError, AttributeError):
        return None


def peak_since_reset(device) -> int | None:
    """The peak since reset_peak (or since the process began): CUDA's max allocated, the CPU's resident set (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return proc_status("VmHWM")


def measure_memory(model, batch, autocast=nullcontext) -> dict[str, int | None]:
    """Two AdamW steps on batch (X, Y, loss_mask); the second is measured as a long run sees it (the moments
    exist): bytes of weights, gradients, moments, of the tensors autograd saves for backward (distinct storages,
    weights excluded), and the peak above the memory in use before it (CUDA: max_memory_allocated; CPU: the
    resident set, Linux only)."""
    X, Y, loss_mask = batch
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with autocast():  # the first step allocates the moments
        model(X, Y, loss_mask)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = reset_peak(X.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        _, loss = model(X, Y, loss_mask)
    loss.backward()
    optimizer.step()
    peak = peak_since_reset(X.device)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"weights": nbytes(model.parameters()), "gradients": nbytes(p.grad for p in model.parameters()),
            "adamw": nbytes(v for state in optimizer.state.values() for v in state.values() if v.dim() > 0),
            "activations": sum(saved.values()),
            "peak": None if before is None or peak is None else peak - before}


# -----------------------------------------------------------------------------
# the largest micro-batch that fits

def is_out_of_memory(e: BaseException) -> bool:
    """An allocator's failure: CUDA's OutOfMemoryError, the CPU allocator's and MPS's RuntimeError."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))


def step_peak(model_cfg: ModelConfig, batch_size: int, run, optimizer_name: str, seed: int) -> int | None:
    """Peak bytes of real training steps at batch_size rows of max_seq_len random tokens (measured_step). CUDA: max
    allocated, in this process; CPU: the peak resident set of a fresh process that does only this, as a training
    run's own process is (one that tried other sizes keeps their heap). None: out of memory."""
    if run.device.type == "cuda":
        return measured_step(model_cfg, batch_size, run, optimizer_name, seed)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fresh_process_step, (model_cfg, batch_size, run, optimizer_name, seed))


def fresh_process_step(*args) -> int | None:
    keep_freed_memory()  # the allocator as training sets it up
    return measured_step(*args)


def measured_step(model_cfg: ModelConfig, batch_size: int, run, optimizer_name: str, seed: int) -> int | None:
    """Two training steps, the second measured (the optimizer's state exists): the model, the optimizer, autocast
    and the GradScaler as training has them. The peak since reset_peak; None: out of memory."""
    model = optimizer = X = loss = None
    try:
        torch.manual_seed(seed)
        model = Transformer(model_cfg).to(run.device)
        optimizer = configure_optimizer(model, 0.1, 1e-4, (0.9, 0.95), run.device.type, optimizer_name)
        scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")
        X = torch.randint(0, model_cfg.vocab_size, (batch_size, model_cfg.max_seq_len + 1), device=run.device)
        for i in range(2):
            if i == 1:
                reset_peak(run.device)
            with run.autocast():
                _, loss = model(X[:, :-1], X[:, 1:])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return peak_since_reset(run.device)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        return None
    finally:  # what this size held is freed before the next one is tried
        del model, optimizer, X, loss  # the loss holds the graph, and with it the activations
        gc.collect()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


MARGIN = 0.9  # of the budget a measured step may take: the loop's data, evaluation and checkpoints take the rest


def find_batch_size(model_cfg: ModelConfig, cfg, run, budget: int, report=print) -> int:
    """The largest micro-batch (rows of max_seq_len) up to cfg's per-rank global batch (batch_size x accum_steps)
    whose measured step fits: no out-of-memory error, and a peak within MARGIN of budget bytes. Sizes double from
    1, then bisect between the last that fit and the first that did not; report() gets a line per size tried."""
    tried, limit = {}, cfg.batch_size * cfg.accum_steps

    def fits(size: int) -> bool:
        peak = step_peak(model_cfg, size, run, cfg.optimizer, cfg.seed)
        tried[size] = peak is not None and peak <= MARGIN * budget
        report(f"  batch_size={size:<5d} " + ("out of memory" if peak is None else f"peak {peak / GiB:7.3f} GiB")
               + ("" if tried[size] else "  does not fit"))
        return tried[size]

    good, bad = 0, limit + 1
    for size in itertools.takewhile(lambda s: s < limit, (2**k for k in itertools.count())):
        if not fits(size):
            bad = size
            break
        good = size
    else:
        good, bad = (limit, bad) if fits(limit) else (good, limit)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    if good == 0:
        raise ConfigError(f"not even batch_size=1 fits in {MARGIN * budget / GiB:.2f} GiB: lower max_seq_len, set "
                          "grad_checkpoint=True, or train a smaller model")
    return good


def split_global_batch(fits: int, global_batch: int) -> tuple[int, int]:
    """(batch_size, accum_steps) with batch_size x accum_steps == global_batch and the largest batch_size <= fits."""
    batch_size = max(d for d in range(1, min(fits, global_batch) + 1) if global_batch % d == 0)
    return batch_size, global_batch // batch_size


# -----------------------------------------------------------------------------
# watching a run

class MemoryWatch:
    """Memory in use (in_use: CUDA allocated, CPU anonymous resident), sampled at each log row once SETTLE steps are
    past (the optimizer's state, the allocator's caches); memory that grew at every one of the last WINDOW rows, by
    GROWTH bytes or more, is a leak: one warning line, once."""

    SETTLE, WINDOW, GROWTH = 10, 8, 8 * 2**20

    def __init__(self, device: torch.device, start_step: int):
        self.device, self.after, self.warned = device, start_step + self.SETTLE, False
        self.samples: deque = deque(maxlen=self.WINDOW)

    def sample(self, step: int) -> str | None:
        """The warning line, the first time memory is seen growing; None otherwise."""
        if self.warned or step <= self.after or (now := in_use(self.device)) is None:
            return None
        self.samples.append((step, now))
        (step0, first), (_, last) = self.samples[0], self.samples[-1]
        grew = all(b > a for (_, a), (_, b) in itertools.pairwise(self.samples))
        if len(self.samples) < self.WINDOW or not grew or last - first < self.GROWTH:
            return None
        self.warned = True
        per_100 = (last - first) / (step - step0) * 100
        return (f"warning: memory in use grew at each of the last {self.WINDOW} log rows (steps {step0}-{step}, "
                f"{first / GiB:.2f} -> {last / GiB:.2f} GiB, {per_100 / 2**20:.1f} MiB per 100 steps): a leak? Most "
                "often a tensor kept across steps: a loss summed or appended without .detach() or .item() keeps "
                "its whole graph, a list or a cache that only grows")


def out_of_memory(e: BaseException, step: int, phase: str, shape: tuple | None, device: torch.device):
    """e as an OutOfMemoryError: the step and phase, the batch's shape, the memory in use, what to change."""
    used, total = in_use(device), capacity(device)
    memory = "" if used is None else f"{used / GiB:.2f} GiB in use" + (f" of {total / GiB:.2f}" if total else "")
    batch = f"batch {' x '.join(map(str, shape))}" if shape else "the first batch"
    return OutOfMemoryError(
        f"out of memory on {device} at step {step} ({phase}, {batch}; {memory}): lower batch_size and raise "
        "accum_steps to keep the global batch (python diagnose.py batch_size CONFIG finds the largest that fits), "
        "or set grad_checkpoint=True; the checkpoints written so far are intact")
