"""
Every training stage's keys, and how a run gets them: the dataclass defaults <- a config file's `key = value`
lines <- --key=value flags. An unknown key or a wrong type is a ConfigError that names the key and where it came
from, a value out of its range (RANGES) one that names the key, the range and the value; --help lists every key
with its default and its comment.

  TrainConfig      the keys every stage has; PretrainConfig and DistillConfig add theirs
  FinetuneConfig   SFT, DPO and RL: start from a checkpoint (init_from); SFTConfig, DPOConfig, GRPOConfig, PPOConfig
  RANGES           each key's valid values, checked when a config is built (model.MODEL_RANGES: the model's)
  load_config      argv -> one instance of each dataclass asked for (a script's and model.ModelConfig)
  words            a field that takes a script's bare words (plot.py's runs, convert.py's command and paths)
"""
import ast
import dataclasses
import inspect
import os
import re
import sys
import types
import typing

from errors import ABOVE_0, AT_LEAST_1, FRACTION, NOT_NEGATIVE, ConfigError, check_ranges
from lora import TARGETS
from optim import OPTIMIZERS
from runtime import DTYPES


# -----------------------------------------------------------------------------
# the keys: a `# --- group` line starts a group of --help, the comment beside a key is its help

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
    tokenizer_path: str | None = None  # None: the default, MiniMind's (vocab/minimind/)
    # --- training length
    batch_size: int = 64  # per rank: the global batch is batch_size x accum_steps x ranks
    accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # None: `epochs` passes over the training data
    epochs: int = 1
    # --- optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW for the rest
    optimizer: str = "adamw"  # adamw | muon
    lr: float = 5e-4  # AdamW's peak
    min_lr: float = 1e-5
    weight_decay: float = 0.1  # AdamW's matrices (with muon: the embedding and an untied head)
    beta1: float = 0.9
    beta2: float = 0.95
    muon_lr: float = 0.02  # Muon's peak, on the same schedule (x min_lr / lr at its end)
    muon_momentum: float = 0.95
    max_grad_norm: float = 1.0  # 0 disables clipping
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 1000
    warmup_ratio: float | None = None  # if set: warmup_steps = warmup_ratio * max_steps (set warmup_steps=0)
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
    compile: bool | None = None  # torch.compile the model; None: on CUDA only (a CPU pays the compile back late)
    seed: int = 1337
    max_bad_steps: int = 10  # stop after this many non-finite (skipped) steps in a row
    peak_flops: float = 0.0  # per device, the MFU denominator; 0: measure a large matmul at startup

    def __post_init__(self):
        if self.optimizer == "muon" and not (self.lr > 0 and self.muon_lr > 0 and 0 <= self.muon_momentum < 1):
            # before the ranges: this message names all three keys that Muon needs
            raise ConfigError(f"optimizer muon needs lr > 0, muon_lr > 0 and 0 <= muon_momentum < 1, got lr "
                              f"{self.lr}, muon_lr {self.muon_lr}, muon_momentum {self.muon_momentum}")
        check_train_ranges(self)
        check_device_and_dtype(self.device, self.dtype)


def check_device_and_dtype(device: str, dtype: str):
    """The device and dtype keys every config has (training's and eval.py's)."""
    if dtype not in DTYPES:
        raise ConfigError(f"config key 'dtype' must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise ConfigError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got {device!r}")


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
    compile: bool | None = False  # off: batches pad to their longest conversation, and each new length recompiles
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
        unknown = set(self.lora_targets.split(",")) - set(TARGETS)
        if unknown:
            raise ConfigError(f"config key 'lora_targets' names {sorted(unknown)}; choose from {','.join(TARGETS)}")


@dataclasses.dataclass
class PretrainConfig(TrainConfig):
    # --- I/O
    out_dir: str = "out/pretrain"
    # --- data
    data_path: str = "data/pretrain_hq.jsonl"  # JSONL {"text"} or .txt; or a glob / comma list, read as one


@dataclasses.dataclass
class SFTConfig(FinetuneConfig):
    # --- I/O
    out_dir: str = "out/sft"
    # --- data
    data_path: str = "data/sft_mini_512.jsonl"  # JSONL {"conversations": [{"role", "content"}, ...]}; or a glob / comma list
    max_seq_len: int = 512  # longer conversations lose their earliest turns
    pack: bool = True  # whole conversations packed into rows of max_seq_len, attention kept inside each; False: padded
    # --- training length
    batch_size: int = 32  # per rank: rows of max_seq_len; pack=False: conversations, padded to the batch's longest
    epochs: int = 10  # an upper bound: early stopping usually ends it sooner
    # --- optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW for the rest
    lr: float = 2e-5
    min_lr: float = 2e-6
    weight_decay: float = 0.01
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 0
    warmup_ratio: float | None = 0.05


@dataclasses.dataclass
class DPOConfig(FinetuneConfig):
    # --- I/O
    out_dir: str = "out/dpo"
    init_from: str = "out/sft/best.pt"  # the policy starts here
    ref_from: str | None = None  # the frozen reference; None: init_from
    # --- data
    data_path: str = "data/dpo.jsonl"  # JSONL {"prompt", "chosen", "rejected"} or message lists; or a glob / comma list
    max_prompt_length: int | None = None  # longer prompts lose their beginning; None: half of max_seq_len + 1
    max_completion_length: int | None = None  # longer answers lose their end; None: the rest of max_seq_len + 1
    pack: bool = False  # whole pairs packed into rows of 2 x max_seq_len, attention kept inside each sequence
    # --- DPO
    beta: float = 0.5  # how far the policy may move from the reference; larger = closer
    length_norm: bool = True  # mean log-prob per answer token (fair between long and short answers); False: sum
    precompute_ref: bool = False  # reference log-probs once, before training (cached beside the data)
    # --- training length
    batch_size: int = 16  # per rank: pairs, 2 x batch_size sequences each padded to the longest; pack: rows
    epochs: int = 2
    # --- optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW for the rest
    lr: float = 5e-6
    min_lr: float = 5e-7
    weight_decay: float = 0.0
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 100

    def fit_lengths(self, max_seq_len: int) -> "DPOConfig":
        """This config with max_prompt_length and max_completion_length as set, or splitting the model's
        max_seq_len + 1 (init_from's)."""
        prompt = self.max_prompt_length or (max_seq_len + 1) // 2
        completion = self.max_completion_length or max_seq_len + 1 - prompt
        if prompt + completion > max_seq_len + 1:
            raise ConfigError(f"max_prompt_length + max_completion_length = {prompt + completion} exceeds the "
                              f"model's max_seq_len + 1 = {max_seq_len + 1} ({self.init_from})")
        return dataclasses.replace(self, max_prompt_length=prompt, max_completion_length=completion)


@dataclasses.dataclass
class RewardConfig(FinetuneConfig):
    # --- I/O
    out_dir: str = "out/reward"
    init_from: str = "out/sft/best.pt"  # the body starts here; the score head starts at zero
    # --- data
    data_path: str = "data/dpo.jsonl"  # train_dpo.py's preference pairs; or a glob / comma list
    max_prompt_length: int | None = None  # longer prompts lose their beginning; None: half of max_seq_len
    max_completion_length: int | None = None  # longer answers lose their end; None: the rest of max_seq_len
    pack: bool = False  # whole pairs packed into rows of 2 x max_seq_len, attention kept inside each sequence
    # --- training length
    batch_size: int = 16  # per rank: pairs, 2 x batch_size sequences each padded to the longest; pack: rows
    epochs: int = 1  # reward models overfit their pairs after one pass (Ouyang et al. 2022 train one epoch)
    # --- optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW for the rest
    lr: float = 1e-5  # InstructGPT's 6B reward model took 9e-6: the body keeps what SFT taught it
    min_lr: float = 1e-6
    weight_decay: float = 0.0
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 0
    warmup_ratio: float | None = 0.03

    def fit_lengths(self, max_seq_len: int) -> "RewardConfig":
        """This config with max_prompt_length and max_completion_length as set, or splitting the model's
        max_seq_len (init_from's): the reward model reads a pair's rows whole, their last token too."""
        prompt = self.max_prompt_length or max_seq_len // 2
        completion = self.max_completion_length or max_seq_len - prompt
        if prompt + completion > max_seq_len:
            raise ConfigError(f"max_prompt_length + max_completion_length = {prompt + completion} exceeds the "
                              f"model's max_seq_len = {max_seq_len} ({self.init_from})")
        return dataclasses.replace(self, max_prompt_length=prompt, max_completion_length=completion)


@dataclasses.dataclass
class GRPOConfig(FinetuneConfig):
    # --- I/O
    out_dir: str = "out/grpo"
    init_from: str = "out/sft/best.pt"  # the policy starts here; it is also the KL's reference
    # --- data
    data_path: str = "data/rlaif.jsonl"  # JSONL {"conversations": [...], "answer" or "gt"}; or a glob / comma list
    max_prompt_length: int | None = None  # longer prompts lose their earliest turns; None: max_seq_len - max_new_tokens
    # --- rollouts: each prompt's group of completions, sampled together
    group_size: int = 6  # completions per prompt (MiniMind's num_generations)
    temperature: float = 0.8
    top_p: float = 1.0
    max_new_tokens: int = 256  # a completion that has not ended by then is cut, and scored as it is
    # --- rewards
    reward: str = "answer"  # comma-separated, summed: answer | calls | length | format | repetition | module:function | none
    reward_model: str | None = None  # a train_reward.py checkpoint: its score is added to the rewards
    # --- tools (agent RL): a completion's turns may call tools, whose results it reads (they carry no loss)
    tools: str | None = None  # None: one turn, no tools; builtin | calculate_math,... | file.py | module (tools.py)
    max_turns: int = 3  # turns per completion with tools, each of at most max_new_tokens (MiniMind's: 3)
    # --- the loss (grpo.py)
    loss_type: str = "cispo"  # cispo (MiniMind's default) | grpo (PPO's clipped ratio)
    clip_eps: float = 0.2  # grpo: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]
    clip_high: float = 5.0  # cispo: the importance weight's cap (MiniMind's epsilon_high)
    beta: float = 0.1  # weight of the KL to the reference (k3); 0: no reference is loaded
    ppo_epochs: int = 1  # optimizer steps on each batch of rollouts
    # --- training length
    batch_size: int = 8  # prompts per rank and micro-batch; each step trains on batch_size x group_size completions
    epochs: int = 1
    # --- optimizer: AdamW, weight decay on matrices only; or Muon for the blocks' matrices, AdamW for the rest
    lr: float = 1e-6
    min_lr: float = 1e-7
    weight_decay: float = 0.0
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per rollout batch
    warmup_steps: int = 10
    # --- logging, evaluation, checkpoints
    eval_interval: int = 50  # val_reward of greedy completions of held-out prompts (best.pt); also at step 0
    eval_steps: int = 8  # validation batches of batch_size prompts per evaluation
    save_interval: int = 100
    early_stopping_patience: int = 10  # in evaluations without a higher val_reward

    def fit_lengths(self, max_seq_len: int) -> "GRPOConfig":
        """This config with max_prompt_length set: what the model's max_seq_len leaves beside max_new_tokens."""
        prompt = self.max_prompt_length or max_seq_len - self.max_new_tokens
        if prompt < 1 or prompt + self.max_new_tokens > max_seq_len:
            raise ConfigError(f"max_prompt_length + max_new_tokens = {prompt} + {self.max_new_tokens} must fit in the "
                              f"model's max_seq_len = {max_seq_len} ({self.init_from})")
        return dataclasses.replace(self, max_prompt_length=prompt)


@dataclasses.dataclass
class PPOConfig(GRPOConfig):
    """PPO with a critic (train_ppo.py): GRPO's rollouts, rewards, tools and clipped loss; each token's advantage
    from a value model (GAE) instead of the group's mean."""
    # --- I/O
    out_dir: str = "out/ppo"
    # --- rollouts: each prompt's group of completions, sampled together
    group_size: int = 1  # completions per prompt: the critic is the baseline, so one will do (MiniMind's PPO)
    # --- the loss (grpo.py)
    loss_type: str = "grpo"  # grpo: PPO's clipped surrogate, on each token's advantage | cispo
    beta: float = 0.02  # KL penalty in the reward: beta x (log p_rollout - log p_ref) per token (MiniMind's kl_coef); 0: no reference
    ppo_epochs: int = 2  # optimizer steps on each batch of rollouts (MiniMind's ppo_update_iters); 1: nothing to clip
    # --- the critic (ppo.py): a copy of init_from with a scalar head, on the clipped value loss
    gamma: float = 1.0  # GAE's discount per token: 1, the reward comes once, at the end (MiniMind's)
    gae_lambda: float = 0.95  # GAE's lambda: 1 = the plain return less the value (unbiased, noisy); 0 = one-step TD
    value_clip: float = 0.2  # a value may move at most this far from the rollout's in one batch (MiniMind's cliprange_value)
    critic_lr: float = 1e-5  # the critic's peak lr, on the policy's warmup and cosine
    critic_min_lr: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.critic_min_lr > self.critic_lr:  # the cosine would climb
            raise ConfigError(f"config key 'critic_min_lr' must be at most critic_lr ({self.critic_lr!r}), got "
                              f"{self.critic_min_lr!r}")


@dataclasses.dataclass
class DistillConfig(TrainConfig):
    # --- I/O
    out_dir: str = "out/distill"
    teacher: str = "out/pretrain/best.pt"  # the trained checkpoint to learn from; its tokenizer must be this run's
    init_from: str | None = None  # the student's starting checkpoint; None: a fresh model from the model keys
    # --- data
    data_path: str = "data/pretrain_hq.jsonl"  # pretraining documents or SFT conversations (data_kind); glob / list
    data_kind: str = "pretrain"  # pretrain: loss on every token | sft: loss on the assistant's tokens only
    skip_bad: bool = False  # sft: skip (and count) malformed records instead of stopping at the first
    pack: bool = False  # sft: whole conversations packed into rows of max_seq_len (batch_size counts rows)
    # --- distillation: loss = alpha * T^2 * KL(teacher || student at temperature T) + (1 - alpha) * cross-entropy
    alpha: float = 0.5  # weight of the teacher's soft targets; 0: plain cross-entropy training
    temperature: float = 2.0  # T: above 1 the teacher's distribution spreads, showing its ranking of unlikely tokens

    def __post_init__(self):
        super().__post_init__()
        if self.pack and self.data_kind != "sft":
            raise ConfigError("config key 'pack' packs conversations (data_kind=sft); pretraining windows are full")


# -----------------------------------------------------------------------------
# the ranges: every key's valid values, checked as a config is built (load_config: one `error:` line naming the key)

def zero_means(meaning: str):
    """0 or more, where 0 switches something off: the rule says what."""
    return lambda v: v >= 0, f"0 ({meaning}) or more"


# each class's keys: key -> (test of its value, the rule as an error says it); a subclass inherits its bases' rules
# and may replace one. None always passes: a key that may be None is annotated so, and check_type saw to that.
RANGES = {
    TrainConfig: {
        "val_fraction": (lambda v: 0 < v < 1, "between 0 and 1"),
        "batch_size": AT_LEAST_1, "accum_steps": AT_LEAST_1, "max_steps": AT_LEAST_1, "epochs": AT_LEAST_1,
        "optimizer": (lambda v: v in OPTIMIZERS, " or ".join(OPTIMIZERS)),
        "lr": zero_means("frozen weights"), "min_lr": NOT_NEGATIVE, "weight_decay": NOT_NEGATIVE,
        "beta1": FRACTION, "beta2": FRACTION,
        "muon_lr": ABOVE_0, "muon_momentum": FRACTION,
        "max_grad_norm": zero_means("no clipping"),  # below 0 clip_grad_norm_ flips every gradient: ascent
        "warmup_steps": NOT_NEGATIVE, "warmup_ratio": FRACTION,
        "log_interval": AT_LEAST_1, "eval_interval": AT_LEAST_1, "eval_steps": AT_LEAST_1,
        "save_interval": AT_LEAST_1, "keep_checkpoints": AT_LEAST_1, "grad_log_interval": zero_means("off"),
        "seed": (lambda v: 0 <= v < 2**32, "0 to 2**32 - 1 (numpy's seeds)"),
        "max_bad_steps": AT_LEAST_1, "peak_flops": zero_means("measure it"),
    },
    FinetuneConfig: {
        "dropout": FRACTION,
        "lora_rank": zero_means("off"), "lora_alpha": ABOVE_0, "lora_dropout": FRACTION,
        "early_stopping_patience": AT_LEAST_1,  # 0 would stop at the first evaluation
        "early_stopping_threshold": NOT_NEGATIVE,  # below 0 a worse val_loss would count as an improvement
    },
    SFTConfig: {"max_seq_len": AT_LEAST_1},
    DPOConfig: {"max_prompt_length": AT_LEAST_1, "max_completion_length": AT_LEAST_1, "beta": ABOVE_0},
    RewardConfig: {
        "max_prompt_length": AT_LEAST_1, "max_completion_length": AT_LEAST_1,
        # a LoRA checkpoint saves its adapters only: the score head would be lost
        "lora_rank": (lambda v: v == 0, "0: train_reward.py trains the whole model"),
    },
    GRPOConfig: {
        "max_prompt_length": AT_LEAST_1,
        "group_size": (lambda v: v >= 2, "at least 2 (a group of one has no advantage)"),
        "temperature": (lambda v: v > 0, "above 0 (greedy completions of a prompt are all alike)"),
        "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "max_new_tokens": AT_LEAST_1, "max_turns": AT_LEAST_1,
        "loss_type": (lambda v: v in ("grpo", "cispo"), "grpo or cispo"),
        "clip_eps": (lambda v: 0 < v < 1, "in (0, 1)"), "clip_high": (lambda v: v >= 1, "at least 1"),
        "beta": zero_means("no KL, no reference"), "ppo_epochs": AT_LEAST_1,
    },
    PPOConfig: {
        "group_size": AT_LEAST_1,  # one completion per prompt: the critic, not a group, gives the baseline
        "gamma": (lambda v: 0 < v <= 1, "in (0, 1]"), "gae_lambda": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "value_clip": ABOVE_0, "critic_lr": ABOVE_0, "critic_min_lr": NOT_NEGATIVE,
    },
    DistillConfig: {
        "data_kind": (lambda v: v in ("pretrain", "sft"), "pretrain or sft"),
        "alpha": (lambda v: 0 <= v <= 1, "in [0, 1]"), "temperature": ABOVE_0,
    },
}


def check_train_ranges(config: TrainConfig):
    """The first key of config outside its range (RANGES, then min_lr <= lr, then one warmup) as a ConfigError."""
    check_ranges(config, {key: rule for cls in reversed(type(config).__mro__)
                          for key, rule in RANGES.get(cls, {}).items()})
    if config.min_lr > config.lr:  # the cosine would climb from lr to min_lr
        raise ConfigError(f"config key 'min_lr' must be at most lr ({config.lr!r}), got {config.min_lr!r}")
    if config.warmup_ratio is not None and config.warmup_steps:  # the ratio would win, the steps be ignored
        raise ConfigError(f"config keys 'warmup_steps' ({config.warmup_steps!r}) and 'warmup_ratio' "
                          f"({config.warmup_ratio!r}) both set the warmup: set warmup_steps=0 or warmup_ratio=None")


# -----------------------------------------------------------------------------
# reading them: defaults <- config file <- --key=value flags

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


def type_args(annotation) -> tuple:
    """The types a key may take: (int,) for int, (str, NoneType) for str | None."""
    return typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)


def check_type(key: str, value, annotation, source: str):
    allowed = type_args(annotation)
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


def words(name: str):
    """A field that takes the command line's bare words, shown as `name` in --help; a script that has one reads no
    config file. As in `runs: list[str] = words("RUN...")  # run directories`."""
    return dataclasses.field(default_factory=list, metadata={"usage": name})


def words_field(schemas) -> tuple | None:
    """(schema, field) of the schemas' words field, or None."""
    return next(((s, f) for s in schemas for f in dataclasses.fields(s) if "usage" in f.metadata), None)


def usage(schemas) -> str:
    """--help's first line: the script, its words or a config file, its --key=value flags."""
    script = os.path.basename(sys.argv[0]) if sys.argv[0].endswith(".py") else "script.py"
    found = words_field(schemas)
    return f"usage: python {script} {found[1].metadata['usage'] if found else '[config_file.py]'} [--key=value ...]"


def help_text(schemas, ignored) -> str:
    """--help: every key of the schemas with its default and comment, grouped as in the dataclasses."""
    found = words_field(schemas)
    lines = [usage(schemas), "--key=value flags override the defaults below." if found else
             "A config file's `key = value` lines override the defaults below; --key=value flags override both.",
             "A bool key alone (--key) means --key=True; every other key is --key=value, one word."]
    for schema in schemas:
        docs, groups = field_docs(schema), {}
        for f in dataclasses.fields(schema):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            group, comment = docs.get(f.name, ("", ""))
            groups.setdefault(group, []).append((f.metadata.get("usage", f"--{f.name}={default}"), comment))
        for group, rows in groups.items():
            lines.append(f"\n{group or schema.__name__}:")
            width = max(len(flag) for flag, _ in rows)
            lines += [f"  {flag:<{width}}  {comment}".rstrip() for flag, comment in rows]
    if ignored:
        lines.append(f"\nAccepted and ignored (training keys): {', '.join(sorted(ignored))}")
    return "\n".join(lines)


def flag_setting(arg: str, fields: dict) -> tuple:
    """(key, value) of one --key=value flag; a bool key alone is True, a str key's text stays text (--api_key=123)."""
    key, has_value, text = arg[2:].partition("=")
    if not arg.startswith("--") or not key:
        raise ConfigError(f"expected --key=value, got {arg!r}")
    allowed = type_args(fields[key][1]) if key in fields else ()
    if not has_value:
        if allowed and bool not in allowed:
            raise ConfigError(f"expected --key=value, got {arg!r}: write --{key}=VALUE, one word without a space")
        return key, True  # an unknown key alone is named as unknown by the caller
    value = parse_flag_value(text)
    return key, text if str in allowed and value is not None and not isinstance(value, str) else value


def load_config(argv: list[str], *schemas, ignored=()):
    """Build one instance of each dataclass in schemas from `[config_file] [--key=value ...]`, or from
    `[words] [--key=value ...]` if a schema has a words field. Every key must belong to one of the schemas (or to
    a dataclass in `ignored`: accepted, named in one line, then dropped) and match its field's type. -h / --help
    prints every key and exits."""
    argv = list(argv or [])
    found = words_field(schemas)
    fields = {f.name: (schema, typing.get_type_hints(schema)[f.name]) for schema in schemas  # the types, not strings
              for f in dataclasses.fields(schema) if "usage" not in f.metadata}
    skip = {f.name for schema in ignored for f in dataclasses.fields(schema)} - set(fields)
    if "-h" in argv or "--help" in argv:
        print(help_text(schemas, skip))
        raise SystemExit(0)
    settings = []  # (key, value, source), applied in order: the file first, then the flags
    if not found and argv and not argv[0].startswith("-"):
        path = argv.pop(0)
        settings += [(k, v, path) for k, v in read_config_file(path).items()]
    values: dict = {schema: {} for schema in schemas}
    if found:
        values[found[0]][found[1].name] = [arg for arg in argv if not arg.startswith("-")]
        argv = [arg for arg in argv if arg.startswith("-")]
    settings += [(*flag_setting(arg, fields), "command line") for arg in argv]
    dropped = sorted({key for key, _, _ in settings if key in skip})
    if dropped:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"ignoring training keys that do not apply here: {', '.join(dropped)}", flush=True)
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
