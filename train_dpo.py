"""
Direct preference optimisation: push an SFT model towards the chosen answer of each pair and away from the
rejected one, measured against a frozen copy of itself (the reference), with no reward model.

    python train_dpo.py configs/dpo_26m.py --init_from=out/sft/best.pt --data_path=dpo.jsonl

The loss of a pair (Rafailov et al. 2023), with pi = log p_policy(answer | prompt), ref = the same under the
reference model, and the sums running over the answer's tokens (its </s> included, the prompt excluded):
    loss = -log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))
"""
import dataclasses
import hashlib
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from data import DPOData, Loader, file_digest, load_split, load_tokenizer
from train_utils import (ConfigError, Progress, all_reduce_mean, evaluate, get_lr, load_config, model_from_checkpoint,
                         print0, seed_rank, set_lr, setup, start, teardown, wrap)


@dataclasses.dataclass
class Config:
    # --- I/O
    out_dir: str = "out/dpo"
    init_from: str = "out/sft/best.pt"  # the policy starts here
    ref_from: str | None = None  # the frozen reference; None: init_from
    resume: bool = False
    # --- data
    data_path: str = "data/dpo.jsonl"
    val_data_path: str | None = None
    val_fraction: float = 0.05
    tokenizer_path: str | None = None
    max_prompt_length: int = 256  # longer prompts lose their beginning
    max_completion_length: int = 256  # longer answers lose their end
    skip_bad: bool = False
    # --- DPO
    beta: float = 0.5  # how far the policy may move from the reference; larger = closer
    length_norm: bool = True  # mean log-prob per answer token (fair between long and short answers); False: sum
    precompute_ref: bool = False  # reference log-probs once, before training (cached beside the data)
    # --- model switches (the architecture comes from init_from)
    flash: bool | None = None  # None: SDPA on CUDA, the math path on a CPU (see ModelConfig)
    grad_checkpoint: bool = False
    dropout: float = 0.0
    freeze_embeddings: bool = False  # keep the (tied) token embedding as pretrained: see configs/demo_sft.py
    # --- training length
    batch_size: int = 16  # pairs per rank; each step runs 2 x batch_size sequences
    accum_steps: int = 1
    max_steps: int | None = None
    epochs: int = 2
    early_stopping_patience: int = 3
    early_stopping_threshold: float = 0.0
    # --- optimizer
    lr: float = 5e-6
    min_lr: float = 5e-7
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    # --- schedule
    warmup_steps: int = 100
    warmup_ratio: float | None = None
    # --- logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 500
    eval_steps: int = 50
    save_interval: int = 1000
    keep_checkpoints: int = 3
    grad_log_interval: int = 0  # every this many steps, per-layer gradient norms (plot.py's gradient flow); 0: off
    profile: bool = False  # torch.profiler over steps 3-5: a Chrome trace in out_dir and the top ops table
    wandb: bool = False
    # --- system
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    seed: int = 1337
    max_bad_steps: int = 10
    peak_flops: float = 0.0


def sequence_logprobs(model, X, Y, loss_mask, length_norm: bool) -> torch.Tensor:
    """log p(answer | prompt) of every row, (n,): the per-token log-probs of the targets (log_softmax of the
    logits at the target ids = minus the per-token cross-entropy), masked to the answer, summed over the
    sequence; divided by the answer's length when length_norm. Calls model() itself, so DDP sees a forward."""
    _, ce = model(X, Y, reduction="none")  # (n, T)
    logps = (-ce * loss_mask).sum(dim=-1)
    return logps / loss_mask.sum(dim=-1) if length_norm else logps


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float):
    """(mean DPO loss over the batch, metrics). Rewards are beta * (policy - reference) log-probs."""
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    margin = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(margin).mean()  # log(sigmoid(x)) computed stably for large |x|
    metrics = {"reward_margin": margin.mean(), "reward_acc": (margin > 0).float().mean(),
               "chosen_reward": chosen_rewards.mean(), "rejected_reward": rejected_rewards.mean(),
               "chosen_logp": policy_chosen_logps.mean(), "rejected_logp": policy_rejected_logps.mean()}
    return loss, {k: v.detach() for k, v in metrics.items()}


def load_frozen(path: str, device, flash: bool | None):
    """The reference model: eval mode, no gradients, so the optimizer never sees it. It takes the policy's
    attention path (not the one saved in the checkpoint), so at step 0 policy and reference agree exactly."""
    return model_from_checkpoint(path, device, flash=flash)[0].eval().requires_grad_(False)


@torch.no_grad()
def reference_logprobs(ref_path: str, cfg, loaders: list[Loader], run) -> list[torch.Tensor]:
    """Per-pair reference log-probs (n_pairs, 2) = (chosen, rejected) for each loader's dataset, computed once
    and cached beside the data file, keyed on the reference checkpoint, the data, the options and how they are
    computed: dtype, device type and attention path (bfloat16 log-probs are not float32 ones, SDPA's round
    differently from the math path's)."""
    key = hashlib.blake2b(repr((file_digest(ref_path), file_digest(cfg.data_path), cfg.val_data_path and
                                file_digest(cfg.val_data_path), cfg.val_fraction, cfg.length_norm,
                                cfg.max_prompt_length, cfg.max_completion_length, cfg.skip_bad, run.dtype,
                                run.device.type, cfg.flash)).encode(),
                          digest_size=8).hexdigest()
    path = f"{cfg.data_path}.ref-{key}.pt"
    if os.path.exists(path):
        return torch.load(path)
    ref = load_frozen(ref_path, run.device, cfg.flash)
    tables = []
    for loader in loaders:
        table = torch.zeros(len(loader.dataset), 2)
        for X, Y, M, idx in Loader(loader.dataset, loader.batch_size, loader.pad_id, run.device).batches(10**12):
            with run.autocast():
                logps = sequence_logprobs(ref, X, Y, M, cfg.length_norm).float().cpu()
            table[idx.cpu()] = torch.stack(logps.chunk(2), dim=1)
        tables.append(table)
    torch.save(tables, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    print0(f"reference log-probs of {sum(len(t) for t in tables):,} pairs cached in {path}")
    return tables


def main(argv: list[str]):
    (cfg,) = load_config(argv, Config)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    # the SFT model (strictly: every key, every shape), with this run's switches
    model, _ = model_from_checkpoint(cfg.init_from, run.device, flash=cfg.flash, grad_checkpoint=cfg.grad_checkpoint,
                                     dropout=cfg.dropout)
    model_cfg = model.config
    if cfg.max_prompt_length + cfg.max_completion_length > model_cfg.max_seq_len + 1:
        raise ConfigError(f"max_prompt_length + max_completion_length = "
                          f"{cfg.max_prompt_length + cfg.max_completion_length} exceeds the model's "
                          f"max_seq_len + 1 = {model_cfg.max_seq_len + 1} ({cfg.init_from})")
    resume_from = start(cfg, model_cfg, run)

    tokenizer = load_tokenizer(cfg.tokenizer_path)
    with run.rank0_first():
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer, "dpo",
                                                max_prompt_length=cfg.max_prompt_length, skip_bad=cfg.skip_bad,
                                                max_completion_length=cfg.max_completion_length, verbose=run.master)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    loader = Loader(DPOData(train_records), cfg.batch_size, name="training pairs", **loader_args)
    val_loader = Loader(DPOData(val_records), cfg.batch_size, name="validation pairs", **loader_args)
    steps_per_epoch = max(1, len(loader) // cfg.accum_steps)
    max_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup_steps = round(cfg.warmup_ratio * max_steps) if cfg.warmup_ratio is not None else cfg.warmup_steps
    print0(f"{len(train_records):,} training and {len(val_records):,} validation pairs; "
           f"{steps_per_epoch:,} steps per epoch, at most {max_steps:,} steps")

    ref_path = cfg.ref_from or cfg.init_from
    if cfg.precompute_ref:  # half the forward passes, and no second model in memory while training
        with run.rank0_first():
            ref_tables = [t.to(run.device) for t in reference_logprobs(ref_path, cfg, [loader, val_loader], run)]
        ref_model = None
    else:
        ref_model = load_frozen(ref_path, run.device, cfg.flash)

    def pair_losses(policy, X, Y, M, idx):
        """DPO loss and metrics of a batch: chosen rows first, then rejected, through one forward pass."""
        logps = sequence_logprobs(policy, X, Y, M, cfg.length_norm)
        if ref_model is not None:
            with torch.no_grad():
                ref = sequence_logprobs(ref_model, X, Y, M, cfg.length_norm)
            ref_chosen, ref_rejected = ref.chunk(2)
        else:
            table = ref_tables[0] if policy.training else ref_tables[1]
            ref_chosen, ref_rejected = table[idx].unbind(dim=1)
        return dpo_loss(*logps.chunk(2), ref_chosen, ref_rejected, cfg.beta)

    model.tok_embeddings.weight.requires_grad_(not cfg.freeze_embeddings)
    seed_rank(cfg.seed, run)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), run.device.type)
    scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")
    progress = Progress("dpo", cfg, model_cfg, run, model, optimizer, scaler, loader, max_steps)
    step = progress.resume(resume_from)
    raw_model, model = model, wrap(model, cfg, run)

    def val_metrics() -> dict[str, float]:
        def batch_metrics(*batch):
            loss, metrics = pair_losses(raw_model, *batch)
            return {"loss": loss, **metrics}

        raw_model.eval()
        with run.autocast():
            metrics = evaluate(batch_metrics, val_loader, cfg.eval_steps, run)
        raw_model.train()
        return {f"val_{k}": v for k, v in metrics.items()}

    names = ["reward_margin", "reward_acc", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp"]
    watch = FailureWatch()
    while step < max_steps:
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        loss_sum = torch.zeros((), device=run.device)
        metric_sums = torch.zeros(len(names), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with progress.time("data"):
                X, Y, loss_mask, idx = loader.next_batch()
            with model.no_sync() if run.ddp and micro_step < cfg.accum_steps - 1 else nullcontext():
                with progress.time("forward"), run.autocast():
                    loss, metrics = pair_losses(model, X, Y, loss_mask, idx)
                with progress.time("backward"):
                    scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach()
            metric_sums += torch.stack([metrics[k].float() for k in names])
            progress.count(X)
        with progress.time("optimizer"):
            loss = all_reduce_mean(loss_sum / cfg.accum_steps, run)  # all ranks must step, or skip, alike
            scaler.unscale_(optimizer)  # clip the true gradients, not the float16-scaled ones
            progress.grad_flow(step + 1, raw_model)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            progress.skip_nonfinite(optimizer, scaler, loss, grad_norm)  # a NaN/Inf step changes nothing
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % cfg.log_interval == 0 or step == max_steps:
            means = all_reduce_mean(metric_sums / cfg.accum_steps, run).tolist()
            progress.log(step, loss, lr, grad_norm, **dict(zip(names, means)))
            watch.update(loss.item(), means[names.index("chosen_logp")], step > warmup_steps)
        stopping = progress.stop_requested(step)
        if step % cfg.eval_interval == 0 or step % steps_per_epoch == 0 or step == max_steps:
            stopping |= progress.validate(step, val_metrics, cfg.early_stopping_patience,
                                          cfg.early_stopping_threshold)  # logs; best.pt; early stopping
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            progress.save(step)
        if stopping:
            break
    print0(f"done: step {step}, best val_loss {progress.best_val_loss:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


class FailureWatch:
    """The two classic DPO failures, seen over the last `window` log lines; each is printed once."""

    def __init__(self, window: int = 10):
        self.window, self.rows, self.warned = window, [], set()

    def update(self, loss: float, chosen_logp: float, past_warmup: bool):
        self.rows.append((loss, chosen_logp))
        recent = self.rows[-self.window :]
        if not past_warmup or len(recent) < self.window:
            return
        if all(abs(loss - math.log(2)) < 0.01 for loss, _ in recent):
            self.warn("flat", f"the DPO loss has sat at ln 2 = {math.log(2):.3f} for {self.window} log lines: the "
                              f"policy is not moving from the reference (lr or beta too small? chosen == rejected?)")
        logps = [logp for _, logp in recent]
        if all(b < a for a, b in zip(logps, logps[1:])):
            self.warn("falling", f"the chosen answers' log-prob fell for {self.window} log lines in a row "
                                 f"({logps[0]:.3f} -> {logps[-1]:.3f}): DPO is pushing both answers down; try a "
                                 f"larger beta, a smaller lr or fewer steps")

    def warn(self, kind: str, message: str):
        if kind not in self.warned:
            self.warned.add(kind)
            print0(f"warning: {message}")


if __name__ == "__main__":
    main(sys.argv[1:])
