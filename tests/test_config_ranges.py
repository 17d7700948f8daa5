"""Every numeric key of every training stage's config and of ModelConfig has a range, checked when the config is read:
a value outside it is a ConfigError of one line naming the key (the table of bad values below is written by hand,
not taken from config.py's rules), edge values inside it are accepted, and from the command line the mistake is one
`error:` line and exit status 2. The configs/*.py files all still load."""
import dataclasses
import glob
import os
import re
import types
import typing

import pytest
import torch

from config import (DistillConfig, DPOConfig, GRPOConfig, PPOConfig, PretrainConfig, RewardConfig, SFTConfig,
                    load_config, parse_flag_value)
from conftest import REPO, run_script
from errors import ConfigError
from model import ModelConfig

# the dataclasses each script passes to load_config (see each script's main)
SCHEMAS = {
    "train_pretrain.py": (PretrainConfig, ModelConfig),
    "train_sft.py": (SFTConfig,),
    "train_dpo.py": (DPOConfig,),
    "train_reward.py": (RewardConfig,),
    "train_grpo.py": (GRPOConfig,),
    "train_ppo.py": (PPOConfig,),
    "train_distill.py": (DistillConfig, ModelConfig),
}

# key -> values out of its range in every stage that has the key (a key shared by stages: the same meaning)
BAD = {
    # TrainConfig
    "val_fraction": [0, 1, -0.1, 1.5],
    "batch_size": [0, -1], "accum_steps": [0], "max_steps": [0, -5], "epochs": [0],
    "lr": [-1, -1e-4],  # 0 is in range: frozen weights (tests measure a checkpoint that way)
    "min_lr": [-1e-5], "weight_decay": [-1, -0.01],
    "beta1": [1, 1.5, -0.1], "beta2": [1, -0.5],
    "muon_lr": [0, -0.02], "muon_momentum": [1, 1.2, -0.1],
    "max_grad_norm": [-1, -0.5],
    "warmup_steps": [-5, -1], "warmup_ratio": [1, 1.5, -0.1],
    "log_interval": [0], "eval_interval": [0, -1], "eval_steps": [0], "save_interval": [0],
    "keep_checkpoints": [0], "grad_log_interval": [-1],
    "seed": [-1, 2**32, 2**40],
    "max_bad_steps": [0], "peak_flops": [-1, -1e12],
    # FinetuneConfig (and ModelConfig's dropout)
    "dropout": [1, 1.5, -0.1],
    "lora_rank": [-1], "lora_alpha": [0, -8], "lora_dropout": [1, -0.1],
    "early_stopping_patience": [0, -1], "early_stopping_threshold": [-0.01],
    # SFTConfig and ModelConfig
    "max_seq_len": [0, -1],
    # DPOConfig, RewardConfig, GRPOConfig
    "max_prompt_length": [0, -1], "max_completion_length": [0, -3],
    "beta": [-0.1, -1],
    # GRPOConfig (group_size 1: GRPO's alone, in BAD_TOGETHER; PPO's critic needs no group)
    "group_size": [0, -1], "temperature": [0, -1], "top_p": [0, -0.5, 1.5], "max_new_tokens": [0, -1],
    "max_turns": [0], "clip_eps": [0, 1, -0.2], "clip_high": [0.5, 0, -1], "ppo_epochs": [0],
    # PPOConfig
    "gamma": [0, 1.5, -0.5], "gae_lambda": [-0.1, 1.5], "value_clip": [0, -0.2], "critic_lr": [0, -1e-3],
    "critic_min_lr": [-1e-6],
    # DistillConfig (temperature above)
    "alpha": [-0.1, 1.5],
    # ModelConfig
    "dim": [0, -64], "n_layers": [0, -1], "n_heads": [0], "n_kv_heads": [0, -2], "vocab_size": [0, -1],
    "ffn_dim": [0, -1], "rope_theta": [0, 1, -1e4], "norm_eps": [0, -1e-5], "head_dim": [0, -8],
    "n_experts": [-1], "experts_per_token": [0, -1], "moe_ffn_dim": [0],
    "router_aux_loss_coef": [-1e-3], "rope_factor": [0.5, 0, -4],
    "rope_original_max_len": [0, -1], "rope_beta_fast": [0, -32], "rope_beta_slow": [0, -1],
    "rope_attention_factor": [0, -1.0],
}

# keys with no invalid value (every value of their type works): key -> why. None today; a new key goes in BAD or here.
NO_INVALID: dict[str, str] = {}

# out of range only in one stage, or only beside another key's value: (script, flags, the key the error must name)
BAD_TOGETHER = [
    ("train_pretrain.py", ["--min_lr=1e-3"], "min_lr"),  # above lr (5e-4): the cosine would climb
    ("train_pretrain.py", ["--lr=1e-4", "--min_lr=2e-4"], "min_lr"),
    ("train_sft.py", ["--min_lr=1e-4"], "min_lr"),
    ("train_grpo.py", ["--lr=1e-3", "--min_lr=0.5"], "min_lr"),
    ("train_grpo.py", ["--group_size=1"], "group_size"),  # a group of one has no advantage
    ("train_ppo.py", ["--critic_lr=1e-3", "--critic_min_lr=1e-2"], "critic_min_lr"),  # the cosine would climb
    ("train_pretrain.py", ["--optimizer=muon", "--lr=0"], "lr"),  # Muon scales its lr by muon_lr / lr
    ("train_pretrain.py", ["--optimizer=muon", "--muon_lr=0"], "muon_lr"),
    ("train_pretrain.py", ["--optimizer=muon", "--muon_momentum=1"], "muon_momentum"),
    ("train_dpo.py", ["--beta=0"], "beta"),  # DPO's loss would be log 2 whatever the policy does: no gradient
    ("train_reward.py", ["--lora_rank=4"], "lora_rank"),  # train_reward.py trains the whole model
    ("train_pretrain.py", ["--n_heads=8", "--n_kv_heads=3"], "n_kv_heads"),
    ("train_pretrain.py", ["--dim=100", "--n_heads=8"], "n_heads"),
    ("train_pretrain.py", ["--dim=36", "--n_heads=4"], "head_dim"),  # 9: odd, RoPE rotates pairs
    ("train_pretrain.py", ["--head_dim=3"], "head_dim"),
    ("train_distill.py", ["--n_experts=2", "--experts_per_token=3"], "experts_per_token"),
    ("train_pretrain.py", ["--rope_scaling=linear"], "rope_scaling"),
    ("train_sft.py", ["--warmup_steps=100"], "warmup_ratio"),  # SFT's 5% ratio won and the 100 steps were ignored
    ("train_pretrain.py", ["--warmup_ratio=0.1"], "warmup_steps"),  # beside pretraining's 1000 steps
]

# values at the edge of a range, which must be accepted: (script, flags)
EDGES = [
    ("train_pretrain.py", ["--max_grad_norm=0", "--warmup_steps=0", "--weight_decay=0", "--min_lr=0", "--seed=0",
                           "--grad_log_interval=0", "--peak_flops=0", "--beta1=0", "--beta2=0", "--dropout=0",
                           "--muon_momentum=0", "--max_steps=1", "--batch_size=1", "--log_interval=1"]),
    ("train_pretrain.py", ["--seed=4294967295", "--lr=1e-3", "--min_lr=1e-3", "--beta2=0.9999", "--val_fraction=0.999",
                           "--warmup_ratio=0", "--warmup_steps=0", "--n_experts=0", "--router_aux_loss_coef=0",
                           "--rope_factor=1", "--n_layers=1", "--n_heads=1", "--n_kv_heads=1", "--dim=2",
                           "--max_seq_len=1", "--vocab_size=1", "--ffn_dim=1", "--dropout=0.999"]),
    ("train_pretrain.py", ["--warmup_ratio=0.999", "--warmup_steps=0", "--optimizer=muon", "--lr=1e-9", "--min_lr=0",
                           "--muon_lr=1e-9", "--n_experts=4", "--experts_per_token=4", "--moe_ffn_dim=1",
                           "--head_dim=2", "--rope_scaling=yarn", "--rope_attention_factor=1e-3", "--rope_theta=1.001"]),
    ("train_sft.py", ["--dropout=0", "--lora_rank=0", "--lora_dropout=0", "--early_stopping_threshold=0",
                      "--early_stopping_patience=1", "--max_seq_len=1", "--warmup_ratio=0"]),
    ("train_sft.py", ["--lora_rank=1", "--lora_alpha=1e-3", "--lora_dropout=0.5", "--warmup_ratio=None",
                      "--warmup_steps=100", "--max_steps=None"]),
    ("train_dpo.py", ["--beta=1e-3", "--max_prompt_length=1", "--max_completion_length=1", "--lr=0", "--min_lr=0"]),
    ("train_reward.py", ["--lora_rank=0", "--max_prompt_length=1", "--max_completion_length=1"]),
    ("train_grpo.py", ["--beta=0", "--top_p=1", "--clip_high=1", "--group_size=2", "--max_new_tokens=1",
                       "--max_turns=1", "--ppo_epochs=1", "--clip_eps=0.999", "--temperature=1e-3",
                       "--max_prompt_length=1"]),
    ("train_ppo.py", ["--group_size=1", "--beta=0", "--ppo_epochs=1", "--gamma=1", "--gae_lambda=0", "--value_clip=1e-3",
                      "--critic_lr=1e-9", "--critic_min_lr=0"]),
    ("train_ppo.py", ["--gae_lambda=1", "--critic_lr=1e-3", "--critic_min_lr=1e-3", "--gamma=1e-3"]),
    ("train_distill.py", ["--alpha=0", "--temperature=1e-3", "--rope_factor=1"]),
    ("train_distill.py", ["--alpha=1"]),
]


def numeric_fields(schema) -> list[dataclasses.Field]:
    """The fields annotated int or float, Optional or not (bool is not an int here: check_type refuses it)."""
    def kinds(annotation):
        return set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    return [f for f in dataclasses.fields(schema) if kinds(f.type) & {int, float}]


def is_float(schema, key) -> bool:
    (field,) = [f for f in dataclasses.fields(schema) if f.name == key]
    return float in (typing.get_args(field.type) or (field.type,))


def numeric_cases():
    for script, schemas in SCHEMAS.items():
        seen = set()
        for schema in schemas:
            for f in numeric_fields(schema):
                if f.name not in seen and f.name not in NO_INVALID:
                    seen.add(f.name)
                    for value in BAD.get(f.name, [None]):  # None: a key missing from BAD fails its case
                        yield pytest.param(script, f.name, value, id=f"{script[6:-3]}-{f.name}={value}")


def one_line_error(argv, schemas) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(argv, *schemas)
    message = str(raised.value)
    assert "\n" not in message
    return message


# --- every numeric key refuses its out-of-range values ---------------------------------------------

def test_every_numeric_key_of_every_stage_has_bad_values_in_the_table():
    missing = {(script, f.name) for script, schemas in SCHEMAS.items() for schema in schemas
               for f in numeric_fields(schema) if f.name not in BAD and f.name not in NO_INVALID}
    assert not missing, f"numeric keys without out-of-range values in BAD (or a reason in NO_INVALID): {missing}"
    assert len({f.name for s in SCHEMAS.values() for schema in s for f in numeric_fields(schema)}) >= 60
    every_key = {f.name for s in SCHEMAS.values() for schema in s for f in dataclasses.fields(schema)}
    assert set(BAD) <= every_key  # no stale rows


@pytest.mark.parametrize("script, key, value", list(numeric_cases()))
def test_an_out_of_range_value_is_a_one_line_config_error_naming_key_and_value(script, key, value):
    assert value is not None, f"{key} has no out-of-range values in BAD"
    schemas = SCHEMAS[script]
    message = one_line_error([f"--{key}={value}"], schemas)
    assert message.startswith(f"config key '{key}' must be "), message
    schema = next(s for s in schemas if key in {f.name for f in dataclasses.fields(s)})
    shown = float(value) if is_float(schema, key) else value
    assert message.endswith(f", got {shown!r}"), message
    assert "(from " not in message  # a range, not check_type's wrong type


@pytest.mark.parametrize("script", SCHEMAS)
@pytest.mark.parametrize("value", ['float("nan")', 'float("inf")', '-float("inf")'])
def test_every_float_key_refuses_a_non_finite_value_from_a_config_file(tmp_path, script, value):
    schemas = SCHEMAS[script]
    keys = {f.name for schema in schemas for f in numeric_fields(schema) if is_float(schema, f.name)}
    assert len(keys) >= 10
    path = tmp_path / "c.py"
    for key in sorted(keys):
        path.write_text(f"{key} = {value}\n")
        message = one_line_error([str(path)], schemas)
        assert message.startswith(f"config key '{key}' must be "), message
        assert re.search(r"got -?(nan|inf)$", message), message


@pytest.mark.parametrize("script, flags, key", BAD_TOGETHER, ids=lambda x: x if isinstance(x, str) else None)
def test_a_value_out_of_range_in_one_stage_or_beside_another_key_names_the_key(script, flags, key):
    message = one_line_error(flags, SCHEMAS[script])
    assert re.search(rf"\b{key}\b", message), message


# --- edges inside the ranges are accepted ---------------------------------------------------------

@pytest.mark.parametrize("script, flags", EDGES)
def test_values_at_the_edge_of_their_range_are_accepted(script, flags):
    configs = load_config(flags, *SCHEMAS[script])
    values = {k: v for c in configs for k, v in dataclasses.asdict(c).items()}
    for flag in flags:
        key, text = flag[2:].split("=", 1)
        assert values[key] == parse_flag_value(text), (key, values[key])


CONFIG_SCRIPTS = {
    "26m.py": "train_pretrain.py", "64m.py": "train_pretrain.py", "104m.py": "train_pretrain.py",
    "moe_198m.py": "train_pretrain.py", "demo.py": "train_pretrain.py", "demo_tools.py": "train_pretrain.py",
    "sft_26m.py": "train_sft.py", "demo_sft.py": "train_sft.py", "demo_sft_lora.py": "train_sft.py",
    "demo_tools_sft.py": "train_sft.py", "dpo_26m.py": "train_dpo.py", "demo_dpo.py": "train_dpo.py",
    "demo_reward.py": "train_reward.py", "demo_grpo.py": "train_grpo.py", "demo_tools_grpo.py": "train_grpo.py",
    "demo_ppo.py": "train_ppo.py",
    "demo_distill.py": "train_distill.py",
}


def test_every_config_file_still_loads_with_its_scripts_schemas():
    files = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*.py"))}
    assert files == set(CONFIG_SCRIPTS), "a config file without its script here (or one gone)"
    for name, script in CONFIG_SCRIPTS.items():
        load_config([os.path.join(REPO, "configs", name)], *SCHEMAS[script])


# --- from the command line: one `error:` line, exit status 2 ----------------------------------------

@pytest.mark.parametrize("script, flag, key", [
    ("train_pretrain.py", "--max_grad_norm=-1", "max_grad_norm"),  # trained by gradient ascent before
    ("train_pretrain.py", "--dim=0", "dim"),  # trained a zero-width model and exited 0
    ("train_pretrain.py", "--seed=-1", "seed"),
    ("train_pretrain.py", "--max_seq_len=0", "max_seq_len"),
    ("train_pretrain.py", "--warmup_steps=-5", "warmup_steps"),
    ("train_sft.py", "--dropout=1.5", "dropout"),
    ("train_dpo.py", "--beta=0", "beta"),
    ("train_grpo.py", "--lr=-1", "lr"),
    ("train_reward.py", "--weight_decay=-1", "weight_decay"),
    ("train_distill.py", "--min_lr=1", "min_lr"),
    ("train_pretrain.py", "lr = float('nan')", "lr"),  # a config file's line
])
def test_an_out_of_range_key_on_the_command_line_is_one_error_line_and_exit_status_2(tmp_path, script, flag, key):
    if not flag.startswith("--"):
        (tmp_path / "c.py").write_text(flag + "\n")
        flag = str(tmp_path / "c.py")
    result = run_script(script, flag, f"--out_dir={tmp_path}/out", "--device=cpu")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: config key '{key}' must be "), line
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["train_pretrain.py", "sample.py"])
def test_a_device_the_machine_does_not_have_is_one_error_line(tmp_path, script):
    missing = f"cuda:{torch.cuda.device_count()}"  # the first index past this machine's GPUs (cuda:0 without any)
    args = [f"--device={missing}", f"--out_dir={tmp_path}/out"] if script.startswith("train") else \
        [f"--device={missing}", "--ckpt=unused.pt"]
    result = run_script(script, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: device {missing}: this machine has {torch.cuda.device_count()} CUDA device(s)")
