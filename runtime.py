"""
The process a script runs in: which device and precision, torchrun's process group, the seeds, printing on
rank 0 only, and Ctrl-C / SIGTERM.

  setup(device, dtype, seed) -> Run     device, autocast dtype, rank and world size; joins torchrun's group
  Run.autocast / no_sync / rank0_first  the precision, DDP's gradient sync, "rank 0 builds the cache first"
  print0, all_reduce_mean, wrap         rank-0 printing, averaging over ranks, DDP (and compile) around a model
  StopSignal                            a signal asks the loop to save and stop between optimizer steps
  allow_open_files                      room for a server's many sockets under the soft open-files limit
"""
import ctypes
import dataclasses
import datetime
import os
import random
import signal
import sys
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from errors import ConfigError


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


DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: pick_dtype's choice for the device


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
        # natively only: V100 and T4 emulate bfloat16, slower than float16 with its GradScaler
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    if device_type == "mps":
        return "bfloat16" if torch.backends.mps.is_macos_or_newer(14, 0) else "float16"
    return "float32"


def cpu_info() -> dict[str, str]:
    """The first CPU's fields in Linux's /proc/cpuinfo (model name, vendor_id, flags, ...); {} where there is none."""
    if not os.path.exists("/proc/cpuinfo"):
        return {}
    with open("/proc/cpuinfo") as f:
        first_cpu = [line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line]
    return {k.strip(): v.strip() for k, v in first_cpu}


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


# how long a rank waits for the others in a collective: rank 0 tokenises a corpus alone (at a few MB/s per
# process) while the others wait at a barrier, which NCCL's default of 10 minutes would abort
PROCESS_GROUP_TIMEOUT = datetime.timedelta(hours=4)


def allow_open_files(n: int) -> int:
    """Raise the process's soft limit on open files (often 1024) toward n, as far as the hard limit allows (a server's
    connections, a flood's sockets); -> the files it may hold now."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to raise
        return n
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        soft = n if hard == resource.RLIM_INFINITY else min(n, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return n if soft == resource.RLIM_INFINITY else soft


def open_device(device: str, dtype: str) -> Run:
    """The device (auto: pick_device) made current and the dtype it runs well (auto: pick_dtype), for one
    process: what sampling, serving and evaluation need (setup() adds torchrun's ranks and the seeds)."""
    run = Run(torch.device(pick_device(device)), dtype)
    if run.device.type == "cuda" and (run.device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
                          + ("" if torch.cuda.is_available() else " (this torch has no CUDA, or no GPU is visible)"))
    if run.device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device}: MPS is not available on this machine")
    if run.device.type == "cuda":
        if run.device.index is not None:  # before any other CUDA call: its context, events, the dtype query
            torch.cuda.set_device(run.device)
        torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls: Ampere's tensor cores
    run.dtype = pick_dtype(dtype, run.device.type)
    return run


def setup(device: str, dtype: str, seed: int) -> Run:
    """Pick device and precision, join torchrun's process group if launched by it, and seed every RNG.
    Every rank seeds alike (the model starts identical everywhere); call seed_rank() after building it."""
    device = pick_device(device)
    torchrun = "RANK" in os.environ
    if torchrun and torch.device(device).type == "cuda":
        device = f"cuda:{os.environ['LOCAL_RANK']}"  # each rank its own GPU
    run = open_device(device, dtype)
    if torchrun:
        run.rank, run.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        run.world_size = int(os.environ["WORLD_SIZE"])
    if run.device.type == "cpu":
        keep_freed_memory()
    if run.ddp:  # join the group or fail, never train unsynchronised
        cuda = run.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=run.device if cuda else None,
                                timeout=PROCESS_GROUP_TIMEOUT)
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


def wrap(model, cfg, run: Run):
    """The model the loop trains: compiled if asked (compile=None: on CUDA), DDP-wrapped under torchrun. Keep the
    unwrapped one too."""
    if cfg.compile or (cfg.compile is None and run.device.type == "cuda"):
        model = torch.compile(model)
    if run.ddp:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        # the only buffers are the RoPE tables, derived from the config alike on every rank: not re-sent each forward
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    return model


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop asks after every optimizer step and, once it is set, saves and exits:
    within one step on one process, two under DDP. The ranks must leave together, so each step's flag rides on a
    collective the step makes anyway (vote() joins the loss's all-reduce); on CUDA requested() reads the step
    before's result, which is on the host by then: no extra collective and no wait for the GPU."""

    def __init__(self, run: Run):
        self.run, self.received, self.step = run, False, 0
        self.pending = None  # CUDA under DDP: (the votes copied to the host, the event that says they are there)
        self.previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self):
        """Give the signals back (a process that goes on after training, e.g. a notebook, gets Ctrl-C back)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        if self.received:  # a second Ctrl-C: the user means it
            raise KeyboardInterrupt
        self.received = True
        print(f"\nreceived signal {signum} during step {self.step + 1}: saving a checkpoint after it, then exiting",
              file=sys.stderr, flush=True)

    def vote(self) -> torch.Tensor:
        """1.0 if this rank got a signal, else 0.0: all-reduce it with the step's loss and pass it to requested().
        A fill on the device: no host-to-device copy to wait for."""
        return torch.full((), float(self.received), device=self.run.device)

    def requested(self, votes: torch.Tensor | float, step: int) -> bool:
        """After every optimizer step: stop now? votes: this step's vote(), summed or averaged over the ranks (a
        tensor, or its value where the loop reads it anyway). All ranks answer alike, so no rank leaves the loop
        while another waits in a collective."""
        self.step = step
        if not self.run.ddp:
            stop = self.received
        elif isinstance(votes, float) or self.run.device.type != "cuda":
            stop = float(votes) > 0  # on the host already: no wait
        else:  # the step before's votes, copied as that step finished; this step's are copied for the next call
            stop = False
            if self.pending is not None:
                host_votes, copied = self.pending
                copied.synchronize()  # long done: only this step's work is still queued
                stop = host_votes.item() > 0
            self.pending = votes.to("cpu", non_blocking=True), torch.cuda.Event()
            self.pending[1].record()
        if stop:
            print0(f"stopped at step {step}; continue with --resume=True")
        return stop
