"""
Checkpoints: what a run saves and how anything loads it back.

  prepare_training   a built model -> what its training loop works with (Training): optimizer, GradScaler,
                     guard, checkpoints (resumed), the wrapped model, metrics log, signals, profiler, step timer
  Checkpoints        save (atomically) and resume everything a run needs to continue exactly: full-precision
                     weights, optimizer, GradScaler, data position, every rank's RNG states, configs, loop state
  EarlyStopping      which evaluation is best.pt, and when a run without progress stops
  model_from_checkpoint, load_model   a checkpoint's model (LoRA adapters merged onto their base) and tokenizer
  finetune_model     SFT's and DPO's starting model, with this run's switches (and LoRA adapters)
"""
import contextlib
import dataclasses
import functools
import glob
import os
import pickle
import random
import re
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from errors import CheckpointError, ConfigError, NonFiniteError, TokenizerError
from fileio import atomic_write
from lora import add_lora, lora_layers, merge_lora, trainable_params
from metrics import MetricsLog, StepTimer, start_profiler
from model import ModelConfig, Transformer
from optim import NonFiniteGuard, configure_optimizer
from runtime import Run, StopSignal, print0, seed_rank, wrap
from token_cache import file_digest
from tokenizer import NANOMIND_DIR, load_tokenizer


# -----------------------------------------------------------------------------
# a run's checkpoints: everything an exact resume needs

def step_checkpoints(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "step_*.pt")))


def newest_checkpoint(out_dir: str) -> str | None:
    """The checkpoint of out_dir at the latest step: the newest step_*.pt, or best.pt when an evaluation saved it
    after that (evaluations usually come more often than step checkpoints). A tie goes to the step checkpoint."""
    steps, best = step_checkpoints(out_dir), os.path.join(out_dir, "best.pt")
    if not os.path.exists(best):
        return steps[-1] if steps else None
    if steps and int(os.path.basename(steps[-1])[5:-3]) >= load_checkpoint(best, mmap=True)["step"]:
        return steps[-1]
    return best


def checkpoint_to_resume(cfg) -> str | None:
    """Create out_dir; the checkpoint to resume from with --resume=True (newest_checkpoint), None for a fresh run.
    A fresh run refuses an out_dir that holds checkpoints: nothing already written is overwritten."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    for tmp in glob.glob(os.path.join(glob.escape(cfg.out_dir), "*.pt.tmp")):
        with contextlib.suppress(FileNotFoundError):  # another rank may have removed it
            os.remove(tmp)  # a save that a kill cut short: never read, and as large as a checkpoint
    held = [os.path.basename(p) for p in step_checkpoints(cfg.out_dir)]
    held += ["best.pt"] * os.path.exists(os.path.join(cfg.out_dir, "best.pt"))
    if not cfg.resume:
        if held:
            raise ConfigError(f"{cfg.out_dir} already holds checkpoints ({', '.join(held)}): pass --resume=True to "
                              f"continue from the newest, or start over in another out_dir (or after moving them away)")
        return None
    if not held:
        print0(f"resume: {cfg.out_dir} holds no checkpoint yet, starting at step 0")
    return newest_checkpoint(cfg.out_dir)


class Training(NamedTuple):
    """What a training loop works with (prepare_training), in the order the scripts unpack it."""
    model: torch.nn.Module  # the one the loop trains: compiled and DDP-wrapped as asked (runtime.wrap)
    raw_model: torch.nn.Module  # unwrapped: for saving, evaluation, sampling and FLOPs
    optimizer: torch.optim.Optimizer  # AdamW, or Muon and AdamW, over the trainable parameters (LoRA: the adapters)
    scaler: torch.amp.GradScaler  # enabled for float16 only: bfloat16 has float32's range
    guard: NonFiniteGuard
    checkpoints: "Checkpoints"  # they save all of the above
    step: int  # the first step to run: 0, or the resumed checkpoint's
    log: MetricsLog
    stop: StopSignal
    profiler: torch.profiler.profile | None  # with profile=True, on rank 0
    timer: StepTimer


def prepare_training(cfg, stage: str, run: Run, model, loader, early, resume_from: str | None, max_steps: int,
                     phases: tuple = StepTimer.PHASES, extra_parts: dict | None = None) -> Training:
    """What a built model's training loop works with, resumed from resume_from (None: a fresh run). stage: the
    run's kind, recorded for sample.py; phases: the parts the timer splits a step into; extra_parts: more that a
    checkpoint saves and resumes, by name (train_ppo.py's critic, its optimizer and guard)."""
    seed_rank(cfg.seed, run)  # each rank a random stream of its own (dropout): the model was built alike on all
    optimizer = configure_optimizer(model, cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), run.device.type,
                                    cfg.optimizer, cfg.muon_lr, cfg.muon_momentum)
    scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")
    guard = NonFiniteGuard(model, cfg.max_bad_steps, run.device)
    lora = lora_record(cfg) if lora_layers(model) else None
    checkpoints = Checkpoints(cfg, model.config, stage, run, model, optimizer, scaler, loader, guard, early, lora,
                              extra_parts)
    step = checkpoints.resume(resume_from)
    wrapped = wrap(model, cfg, run)
    log, stop, profiler = MetricsLog(cfg, run, step, max_steps), StopSignal(run), start_profiler(cfg, run)
    timer = StepTimer(run, cfg.peak_flops, step, max_steps, phases)
    return Training(wrapped, model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer)


class Checkpoints:
    """Everything a resume needs, in out_dir: full-precision weights, optimizer, GradScaler, data position, every
    rank's RNG states, the configs and the loop's own state (step, guard, early stopping), and any extra parts
    (each with state_dict and load_state_dict). A LoRA run (lora: its lora_record) saves only the trainable tensors
    of its models -- the adapters, and a critic's head -- and the record: a few MB."""

    def __init__(self, cfg, model_cfg, stage: str, run: Run, model, optimizer, scaler, loader, guard, early,
                 lora: dict | None = None, extra_parts: dict | None = None):
        self.cfg, self.model_cfg, self.stage, self.run, self.lora = cfg, model_cfg, stage, run, lora
        tokenizer = load_tokenizer(cfg.tokenizer_path)  # recorded: sampling, serving and export use the same
        self.tokenizer = {"path": cfg.tokenizer_path, "fingerprint": tokenizer.fingerprint,
                          "chat_template": tokenizer.chat_template}
        self.parts = {"model": model, "optimizer": optimizer, "scaler": scaler, "loader": loader, "guard": guard,
                      "early_stopping": early} | (extra_parts or {})

    def save(self, name: str, step: int):
        """Write out_dir/name atomically (every rank must call this: RNG states are gathered; rank 0 writes);
        after a step_*.pt, keep only the newest keep_checkpoints of them."""
        state = {key: part.state_dict() for key, part in self.parts.items()}
        state |= {"step": step, "stage": self.stage, "config": dataclasses.asdict(self.cfg), "tokenizer": self.tokenizer,
                  "model_config": dataclasses.asdict(self.model_cfg), "rng": gather_rng_states(self.run)}
        if self.lora:
            state |= {key: trainable_state(part) for key, part in self.parts.items() if isinstance(part, torch.nn.Module)}
            state["lora"] = self.lora
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
            for old in step_checkpoints(self.cfg.out_dir)[: -self.cfg.keep_checkpoints]:
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
        trained_with = state["config"].get("optimizer", "adamw")
        if trained_with != self.cfg.optimizer:
            raise CheckpointError(f"{path} was trained with optimizer {trained_with}, this run asks for "
                                  f"{self.cfg.optimizer}: keep its optimizer to resume")
        for key, part in self.parts.items():
            if isinstance(part, torch.nn.Module):  # the model, a critic
                load_model_state(part, state[key], path, adapters_only=bool(self.lora))
            else:
                part.load_state_dict(state[key])
        set_rng_state(state["rng"][self.run.rank])
        print0(f"resumed from {path} at step {state['step']}")
        return state["step"]


class EarlyStopping:
    """Tracks the best validation loss (or another metric; maximize: higher is better, as a reward); with a
    patience, says when to stop (that many evaluations in a row without an improvement of more than threshold)."""

    def __init__(self, patience: int | None = None, threshold: float = 0.0, metric: str = "val_loss",
                 maximize: bool = False):
        self.patience, self.threshold, self.metric = patience, threshold, metric
        self.sign = -1.0 if maximize else 1.0  # compare sign * value: lower is better
        self.best, self.stale = self.sign * float("inf"), 0

    def update(self, value: float) -> bool:
        """Record an evaluation; True when it is a new best."""
        self.stale = 0 if self.sign * value < self.sign * self.best - self.threshold else self.stale + 1
        improved = self.sign * value < self.sign * self.best
        self.best = value if improved else self.best
        return improved

    @property
    def should_stop(self) -> bool:
        if self.patience is not None and self.stale >= self.patience:
            print0(f"early stopping: {self.stale} evaluations without an improvement of {self.threshold}; "
                   f"best {self.metric} {self.best:.4f}")
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best, "stale": self.stale}

    def load_state_dict(self, state: dict):
        self.best, self.stale = state["best"], state["stale"]


def rng_state() -> dict:
    """Every generator's state as tensors, numbers and strings: loadable with weights_only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
            # the rank's own GPU alone (setup made it current): a machine with fewer GPUs can resume it
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if not torch.cuda.is_available() or (isinstance(cuda, list) and len(cuda) <= torch.cuda.current_device()):
        return  # no GPU here, or an older checkpoint's list of every GPU's state without this one
    torch.cuda.set_rng_state(cuda[torch.cuda.current_device()] if isinstance(cuda, list) else cuda)


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
    """torch.save to a temp file, fsync, rename: a crash leaves the old file or the new one, never half; a full disk
    leaves the old one and no temp file (fileio.atomic_write)."""
    with atomic_write(path) as f:
        torch.save(obj, f)


# -----------------------------------------------------------------------------
# loading a checkpoint's model and tokenizer

# checkpoints saved before the RNG states were lists hold numpy's generator key as an array; rebuilding an array
# runs no code, so these may be unpickled too
NUMPY_ARRAYS = [(getattr(np, "_core", None) or np.core).multiarray._reconstruct, np.ndarray, np.dtype,
                type(np.dtype(np.uint32))]


def load_tensors(path: str, mmap: bool = False):
    """torch.load with weights_only: tensors, plain containers, numbers and strings only, so nothing in a file
    someone shared can run. A file that needs more is refused (a CheckpointError naming what it holds)."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAYS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(f"{path} holds a Python object ({found[1]}), not only tensors, numbers and strings: "
                                  "refused, and nothing in it was run (a checkpoint is loaded with weights_only)") from None
        raise CheckpointError(unreadable(path, e)) from None
    except Exception as e:  # truncated or garbled: torch raises several kinds
        raise CheckpointError(unreadable(path, e)) from None


def unreadable(path: str, e: Exception) -> str:
    others = sorted(set(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.pt"))) - {path})
    return f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); other checkpoints there: {others or 'none'}"


def load_checkpoint(path: str, mmap: bool = False) -> dict:
    """A checkpoint a nanomind run saved (Checkpoints.save), loaded with weights_only; anything else is refused in
    one line. mmap: tensors stay on disk until touched (to read a checkpoint's step or config)."""
    state = load_tensors(path, mmap)
    if not isinstance(state, dict) or not {"model", "model_config"} <= state.keys():
        what = (f"a dict of {len(state)} entries ({', '.join(map(str, list(state)[:3]))}{', ...' * (len(state) > 3)})"
                if isinstance(state, dict) else f"a {type(state).__name__}")
        raise CheckpointError(f"{path} is not a nanomind checkpoint: it holds {what}, not the 'model' and "
                              "'model_config' a training run saves (MiniMind .pth files and Hugging Face folders come "
                              "in by convert.py import)")
    return state


def load_model_state(model, state_dict: dict, source: str, adapters_only: bool = False):
    """Every weight of the model (adapters_only: every trainable one of a LoRA model, its adapters and any head)
    from state_dict, strictly: an error lists every missing, unexpected or reshaped key."""
    own = trainable_state(model) if adapters_only else model.state_dict()
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


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors of model.state_dict() (they share its storage) that train: of a LoRA model its adapters (what
    lora.adapter_state holds: add_lora froze the rest), of a LoRA critic its adapters and head."""
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def model_from_checkpoint(path: str, device="cpu", yarn: float | None = None, **overrides):
    """(Transformer with the checkpoint's architecture -- model_config updated by overrides such as flash or
    dropout, and by yarn (see longer_context) -- and its weights, loaded strictly; the checkpoint itself). A LoRA
    checkpoint's adapters come merged onto its base, so that every caller (sampling, evaluation, export,
    fine-tuning) takes it as it is."""
    state = load_checkpoint(path)
    if yarn is not None:
        overrides |= longer_context(state["model_config"], yarn, path)
    if state.get("stage") == "reward":
        raise CheckpointError(f"{path} is a reward model (train_reward.py), not a language model: it scores answers "
                              f"(reward_model.load_reward_model, eval.py pairs) and cannot generate or fine-tune")
    if "lora" in state:
        return merge_lora(lora_model(state, path, **overrides)).to(device), state
    model = Transformer(ModelConfig(**{**state["model_config"], **overrides}))
    load_model_state(model, state["model"], path)
    return model.to(device), state


@functools.cache
def nanomind_fingerprint() -> str:
    return load_tokenizer(NANOMIND_DIR).fingerprint


def trained_tokenizer_path(state: dict) -> str | None:
    """The tokenizer_path a checkpoint's run used, None meaning the default. A run that named none used the default
    of its day: MiniMind's now, nanomind's own before (told apart by the recorded fingerprint; a checkpoint older
    than the record is of nanomind's days)."""
    path, recorded = state.get("config", {}).get("tokenizer_path"), state.get("tokenizer")
    if path is None and (not recorded or recorded["fingerprint"] == nanomind_fingerprint()):
        return str(NANOMIND_DIR)
    return shipped_tokenizer_moved(path)


def shipped_tokenizer_moved(path: str | None) -> str | None:
    """The shipped tokenizers' folder was tokenizer/ (beside tokenizer.py) before it became vocab/: a checkpoint
    that recorded tokenizer/nanomind or tokenizer/minimind, and finds no such folder, gets the one in vocab/."""
    parts = os.path.normpath(path).split(os.sep) if path else []
    if len(parts) >= 2 and parts[-2] == "tokenizer" and parts[-1] in ("nanomind", "minimind") and not os.path.isdir(path):
        return str(NANOMIND_DIR.parent / parts[-1])
    return path


def checkpoint_tokenizer(state: dict, tokenizer_path: str | None = None):
    """The tokenizer a checkpoint was trained with (trained_tokenizer_path), or tokenizer_path, which must hold the
    same files: other ids would turn its output into wrong text, silently."""
    path = tokenizer_path if tokenizer_path is not None else trained_tokenizer_path(state)
    tokenizer = load_tokenizer(path)
    recorded = state.get("tokenizer")  # absent from checkpoints written before it was recorded
    if recorded and recorded["fingerprint"] != tokenizer.fingerprint:
        raise TokenizerError(f"tokenizer {path or 'the default'} is not the one the checkpoint was trained with "
                             f"({trained_tokenizer_path(state) or 'the default'}, {recorded['chat_template']} chat "
                             "template)")
    return tokenizer


def frozen_model(path: str, device, flash: bool | None):
    """A reference model (DPO's, RL's KL): eval mode, no gradients, so the optimizer never sees it. It takes the
    policy's attention path (not the one saved in the checkpoint), so at step 0 policy and reference agree exactly."""
    return model_from_checkpoint(path, device, flash=flash)[0].eval().requires_grad_(False)


def longer_context(model_config: dict, factor: float, path: str) -> dict:
    """ModelConfig overrides that run a model factor times past the context it was trained at, by YaRN."""
    if factor <= 1:
        raise ConfigError(f"--yarn: the factor must be above 1, got {factor:g}")
    if model_config.get("rope_scaling"):
        raise ConfigError(f"--yarn: {path} scales its RoPE already ({model_config['rope_scaling']}, factor "
                          f"{model_config['rope_factor']:g} over {model_config['rope_original_max_len']} positions)")
    n = model_config["max_seq_len"]
    return {"rope_scaling": "yarn", "rope_factor": factor, "rope_original_max_len": n, "max_seq_len": int(n * factor)}


def load_model(path: str, device="cpu", tokenizer_path: str | None = None, yarn: float | None = None):
    """(eval-mode model, tokenizer, the checkpoint) for sampling, serving and evaluation: the tokenizer the
    checkpoint was trained with, or tokenizer_path if it holds the same files; yarn: a factor for a longer context."""
    model, state = model_from_checkpoint(path, device, yarn)
    tokenizer = checkpoint_tokenizer(state, tokenizer_path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but {path}'s model only "
                          f"{model.config.vocab_size}: pass the tokenizer_path it was trained with")
    return model.eval(), tokenizer, state


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
        cfg.tokenizer_path = trained_tokenizer_path(state)
    checkpoint_tokenizer(state, cfg.tokenizer_path)
    model.tok_embeddings.weight.requires_grad_(not cfg.freeze_embeddings)
    if cfg.lora_rank:  # everything frozen, adapters added
        total = model.num_params()
        add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets.split(","))
        print0(f"LoRA rank {cfg.lora_rank} on {cfg.lora_targets}: {trainable_params(model):,} parameters train, "
               f"{total:,} stay frozen")
    return model
