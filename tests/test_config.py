"""Reading the configuration: config files then flags, unknown keys and wrong types named, values checked, --help
listing every key in its group; a user's mistake is one `error:` line and exit status 2, a bug still a traceback."""
import dataclasses
import sys

import pytest

import errors
import train_dpo
import train_pretrain
import train_sft
from config import DPOConfig, PretrainConfig, SFTConfig, field_docs, help_text, load_config, words
from conftest import TINY_RUN, run_script
from errors import ConfigError
from model import ModelConfig


# --- config files and flags -----------------------------------------------------------------------

def test_config_file_then_flags_and_int_for_float(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("dim = 128\nlr = 1\n# a comment\nn_layers = 3\n")
    cfg, model_cfg = load_config([str(path), "--n_layers=5", "--lr=3e-4", "--resume=true", "--out_dir=out/x"],
                                 PretrainConfig, ModelConfig)
    assert (model_cfg.dim, model_cfg.n_layers, cfg.lr, cfg.resume, cfg.out_dir) == (128, 5, 3e-4, True, "out/x")
    (cfg,) = load_config(["--lr=1"], PretrainConfig)
    assert cfg.lr == 1.0 and type(cfg.lr) is float


@pytest.mark.parametrize("argv, key", [
    (["--learning_rate=3e-4"], "learning_rate"),
    (["--batch_size=3.5"], "batch_size"),
    (["--batch_size=True"], "batch_size"),
    (["--resume=maybe"], "resume"),
    (["--max_steps=ten"], "max_steps"),
])
def test_unknown_keys_and_wrong_types_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(argv, PretrainConfig, ModelConfig)


def test_a_wrong_key_in_a_config_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("dim = 64\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"'n_layer' \(from .*bad\.py\)"):
        load_config([str(path)], PretrainConfig, ModelConfig)


def test_unknown_lora_targets_are_a_config_error():
    with pytest.raises(ConfigError, match="lora_targets.*'wz'"):
        load_config(["--lora_rank=4", "--lora_targets=wq,wz"], SFTConfig)


# --- words, a bool key alone, one word per key ----------------------------------------------------

@dataclasses.dataclass
class Plot:
    # --- I/O
    runs: list[str] = words("RUN...")  # run directories
    out: str = "plots"  # where the pictures go
    force: bool = False  # replace them
    name: str | None = None


def test_words_collect_the_bare_arguments_and_no_config_file_is_read():
    (cfg,) = load_config(["a", "--out=p", "b/c", "--force"], Plot)
    assert (cfg.runs, cfg.out, cfg.force) == (["a", "b/c"], "p", True)
    assert load_config([], Plot)[0].runs == []
    with pytest.raises(ConfigError, match="unknown config key 'runs'"):
        load_config(["--runs=a"], Plot)


def test_a_bool_key_alone_is_true_and_any_other_key_needs_its_value_in_the_same_word():
    (cfg,) = load_config(["--resume"], PretrainConfig)
    assert cfg.resume is True
    with pytest.raises(ConfigError, match="^expected --key=value, got '--lr': write --lr=VALUE, one word"):
        load_config(["--lr", "3e-4"], PretrainConfig)
    with pytest.raises(ConfigError, match="^expected --key=value, got '--out'"):
        load_config(["a", "--out", "p"], Plot)
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        load_config(["--nope"], PretrainConfig)
    with pytest.raises(ConfigError, match="^expected --key=value, got 'extra'"):
        load_config(["--lr=1", "extra"], PretrainConfig)


def test_a_str_key_keeps_text_that_reads_as_another_literal():
    (cfg,) = load_config(["--name=12345"], Plot)
    assert cfg.name == "12345"
    assert load_config(["--name=None"], Plot)[0].name is None
    (cfg,) = load_config(["--out_dir=True", "--data_path=[1]"], PretrainConfig)
    assert (cfg.out_dir, cfg.data_path) == ("True", "[1]")


def test_help_names_the_words_in_its_usage_line_and_lists_them():
    text = help_text((Plot,), set())
    usage_line, *rest = text.splitlines()
    assert usage_line.endswith(" RUN... [--key=value ...]") and "config_file" not in usage_line
    assert "  RUN...         run directories" in rest and "  --force=False  replace them" in rest
    assert "A bool key alone (--key) means --key=True" in text


# --- DPO's lengths default to what fits the model -------------------------------------------------

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


# --- --help ---------------------------------------------------------------------------------------

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
    assert docs["lr"] == ("optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW "
                          "for the rest", "AdamW's peak")  # SFTConfig's lr has no comment: it keeps its base's
    assert docs["max_seq_len"][0] == "data" and docs["init_from"][0] == "I/O"
    assert docs["eval_interval"] == ("logging, evaluation, checkpoints", "and at every epoch end")
    text = help_text((SFTConfig,), set())
    groups = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups[:3] == ["I/O:", "data:", "training length:"]
    io = text[text.index("\nI/O:"):text.index("\ndata:")]
    assert "--out_dir=out/sft" in io and "--init_from=out/pretrain/best.pt" in io


# --- a user's mistake: one line, exit status 2 ----------------------------------------------------

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


def test_a_bug_still_gives_a_traceback(monkeypatch):
    def main(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(sys, "argv", ["x.py"])
    with pytest.raises(KeyError):
        errors.cli(main)
