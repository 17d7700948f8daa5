import os
import subprocess
import sys

import pytest
import torch

import errors
import train_dpo
import train_pretrain
import train_sft
from checkpoint import load_model
from config import DPOConfig, PretrainConfig, SFTConfig, field_docs, help_text
from config import load_config
from conftest import TINY_RUN
from errors import ConfigError
from metrics import console_line
from model import ModelConfig
from runtime import pick_device, pick_dtype

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# --- --help -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("script, lines", [
    ("train_pretrain.py", ["  --out_dir=out/pretrain", "  --lr=0.0005", "  --dim=512", "system:", "model switches: how it computes, not what:"]),
    ("train_sft.py", ["  --out_dir=out/sft", "  --lr=2e-05", "  --init_from=out/pretrain/best.pt", "model switches"]),
    ("train_dpo.py", ["  --beta=0.5", "  --max_prompt_length=None", "  --lr=5e-06", "DPO:"]),
])
def test_help_lists_every_key_with_its_default_and_comment_and_exits_0(script, lines):
    for flag in ("--help", "-h"):
        result = run_script(script, flag)
        assert result.returncode == 0 and result.stderr == ""
        out = result.stdout
        for line in lines:
            assert line in out
    module = {"train_pretrain.py": train_pretrain, "train_sft.py": train_sft, "train_dpo.py": train_dpo}[script]
    config = {train_pretrain: PretrainConfig, train_sft: SFTConfig, train_dpo: DPOConfig}[module]
    schemas = (config, ModelConfig) if module is train_pretrain else (config,)
    for schema in schemas:
        for name in schema.__dataclass_fields__:
            assert f"  --{name}=" in out, name
    # a key's comment sits beside it; an override without a comment keeps its base's
    (lr_line,) = [line for line in out.splitlines() if line.strip().startswith("--max_grad_norm=")]
    assert lr_line.endswith("0 disables clipping")
    (resume,) = [line for line in out.splitlines() if line.strip().startswith("--resume=")]
    assert resume.endswith("continue from the latest checkpoint in out_dir")


def test_help_groups_follow_the_dataclass_and_subclass_fields_join_their_group():
    docs = field_docs(SFTConfig)
    assert docs["lr"] == ("optimizer: AdamW, weight decay on matrices only", "")
    assert docs["max_seq_len"][0] == "data" and docs["init_from"][0] == "I/O"
    assert docs["eval_interval"] == ("logging, evaluation, checkpoints", "and at every epoch end")
    text = help_text((SFTConfig,), set())
    groups = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups[:3] == ["I/O:", "data:", "training length:"]
    io = text[text.index("\nI/O:"):text.index("\ndata:")]
    assert "--out_dir=out/sft" in io and "--init_from=out/pretrain/best.pt" in io


# --- a user's mistake: one line, exit status 2 ----------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--learning_rate=3e-4"], "unknown config key 'learning_rate' (from command line)"),
    (["--batch_size=3.5"], "config key 'batch_size' (from command line) must be int"),
    (["--dtype=float8"], "config key 'dtype' must be auto, float32, bfloat16 or float16, got 'float8'"),
    (["--device=gpu"], "config key 'device' must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    (["--batch_size=0"], "config key 'batch_size' must be at least 1, got 0"),
    (["--val_fraction=1.5"], "config key 'val_fraction' must be between 0 and 1, got 1.5"),
    (["--dim=100", "--n_heads=3"], "dim (100) must be divisible by n_heads (3)"),
    (["--data_path=/nonexistent/x.jsonl"], "data file not found: /nonexistent/x.jsonl"),
    (["--tokenizer_path=/nonexistent"], "/nonexistent: expected a .model file"),
])
def test_a_configuration_mistake_is_one_error_line_and_exit_status_2(tmp_path, flags, message):
    result = run_script("train_pretrain.py", f"--out_dir={tmp_path}/out", *TINY_RUN, *flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]  # exactly one line
    assert message in result.stderr and "Traceback" not in result.stderr


def test_an_out_dir_holding_checkpoints_is_an_error_line_and_nothing_is_touched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "step_0000005.pt").write_bytes(b"not really a checkpoint")
    (out / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    result = run_script("train_pretrain.py", f"--out_dir={out}", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {out} already holds checkpoints: pass --resume=True")
    assert (out / "step_0000005.pt").read_bytes() == b"not really a checkpoint"
    assert (out / "metrics.jsonl").read_text() == '{"step": 5, "loss": 1.0}\n'


def test_an_unreadable_init_checkpoint_is_an_error_line(tmp_path):
    (tmp_path / "broken.pt").write_bytes(b"\x00" * 100)
    result = run_script("train_sft.py", f"--init_from={tmp_path}/broken.pt", f"--out_dir={tmp_path}/out", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {tmp_path}/broken.pt is not a readable checkpoint")


def test_a_bug_still_gives_a_traceback(monkeypatch):
    def main(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(sys, "argv", ["x.py"])
    with pytest.raises(KeyError):
        errors.cli(main)


# --- device and dtype: auto ------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert pick_device("auto") == expected
    assert pick_device("cpu") == "cpu" and pick_device("cuda:1") == "cuda:1"  # an explicit device is kept


@pytest.mark.parametrize("device, bf16, expected", [("cuda", True, "bfloat16"), ("cuda", False, "float16"),
                                                    ("mps", True, "bfloat16"), ("mps", False, "float16"),
                                                    ("cpu", True, "float32")])
def test_auto_dtype_is_what_the_device_runs_well(monkeypatch, device, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: bf16 and (major, minor) == (14, 0))
    assert pick_dtype("auto", device) == expected
    assert pick_dtype("float32", device) == "float32"


# --- DPO's lengths default to what fits the model ---------------------------------------------------

def test_dpo_lengths_default_to_the_model_context_and_an_overlong_pair_is_an_error():
    def lengths(flags, max_seq_len):
        cfg = load_config(flags, DPOConfig)[0].fit_lengths(max_seq_len)
        return cfg.max_prompt_length, cfg.max_completion_length

    assert lengths([], 511) == (256, 256)  # MiniMind's 256 + 256 for its 512-token models
    assert lengths([], 64) == (32, 33)
    assert lengths(["--max_prompt_length=20"], 64) == (20, 45)
    with pytest.raises(ConfigError, match="max_prompt_length \\+ max_completion_length = 80 exceeds the model's "
                                          "max_seq_len \\+ 1 = 65"):
        lengths(["--max_prompt_length=40", "--max_completion_length=40"], 64)


# --- the console line -----------------------------------------------------------------------------------

def test_the_console_line_is_short_and_in_human_units():
    row = {"step": 120, "loss": 2.3101, "ppl": 10.08, "lr": 3e-4, "grad_norm": 0.8412, "reward_margin": 1.234,
           "reward_acc": 0.953, "chosen_reward": 0.1, "rejected_reward": -1.1, "chosen_logp": -50.0,
           "rejected_logp": -60.0, "skipped_steps": 2, "tokens_per_s": 9612.0, "mfu": 0.6312, "mem_gb": 1.4,
           "frac_data": 0.001, "frac_forward": 0.33, "frac_backward": 0.6, "frac_optimizer": 0.069,
           "elapsed_s": 252.7, "eta_s": 3725.1}
    line = console_line(row, 650)
    assert line == ("step 120/650 | loss 2.31 | lr 3.0e-04 | grad 0.841 | acc 95% margin 1.23 | 9.6k tok/s | "
                    "MFU 63% | 0:04:12 / ETA 1:02:05")
    assert len(line) <= 120
    pretrain = {k: v for k, v in row.items() if not k.startswith(("reward", "chosen", "rejected"))}
    assert console_line(pretrain, 650) == ("step 120/650 | loss 2.31 | lr 3.0e-04 | grad 0.841 | 9.6k tok/s | "
                                           "MFU 63% | 0:04:12 / ETA 1:02:05")
    assert console_line({**pretrain, "tokens_per_s": 950.4}, 650).split(" | ")[4] == "950 tok/s"
    evaluation = console_line({"step": 325, "val_loss": 2.1101, "val_ppl": 8.249}, 650)
    assert evaluation == "step 325/650 | val_loss 2.11 | val_ppl 8.249"


# --- sample.py ------------------------------------------------------------------------------------

def test_sample_defaults_fit_a_short_context_model_and_a_bad_max_new_tokens_is_an_error_line(tiny_sft, capsys,
                                                                                              monkeypatch):
    """The tiny SFT model's context is 64 ids: the defaults answer within it (the prompt keeps at most half);
    an explicit --max_new_tokens that leaves no room for the prompt is one error line."""
    import sample

    max_seq_len = load_model(str(tiny_sft))[0].config.max_seq_len
    assert max_seq_len == 64
    fed = []
    respond = sample.respond
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, args, *rest: fed.append(ids) or
                        respond(model, tok, ids, args, *rest))
    sample.main(["--ckpt", str(tiny_sft), "--prompt", "What is the capital of Kenya? " * 20])
    assert 0 < len(fed[0]) <= max_seq_len // 2 and capsys.readouterr().out.strip()
    result = run_script("sample.py", "--ckpt", str(tiny_sft), "--prompt", "hi", "--max_new_tokens", "64")
    assert result.returncode == 2 and result.stderr.startswith("error: --max_new_tokens")
    assert len(result.stderr.strip().splitlines()) == 1
