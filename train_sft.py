"""
Supervised fine-tuning: teach a pretrained model the chat template, with loss on the assistant's tokens only.

    python train_sft.py configs/sft_26m.py --init_from=out/pretrain/best.pt --data_path=sft_mini_512.jsonl
"""
import dataclasses
import sys
from contextlib import nullcontext

import torch

from data import Loader, SFTData, load_split, load_tokenizer
from train_utils import (ConfigError, Progress, all_reduce_mean, get_lr, load_config, model_from_checkpoint, print0,
                         seed_rank, set_lr, setup, start, teardown, validation_loss, wrap)


@dataclasses.dataclass
class Config:
    # --- I/O
    out_dir: str = "out/sft"
    init_from: str = "out/pretrain/best.pt"  # the pretrained checkpoint; its model config is used
    resume: bool = False  # continue from the latest checkpoint in out_dir
    # --- data
    data_path: str = "data/sft_mini_512.jsonl"
    val_data_path: str | None = None  # None: hold out val_fraction of the conversations
    val_fraction: float = 0.05
    tokenizer_path: str | None = None
    max_seq_len: int = 512  # longer conversations lose their earliest turns
    skip_bad: bool = False  # skip (and count) malformed conversations instead of stopping at the first
    # --- model switches (the architecture comes from init_from)
    flash: bool | None = None  # None: SDPA on CUDA, the math path on a CPU (see ModelConfig)
    grad_checkpoint: bool = False
    dropout: float = 0.0
    freeze_embeddings: bool = False  # keep the (tied) token embedding as pretrained: see configs/demo_sft.py
    # --- training length
    batch_size: int = 32  # per rank; batches pad to their longest conversation
    accum_steps: int = 1
    max_steps: int | None = None  # None: epochs
    epochs: int = 10
    early_stopping_patience: int = 3  # evaluations without an improvement of early_stopping_threshold
    early_stopping_threshold: float = 0.0
    # --- optimizer
    lr: float = 2e-5
    min_lr: float = 2e-6
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    # --- schedule
    warmup_steps: int = 0
    warmup_ratio: float | None = 0.05
    # --- logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 500  # and at every epoch end
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
    max_bad_steps: int = 10  # stop after this many non-finite steps in a row
    peak_flops: float = 0.0


def main(argv: list[str]):
    (cfg,) = load_config(argv, Config)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    # the pretrained model (strictly: every key, every shape), with this run's switches
    model, _ = model_from_checkpoint(cfg.init_from, run.device, flash=cfg.flash, grad_checkpoint=cfg.grad_checkpoint,
                                     dropout=cfg.dropout)
    model_cfg = model.config
    if cfg.max_seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"max_seq_len {cfg.max_seq_len} exceeds the model's {model_cfg.max_seq_len} ({cfg.init_from})")
    resume_from = start(cfg, model_cfg, run)

    tokenizer = load_tokenizer(cfg.tokenizer_path)
    with run.rank0_first():
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer, "sft",
                                                max_len=cfg.max_seq_len + 1, skip_bad=cfg.skip_bad, verbose=run.master)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    loader = Loader(SFTData(train_records), cfg.batch_size, name="training conversations", **loader_args)
    val_loader = Loader(SFTData(val_records), cfg.batch_size, name="validation conversations", **loader_args)
    steps_per_epoch = max(1, len(loader) // cfg.accum_steps)
    max_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup_steps = round(cfg.warmup_ratio * max_steps) if cfg.warmup_ratio is not None else cfg.warmup_steps
    print0(f"{len(train_records):,} training and {len(val_records):,} validation conversations; "
           f"{steps_per_epoch:,} steps per epoch, at most {max_steps:,} steps")

    model.tok_embeddings.weight.requires_grad_(not cfg.freeze_embeddings)
    seed_rank(cfg.seed, run)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), run.device.type)
    scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")
    progress = Progress("sft", cfg, model_cfg, run, model, optimizer, scaler, loader, max_steps)
    step = progress.resume(resume_from)
    raw_model, model = model, wrap(model, cfg, run)
    def val_metrics() -> dict[str, float]:
        return {"val_loss": validation_loss(raw_model, val_loader, cfg.eval_steps, run)}

    if step == 0:  # the pretrained model on the validation conversations: what SFT improves on
        print0("before SFT:")
        progress.evaluate(0, val_metrics)

    while step < max_steps:
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        loss_sum = torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with progress.time("data"):
                X, Y, loss_mask, _ = loader.next_batch()
            with model.no_sync() if run.ddp and micro_step < cfg.accum_steps - 1 else nullcontext():
                with progress.time("forward"), run.autocast():
                    _, loss = model(X, Y, loss_mask)  # mean over assistant tokens only
                with progress.time("backward"):
                    scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach()
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

        progress.log(step, loss, lr, grad_norm)
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


if __name__ == "__main__":
    main(sys.argv[1:])
