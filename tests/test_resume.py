"""Resume: a run stopped by SIGTERM, or lost after its last checkpoint, goes on with --resume=True as if it had never
stopped: each logged value bit-identical, the same weights, each metrics row once; every stage, LoRA, float16."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train_dpo
import train_grpo
import train_pretrain
import train_sft
from checkpoint import load_checkpoint
from conftest import (REPO, TINY_MODEL, TINY_RUN, assert_resumes_exactly, final_weights, lora_sft, pretrain,
                      pretrain_short, read_metrics, repeatable, sft, train_losses)
from errors import CheckpointError
from metrics import measure_peak_flops

SCRIPTS = {"pretrain": train_pretrain, "sft": train_sft, "dpo": train_dpo, "grpo": train_grpo}
DEFAULT_PEAK = [flag for flag in TINY_RUN if not flag.startswith("--peak_flops")]  # measured, as users run it
WALL_CLOCK = ("tokens_per_s", "mfu", "mem_gb", "elapsed_s", "eta_s")  # with frac_*: differ between any two runs


@pytest.fixture(autouse=True)
def one_thread():
    """Runs compared bit for bit must split their reductions alike: one intra-op thread, here and in the runs
    started as processes (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stage_flags(stage: str, request, tmp_path) -> list[str]:
    """A tiny run of a stage with dropout 0.1, so that the restored RNG states matter, on the first records of the demo
    file, 20% held out: 6 batches per epoch, so that runs cross epoch ends (pretraining: 37 documents, ~100 training
    windows of 33 tokens, in 16s; SFT, DPO: 48 conversations or pairs, in 8s; GRPO: 48 prompts, groups of 4 sampled
    completions). SFT, DPO and GRPO start from the session's tiny models; early stopping is off, so every run has
    its full length."""
    lines = (request.getfixturevalue("demo_dir") / f"{stage}.jsonl").read_text(encoding="utf-8").splitlines(True)
    data = tmp_path / f"{stage}.jsonl"
    data.write_text("".join(lines[: 37 if stage == "pretrain" else 60]), encoding="utf-8")
    common = [f"--data_path={data}", *DEFAULT_PEAK, "--val_fraction=0.2", "--dropout=0.1", "--eval_interval=4"]
    if stage == "pretrain":
        return [*common, *TINY_MODEL, "--batch_size=16", "--lr=3e-3", "--warmup_steps=3"]
    finetune = [*common, "--batch_size=8", "--early_stopping_patience=1000"]
    if stage == "sft":
        return [*finetune, f"--init_from={request.getfixturevalue('tiny_pretrained')}", "--lr=5e-3", "--max_seq_len=64"]
    if stage == "grpo":
        return [*finetune, f"--init_from={request.getfixturevalue('tiny_sft')}", "--lr=1e-3", "--warmup_steps=0",
                "--group_size=4", "--max_new_tokens=8", "--beta=0.1"]
    return [*finetune, f"--init_from={request.getfixturevalue('tiny_sft')}", "--lr=1e-3", "--warmup_steps=0",
            "--max_prompt_length=32", "--max_completion_length=32"]


def logged(out_dir) -> list[dict]:
    """metrics.jsonl's rows in order, without the wall-clock figures: what a resume must reproduce exactly."""
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK and not k.startswith("frac_")}
            for row in read_metrics(out_dir)]


def assert_same_run(full, resumed, max_steps: int):
    rows = logged(resumed)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, max_steps + 1))  # each step once, in order
    assert train_losses(resumed) == train_losses(full)  # bit-identical (==), the short message if not
    assert rows == logged(full)  # and every lr, grad norm, reward, evaluation: each row once, equal
    a, b = final_weights(full, max_steps), final_weights(resumed, max_steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_checkpoint(str(resumed / f"step_{max_steps:07d}.pt"))["model_config"]["dropout"] == 0.1


def complete_rows(path) -> list[str]:
    """The lines of a file another process appends to, without a last line it may be writing."""
    return path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []


def run_until_sigterm(stage: str, argv: list[str], out_dir, after_step: int, log_path) -> int:
    """Run a stage as a process and SIGTERM it once metrics.jsonl holds the training row of after_step; the step it
    says it stopped at."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, f"train_{stage}.py"), *argv], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while not any(f'"step": {after_step}, "loss"' in line for line in complete_rows(out_dir / "metrics.jsonl")):
            if proc.poll() is not None:
                pytest.fail(f"the run ended before step {after_step}:\n{log_path.read_text()[-2000:]}")
            if time.time() > deadline:
                proc.kill()
                pytest.fail(f"no step {after_step} after 120 s")
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-2000:]
    stopped = [line for line in log_path.read_text().splitlines() if line.startswith("stopped at step")]
    if not stopped:
        pytest.fail("the run finished before SIGTERM reached it: make it longer")
    return int(stopped[0].split()[3].rstrip(";"))


def test_measuring_the_peak_flops_draws_nothing_from_the_global_generators():
    before = torch.get_rng_state()
    assert measure_peak_flops(torch.device("cpu"), "float32", n=512) > 0
    assert torch.equal(torch.get_rng_state(), before)


# --- stopped by SIGTERM, resumed in the same out_dir ----------------------------------------------

@pytest.mark.parametrize("stage, flags", [("pretrain", []), ("sft", []), ("dpo", ["--precompute_ref=True"]),
                                         ("grpo", ["--ppo_epochs=2"])])
def test_a_run_stopped_by_sigterm_resumes_in_its_out_dir_exactly(stage, flags, request, tmp_path):
    argv = [*stage_flags(stage, request, tmp_path), *flags, "--max_steps=20"]
    stopped, full = tmp_path / "stopped", tmp_path / "full"
    step = run_until_sigterm(stage, [*argv, f"--out_dir={stopped}"], stopped, 5, tmp_path / "stopped.log")
    assert 5 <= step < 20, f"stopped at step {step} of 20: SIGTERM came too late to stop the run midway"
    assert [p.name for p in stopped.glob("step_*.pt")] == [f"step_{step:07d}.pt"]  # the stop saved it, nothing else
    SCRIPTS[stage].main([*argv, f"--out_dir={stopped}", "--resume=True"])
    SCRIPTS[stage].main([*argv, f"--out_dir={full}"])
    assert_same_run(full, stopped, 20)


# --- lost after its last checkpoint, just before and exactly at an epoch end ----------------------

@pytest.mark.parametrize("stage", ["pretrain", "sft", "dpo", "grpo"])  # DPO, GRPO: the reference model on the fly
def test_a_resume_before_and_at_an_epoch_end_replaces_the_later_rows_exactly(stage, request, tmp_path):
    argv = [*stage_flags(stage, request, tmp_path), "--max_steps=14", "--save_interval=1", "--keep_checkpoints=100"]
    if stage == "sft":  # a conversation per row, 6 batches an epoch; packed rows resume alike (test_pack.py)
        argv.append("--pack=False")
    full = tmp_path / "full"
    SCRIPTS[stage].main([*argv, f"--out_dir={full}"])
    position = {s: {k: load_checkpoint(str(full / f"step_{s:07d}.pt"))["loader"][k] for k in ("epoch", "pos")}
                for s in (6, 7, 11, 12, 13)}
    # epochs end at steps 6 and 12; the loader starts the next one in the batch after an epoch's last
    assert position == {6: {"epoch": 0, "pos": 6}, 7: {"epoch": 1, "pos": 1}, 11: {"epoch": 1, "pos": 5},
                        12: {"epoch": 1, "pos": 6}, 13: {"epoch": 2, "pos": 1}}
    for last_saved in (11, 12):  # as if the run had died after its last row, step 11's (12's) checkpoint its latest
        resumed = tmp_path / f"from_{last_saved}"
        os.makedirs(resumed)
        shutil.copy(full / f"step_{last_saved:07d}.pt", resumed)
        shutil.copy(full / "metrics.jsonl", resumed)  # rows after the checkpoint: the resumed run writes them again
        SCRIPTS[stage].main([*argv, f"--out_dir={resumed}", "--resume=True"])
        assert_same_run(full, resumed, 14)


# --- lost after its last checkpoint: pretraining, SFT, LoRA SFT, float16 --------------------------

def test_resume_continues_exactly_as_an_uninterrupted_run(demo_dir, tmp_path, device):
    flags = repeatable(device, "--max_steps=12", "--save_interval=5", "--keep_checkpoints=10", "--eval_interval=4")
    assert_resumes_exactly(lambda out, *more: pretrain(demo_dir, out, *flags, *more), tmp_path / "full",
                           tmp_path / "resumed", saved=5, last=12)


def test_sft_resume_continues_exactly(tiny_pretrained, demo_dir, tmp_path):
    flags = ["--max_steps=10", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=5"]
    assert_resumes_exactly(lambda out, *more: sft(tiny_pretrained, demo_dir, out, *flags, *more), tmp_path / "full",
                           tmp_path / "resumed", saved=4, last=10)


def test_lora_sft_resumes_exactly(tiny_pretrained, demo_dir, tmp_path):
    resumed = tmp_path / "resumed"
    flags = ["--max_steps=8", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=4", "--lora_dropout=0.1"]
    assert_resumes_exactly(lambda out, *more: lora_sft(tiny_pretrained, demo_dir, out, *flags, *more),
                           tmp_path / "full", resumed, saved=4, last=8)
    with pytest.raises(CheckpointError, match="LoRA checkpoint but this run is full"):  # lora_rank dropped
        train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={resumed}",
                        *TINY_RUN, "--batch_size=8", "--max_seq_len=64", *flags, "--resume=True"])


def test_float16_grad_scaler_state_survives_a_resume(demo_dir, tmp_path, device):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = repeatable(device, "--dtype=float16", "--lr=3e-3", "--max_steps=12", "--save_interval=5",
                       "--keep_checkpoints=10", "--eval_interval=12")
    pretrain_short(demo_dir, full, *flags)
    os.makedirs(resumed)
    shutil.copy(full / "step_0000005.pt", resumed)  # as if the run had died right after step 5
    pretrain_short(demo_dir, resumed, *flags, "--resume=True")
    a, b = (torch.load(d / "step_0000012.pt", weights_only=False)["scaler"] for d in (full, resumed))
    assert "scale" in a and a["scale"] > 0, a  # an enabled scaler: a disabled one saves {}
    # the default scaler changes its scale only on an overflow or after 2000 clean steps, so the scale alone
    # cannot tell a restored scaler from a fresh one; the growth tracker (clean steps since the last change) can,
    # as long as the scale did not change after step 5
    assert a["_growth_tracker"] > 12 - 5
    assert a == b
    la, lb = train_losses(full), train_losses(resumed)
    assert set(lb) == set(range(6, 13)) and all(la[s] == lb[s] for s in lb)
    wa, wb = final_weights(full, 12), final_weights(resumed, 12)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_metrics_row_cut_short_by_a_crash_does_not_stop_the_resume(demo_dir, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = ["--max_steps=6", "--save_interval=3", "--keep_checkpoints=10", "--eval_interval=100"]
    pretrain(demo_dir, full, *flags)
    os.makedirs(resumed)
    shutil.copy(full / "step_0000003.pt", resumed)  # as if the run had died while writing step 5's row
    lines = (full / "metrics.jsonl").read_text(encoding="utf-8").splitlines(True)
    (resumed / "metrics.jsonl").write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2], encoding="utf-8")
    pretrain(demo_dir, resumed, *flags, "--resume=True")
    assert train_losses(resumed) == train_losses(full)
    assert [r["step"] for r in read_metrics(resumed) if "loss" in r] == list(range(1, 7))


# --- SIGTERM and the signal handlers --------------------------------------------------------------

def test_sigterm_saves_a_checkpoint_and_exits(demo_dir, tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "train_pretrain.py"), f"--data_path={demo_dir}/pretrain.jsonl",
           f"--out_dir={tmp_path}", *TINY_MODEL, *TINY_RUN, "--batch_size=8", "--max_steps=100000", "--eval_interval=100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    (stopped,) = [line for line in out.splitlines() if line.startswith("stopped at step")]
    step = int(stopped.split()[3].rstrip(";"))
    assert load_checkpoint(str(tmp_path / f"step_{step:07d}.pt"))["step"] == step


def test_training_gives_the_signal_handlers_back(demo_dir, tmp_path):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    pretrain(demo_dir, tmp_path, "--max_steps=2")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
