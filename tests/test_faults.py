"""Faults caused for real: kill -9 after an evaluation and in the middle of saves, SIGTERM with no log line for
thousands of steps (one process, and one rank of two), a full disk (a small tmpfs), hostile checkpoints given to
every script that reads one, and resumes with other batches or data. What survives what: docs/training.md."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import convert
import diagnose
import eval as eval_script
import eval_demo
import sample
import serve
import train_distill
import train_dpo
import train_grpo
import train_pretrain
import train_reward
import train_sft
from checkpoint import load_checkpoint
from conftest import REPO, TINY_MODEL, TINY_RUN, final_weights, read_metrics, run_script
from data import PromptLoader
from errors import CheckpointError
from faults import run_on_small_disk
from test_resume import logged

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # runs compared bit for bit split their reductions alike


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pretrain_argv(demo_dir, out_dir, *flags) -> list[str]:
    return ["train_pretrain.py", f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out_dir}", *TINY_MODEL,
            *TINY_RUN, "--batch_size=8", "--lr=3e-3", "--warmup_steps=3", *flags]


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def start():
    """start(argv, log_path): a script as a process in its own process group, killed at the test's end if still
    running, with every process below it (torchrun starts each worker in a session of its own)."""
    started = []

    def start(argv: list[str], log_path) -> subprocess.Popen:
        with open(log_path, "w") as log:
            started.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=ENV, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            workers = worker_pids(proc.pid)  # before the kill: orphans are no longer below it
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def saved_step(path) -> int:
    """The step a checkpoint file holds, read with torch itself."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The run failed as a user's mistake does: exit 2 and one `error:` line, no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def assert_same_run(full, resumed, last: int):
    assert logged(resumed) == logged(full)  # every row once, bit-identical (wall-clock figures aside)
    a, b = final_weights(full, last), final_weights(resumed, last)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- kill -9 ------------------------------------------------------------------------------------------

def test_a_run_killed_after_an_evaluation_resumes_from_its_best_pt(demo_dir, tmp_path, start):
    argv = lambda out, *more: pretrain_argv(demo_dir, out, "--max_steps=40", "--eval_interval=4",  # noqa: E731
                                            "--save_interval=1000", *more)
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert run(argv(full)).returncode == 0
    proc = start(argv(killed), tmp_path / "killed.log")
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 6 for r in safe_rows(killed)):
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-2000:]
        time.sleep(0.005)
    proc.kill()  # SIGKILL: no handler runs, nothing is saved
    proc.wait()
    assert sorted(p.name for p in killed.glob("*.pt")) == ["best.pt"]  # evaluations saved it, no step came yet
    best_step = saved_step(killed / "best.pt")
    written = (killed / "metrics.jsonl").read_text(encoding="utf-8")
    assert max(r["step"] for r in safe_rows(killed)) > best_step  # the kill cost work after best.pt

    fresh = one_error_line(run(argv(killed)))
    assert fresh.startswith(f"error: {killed} already holds checkpoints (best.pt): pass --resume=True")
    resumed = run(argv(killed, "--resume=True"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed / 'best.pt'} at step {best_step}" in resumed.stdout
    assert (killed / "metrics.jsonl").read_text(encoding="utf-8").startswith(written)  # it only grew
    assert_same_run(full, killed, 40)
    a, b = (load_checkpoint(str(d / "best.pt")) for d in (full, killed))
    assert (a["step"], a["early_stopping"]) == (b["step"], b["early_stopping"])


def safe_rows(out_dir) -> list[dict]:
    """The rows another process has written so far (its last line may be half written)."""
    path = out_dir / "metrics.jsonl"
    return read_metrics(out_dir) if path.exists() else []


def test_kill_9_in_the_middle_of_saves_costs_only_the_save_it_cut(demo_dir, tmp_path, start):
    """Killed the moment a temp file shows a save under way, four times: each resume continues from the newest
    checkpoint complete on disk (a best.pt as well as a step_*.pt), and the run ends as an uninterrupted one."""
    argv = lambda out, *more: pretrain_argv(demo_dir, out, "--max_steps=30", "--eval_interval=2",  # noqa: E731
                                            "--save_interval=3", "--keep_checkpoints=2", *more)
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert run(argv(full)).returncode == 0
    expected = None  # the step the next run must resume at (None: the first run, fresh)
    for attempt in range(5):
        log, stale = tmp_path / f"attempt{attempt}.log", temp_files(killed)  # the last kill's: not a save under way
        proc = start(argv(killed, *["--resume=True"] * (attempt > 0)), log)
        deadline, saves, cut = time.time() + 120, set(), False
        while proc.poll() is None and not cut:
            saves |= temp_files(killed) - stale
            cut = attempt < 4 and len(saves) >= 2 + attempt  # a later save each time: each resume gets further
            assert time.time() < deadline, log.read_text()[-2000:]
        if cut:
            proc.kill()
        assert proc.wait() in (0, -signal.SIGKILL), log.read_text()[-2000:]
        if expected is not None:
            said = "resumed from" if expected else "holds no checkpoint yet"
            assert re.search(rf"resumed from \S+ at step {expected}\b" if expected else said, log.read_text()), \
                (expected, log.read_text()[-2000:])
        complete = [saved_step(p) for p in killed.glob("*.pt")]
        expected = max(complete, default=0)
        if not cut:
            break
    assert attempt == 4 and expected == 30 and not list(killed.glob("*.tmp"))  # four kills, then to the end
    assert_same_run(full, killed, 30)


def temp_files(out_dir) -> set:
    """(name, inode) of the temp files of saves in out_dir."""
    try:
        return {(e.name, e.inode()) for e in os.scandir(out_dir) if e.name.endswith(".pt.tmp")}
    except FileNotFoundError:
        return set()


# --- SIGTERM: saved within the step it arrives in, whatever log_interval is ------------------------------

NO_LOG = ["--max_steps=1000000", "--log_interval=100000", "--eval_interval=100000", "--save_interval=100000"]


def signal_and_stop_steps(output: str) -> tuple[int, int]:
    received = re.search(r"received signal 15 during step (\d+)", output)
    stopped = re.search(r"stopped at step (\d+)", output)
    assert received and stopped, output[-3000:]
    return int(received[1]), int(stopped[1])


def wait_for_training(proc, log, pid: int, seconds: float = 3):
    """Until process pid catches SIGTERM (its loop is about to start: the handler that saves and stops is in place;
    under load one rank can be seconds behind the other), then a few seconds more."""
    wait_until(proc, log, lambda: catches_sigterm(pid))
    time.sleep(seconds)


def wait_until(proc, log, found):
    """found()'s first true value, polled while the run is alive, for two minutes at most."""
    deadline = time.time() + 120
    while not (value := found()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    return value


def catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (bit 15 of /proc's SigCgt mask): before it, the signal kills it."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:  # it has exited: the caller's poll() says so with the log
        return False
    return bool(int(re.search(r"SigCgt:\s*([0-9a-f]+)", status)[1], 16) >> (signal.SIGTERM - 1) & 1)


def test_sigterm_saves_after_the_step_it_arrives_in_with_no_log_line_for_thousands_of_steps(demo_dir, tmp_path, start):
    log = tmp_path / "run.log"
    proc = start(pretrain_argv(demo_dir, tmp_path / "out", *NO_LOG), log)
    wait_for_training(proc, log, proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    received, stopped = signal_and_stop_steps(log.read_text())
    assert stopped == received  # one process: the step under way is the last
    assert [p.name for p in (tmp_path / "out").glob("step_*.pt")] == [f"step_{stopped:07d}.pt"]


def test_sigterm_to_one_rank_stops_both_ranks_within_a_step(demo_dir, tmp_path, start):
    log, out = tmp_path / "run.log", tmp_path / "out"
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *pretrain_argv(demo_dir, out, *NO_LOG)]
    proc = start(argv, log)
    rank1 = worker_with_rank(proc, log, "1")
    wait_for_training(proc, log, rank1)
    os.kill(rank1, signal.SIGTERM)  # rank 1 alone: rank 0 must learn of it from the step's collective
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    received, stopped = signal_and_stop_steps(log.read_text())
    assert stopped - received in (0, 1)  # the vote rides on the step's all-reduce: the next step at the latest
    assert [p.name for p in out.glob("step_*.pt")] == [f"step_{stopped:07d}.pt"]


def worker_with_rank(proc, log, rank: str) -> int:
    """The pid of torchrun's worker with that RANK, once it has started."""
    pids = wait_until(proc, log, lambda: [pid for pid in worker_pids(proc.pid) if environ(pid).get("RANK") == rank])
    assert len(pids) == 1, pids
    return pids[0]


def worker_pids(parent: int) -> list[int]:
    """Every process below parent (torchrun's workers)."""
    found, frontier = [], [parent]
    while frontier:
        pid = frontier.pop()
        try:
            children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        except OSError:  # exited since its parent listed it
            continue
        for child in children:
            found.append(int(child))
            frontier.append(int(child))
    return found


def environ(pid: int) -> dict:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


# --- a full disk ----------------------------------------------------------------------------------------

def test_a_full_disk_is_one_error_line_and_what_was_saved_resumes(demo_dir, tmp_path):
    """The run's out_dir on an 8 MB tmpfs: two checkpoints (~2.8 MB each) fit, the third save does not. The run
    stops with one line and no temp file; a resume on the still-full disk does too; a copy of what is left
    resumes elsewhere and ends as an uninterrupted run."""
    mount, keep, full = tmp_path / "disk", tmp_path / "keep", tmp_path / "full"
    mount.mkdir()
    keep.mkdir()
    argv = lambda out, *more: pretrain_argv(demo_dir, out, "--max_steps=12", "--eval_interval=2",  # noqa: E731
                                            "--save_interval=2", "--keep_checkpoints=5", *more)
    train = " ".join(f"'{a}'" for a in [sys.executable, *argv(mount / "out")])
    script = (f"cd {REPO}\n"
              f"{train} > {keep}/first.out 2> {keep}/first.err; echo $? > {keep}/first.rc\n"
              f"ls -a {mount}/out > {keep}/listing\n"
              f"{train} --resume=True > {keep}/second.out 2> {keep}/second.err; echo $? > {keep}/second.rc\n"
              f"ls -a {mount}/out > {keep}/listing2\n"
              f"cp -a {mount}/out {keep}/out\n")
    done = run_on_small_disk(script, mount, "8m", env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr
    for attempt in ("first", "second"):
        result = subprocess.CompletedProcess([], int((keep / f"{attempt}.rc").read_text()),
                                             (keep / f"{attempt}.out").read_text(), (keep / f"{attempt}.err").read_text())
        assert one_error_line(result).startswith(f"error: no space left on the device to write {mount}/out/")
    for listing in ("listing", "listing2"):
        assert not [name for name in (keep / listing).read_text().split() if ".tmp" in name]
    saved = keep / "out"
    steps = {p.name: load_checkpoint(str(p))["step"] for p in saved.glob("*.pt")}  # every one complete
    assert steps and max(steps.values()) < 12
    assert run(argv(full)).returncode == 0
    resumed = run(argv(saved, "--resume=True"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {max(steps.values())}" in resumed.stdout
    assert_same_run(full, saved, 12)


# --- hostile checkpoints --------------------------------------------------------------------------------

class RunsACommand:
    """What a malicious .pt holds: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def hostile(tiny_sft, tmp_path_factory):
    """A real SFT checkpoint with a pickled os.system call in it, the marker file that call would create, and a
    folder to run in."""
    where = tmp_path_factory.mktemp("hostile")
    marker = where / "ran"
    state = load_checkpoint(str(tiny_sft))
    state["config"]["note"] = RunsACommand(f"touch {marker}")
    torch.save(state, where / "shared.pt")
    (where / "run").mkdir()
    torch.save(state, where / "run" / "step_0000005.pt")  # a run folder someone shared, to resume
    return where / "shared.pt", marker, where


def hostile_uses(ckpt, good, demo_dir, where) -> dict:
    """Every script that reads a checkpoint, given the hostile one where it reads it."""
    sft_data, dpo_data = f"--data_path={demo_dir}/sft.jsonl", f"--data_path={demo_dir}/dpo.jsonl"
    out = f"--out_dir={where}/out"
    return {
        "sample": (sample, [f"--ckpt={ckpt}", "--prompt=hi", "--device=cpu"]),
        "serve": (serve, [f"--ckpt={ckpt}", "--port=0", "--device=cpu"]),
        "convert export": (convert, ["export", str(ckpt), str(where / "exported")]),
        "eval bpb": (eval_script, ["bpb", f"--ckpt={ckpt}", f"--data_path={demo_dir}/pretrain.jsonl", *TINY_RUN[:2]]),
        "eval pairs": (eval_script, ["pairs", f"--ckpt={ckpt}", dpo_data, *TINY_RUN[:2]]),
        "eval_demo": (eval_demo, [str(ckpt)]),
        "diagnose experts": (diagnose, ["experts", f"--ckpt={ckpt}", *TINY_RUN[:2], f"--out_dir={where}/diag"]),
        "sft init_from": (train_sft, [f"--init_from={ckpt}", sft_data, out, *TINY_RUN]),
        "dpo ref_from": (train_dpo, [f"--init_from={good}", f"--ref_from={ckpt}", dpo_data, out, *TINY_RUN]),
        "reward init_from": (train_reward, [f"--init_from={ckpt}", dpo_data, out, *TINY_RUN]),
        "grpo reward_model": (train_grpo, [f"--init_from={good}", f"--reward_model={ckpt}", "--reward=none",
                                           "--max_new_tokens=8", f"--data_path={demo_dir}/rl.jsonl", out, *TINY_RUN]),
        "distill teacher": (train_distill, [f"--teacher={ckpt}", f"--data_path={demo_dir}/pretrain.jsonl", out,
                                            *TINY_MODEL, *TINY_RUN]),
        "pretrain resume": (train_pretrain, [f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={where}/run",
                                             "--resume=True", *TINY_MODEL, *TINY_RUN]),
    }


USES = ["sample", "serve", "convert export", "eval bpb", "eval pairs", "eval_demo", "diagnose experts",
        "sft init_from", "dpo ref_from", "reward init_from", "grpo reward_model",
        "distill teacher", "pretrain resume"]


@pytest.mark.parametrize("use", USES)
def test_a_checkpoint_carrying_a_pickled_call_is_refused_and_runs_nothing(use, hostile, tiny_sft, demo_dir):
    ckpt, marker, where = hostile
    script, argv = hostile_uses(ckpt, tiny_sft, demo_dir, where)[use]
    with pytest.raises(CheckpointError, match=r"holds a Python object \(posix\.system\).*nothing in it was run"):
        script.main(argv)
    assert not marker.exists()


def test_a_hostile_checkpoint_is_one_error_line(hostile):
    ckpt, marker, _ = hostile
    line = one_error_line(run_script("sample.py", f"--ckpt={ckpt}", "--prompt=hi"))
    assert line == (f"error: {ckpt} holds a Python object (posix.system), not only tensors, numbers and strings: "
                    "refused, and nothing in it was run (a checkpoint is loaded with weights_only)")
    assert not marker.exists()


def test_a_hostile_dpo_reference_cache_is_computed_again_and_runs_nothing(tiny_sft, demo_dir, tmp_path):
    data = tmp_path / "dpo.jsonl"
    data.write_text("".join((demo_dir / "dpo.jsonl").read_text(encoding="utf-8").splitlines(True)[:40]), "utf-8")
    argv = [f"--init_from={tiny_sft}", f"--data_path={data}", *TINY_RUN, "--batch_size=4", "--max_steps=1",
            "--precompute_ref=True", "--max_prompt_length=32", "--max_completion_length=32"]
    train_dpo.main([*argv, f"--out_dir={tmp_path / 'a'}"])
    (cache,) = tmp_path.glob("dpo.jsonl.ref-*.pt")
    tables = torch.load(cache, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**tables, "note": RunsACommand(f"touch {marker}")}, cache)
    train_dpo.main([*argv, f"--out_dir={tmp_path / 'b'}"])
    assert not marker.exists()
    again = torch.load(cache, weights_only=True)  # written anew: tensors only
    assert again.keys() == tables.keys() and all(torch.equal(again[k], tables[k]) for k in tables)


@pytest.mark.parametrize("held, what", [({"wq": torch.zeros(2)}, "a dict of 1 entries (wq)"),
                                        (torch.zeros(3), "a Tensor"),
                                        ({"model": {}, "step": 3}, "a dict of 2 entries (model, step)")])
def test_an_init_from_that_is_not_a_checkpoint_is_one_error_line(held, what, demo_dir, tmp_path):
    torch.save(held, tmp_path / "other.pt")
    line = one_error_line(run_script("train_sft.py", f"--init_from={tmp_path / 'other.pt'}",
                                     f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={tmp_path / 'out'}", *TINY_RUN))
    assert line.startswith(f"error: {tmp_path / 'other.pt'} is not a nanomind checkpoint: it holds {what}, not the")


# --- a resume with other batches, data or ranks ---------------------------------------------------------

def test_the_position_maps_onto_another_batch_size_or_number_of_ranks_as_the_same_items():
    """Each of 2 ranks took every other item of each global batch of 2 x 3; after 4 batches the run resumes with
    1 rank x 4 (and 3 ranks x 4): the items then taken are exactly the rest of the same epoch's order."""
    prompts = list(range(50))
    order = PromptLoader(prompts, 6, 0).order(0)
    ranks = [PromptLoader(prompts, 3, 0, rank=r, world_size=2) for r in range(2)]
    for _ in range(4):
        for loader in ranks:
            loader.next_batch()
    state = ranks[0].state_dict()
    for world in (1, 3):
        after = [PromptLoader(prompts, 4, 0, rank=r, world_size=world) for r in range(world)]
        for loader in after:
            loader.load_state_dict(state)
        taken = [i for _ in range(2) for loader in after for i in loader.next_batch()]
        assert sorted(taken) == sorted(int(i) for i in order[24 : 24 + 8 * world])


def test_a_position_inside_a_batch_or_other_data_is_refused_in_one_line():
    prompts = list(range(50))
    loader = PromptLoader(prompts, 6, 0, name="training prompts")
    for _ in range(3):
        loader.next_batch()
    with pytest.raises(CheckpointError, match=r"took 6 per batch .* stopped 18 into epoch 0, which this run's 4 "):
        PromptLoader(prompts, 4, 0, name="training prompts").load_state_dict(loader.state_dict())
    with pytest.raises(CheckpointError, match=r"^training prompts: the checkpoint's run had 50, this run has 40"):
        PromptLoader(prompts[:40], 6, 0, name="training prompts").load_state_dict(loader.state_dict())


def test_a_resume_with_another_batch_size_or_a_smaller_data_file_continues_or_is_one_line(demo_dir, tmp_path):
    out, small = tmp_path / "out", tmp_path / "small.jsonl"
    argv = lambda *more: pretrain_argv(demo_dir, out, "--eval_interval=100", *more)  # noqa: E731
    assert run(argv("--max_steps=5")).returncode == 0  # 40 windows into the epoch
    inside = one_error_line(run(argv("--max_steps=8", "--batch_size=16", "--resume=True")))
    assert inside.startswith("error: training windows: the checkpoint's run took 8 per batch (batch_size x ranks) "
                             "and stopped 40 into epoch 0, which this run's 16 (16 x 1 rank(s)) does not divide")
    small.write_text("".join((demo_dir / "pretrain.jsonl").read_text(encoding="utf-8").splitlines(True)[:500]), "utf-8")
    fewer = one_error_line(run(argv("--max_steps=8", "--resume=True", f"--data_path={small}")))
    assert re.match(r"error: training windows: the checkpoint's run had [\d,]+, this run has [\d,]+: resume on the "
                    r"data it trained on", fewer)
    halved = run(argv("--max_steps=8", "--batch_size=4", "--resume=True"))
    assert halved.returncode == 0, halved.stderr[-3000:]
    assert "batches of 8 before, 4 now (batch_size x ranks): resuming 40 into epoch 0, at batch 10" in halved.stdout
