"""
What a timing needs around it on a shared machine, where the speed of the same work moves from second to second:
the fastest and the median of repeated measurements, the spread of ratios taken in turns, the best matmul peak
sampled over a run (BestPeak), how many cores other processes kept busy meanwhile (OtherLoad), calls per second,
a subprocess's own figures and its peak memory, and what the machine is.
"""
import json
import os
import platform
import resource
import statistics
import subprocess
import time

import torch

from runtime import cpu_info


def fastest_and_median(steps: list, speed) -> tuple:
    """The fastest of the timed steps by speed(step), and the median one (the lower median)."""
    by_speed = sorted(steps, key=speed)
    return by_speed[-1], by_speed[(len(by_speed) - 1) // 2]


def spread(name: str, ratios) -> dict[str, float]:
    """Ratios measured round by round as {name: their median, name_min: the smallest, name_max: the largest}."""
    ratios = sorted(ratios)
    return {name: statistics.median(ratios), f"{name}_min": ratios[0], f"{name}_max": ratios[-1]}


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process on the machine has used since boot, those of this process and its children): the
    difference over a run is what other processes took from it."""
    if not os.path.exists("/proc/stat"):  # not Linux: unknown
        return float("nan"), 0.0
    with open("/proc/stat") as f:  # cpu  user nice system idle iowait irq softirq steal ...
        user, nice, system, _, _, irq, softirq = map(int, f.readline().split()[1:8])
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), sum(r.ru_utime + r.ru_stime for r in own)


class BestPeak:
    """peak(device, dtype) -> the best matmul FLOP/s of all samples so far, after `repeats` more samples of
    measure(device, dtype) (again=False: only while there are none yet); .best holds them by "device/dtype". On a
    shared machine the fastest step compares like with like against the fastest matmul of the same minutes."""

    def __init__(self, measure, repeats: int):
        self.measure, self.repeats, self.best = measure, repeats, {}

    def __call__(self, device, dtype: str, again: bool = True) -> float:
        name = f"{device}/{dtype}"
        if not again and name in self.best:
            return self.best[name]
        sample = max(self.measure(device, dtype) for _ in range(self.repeats))
        self.best[name] = max(sample, self.best.get(name, 0.0))
        print(f"peak {dtype} matmul on {device}: {sample / 1e9:.1f} GFLOP/s (best so far {self.best[name] / 1e9:.1f})")
        return self.best[name]


class OtherLoad:
    """with OtherLoad() as load: ... -- then load.cores is how many cores other processes kept busy while the block
    ran (from /proc/stat: a VM's neighbours on the same host do not show in it; nan without it)."""

    def __enter__(self):
        self.start, self.t0 = cpu_seconds(), time.time()
        return self

    def __exit__(self, *exc):
        (all0, own0), (all1, own1), seconds = self.start, cpu_seconds(), time.time() - self.t0
        self.cores = ((all1 - all0) - (own1 - own0)) / seconds


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, from /proc (0 where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:  # "pid (comm) state ppid ...": comm may hold spaces
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:  # size resident ... in pages
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total


def measured_process(argv: list[str], cwd: str, out_path: str, what: str, interval: float = 0.05) -> tuple[dict, int]:
    """Run argv, a process that prints its own measurements as a JSON object on its last line of output (kept in
    out_path) -> (that object, the largest resident bytes of the process and its descendants, sampled every
    interval seconds: 0 without /proc). A failed run is a RuntimeError: "{what} failed"."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(interval)
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit status {proc.returncode})")
    with open(out_path) as f:
        return json.loads(f.read().strip().splitlines()[-1]), peak


def calls_per_second(fn, min_calls: int = 10, min_seconds: float = 2.0) -> float:
    """Calls of fn() per second, calling it at least min_calls times and for at least min_seconds."""
    n, t0 = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - t0 < min_seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def machine() -> dict:
    """CPU model, cores, the AVX-512 flags that matter to matmul speed, torch version and threads."""
    cpu, flags = platform.processor() or platform.machine(), set()
    info = cpu_info()
    if info:
        cpu, flags = info.get("model name", cpu), set(info.get("flags", "").split())
    flags &= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": sorted(flags),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
