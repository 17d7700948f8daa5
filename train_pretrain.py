"""
Pretraining: next-token prediction on packed documents.

    python train_pretrain.py configs/26m.py --batch_size=32 --lr=3e-4        # one CPU or GPU
    torchrun --nproc_per_node=4 train_pretrain.py configs/26m.py             # DDP on 4 GPUs
"""
import dataclasses
import sys
from contextlib import nullcontext

import torch

from data import Loader, PretrainData, load_split, load_tokenizer
from model import ModelConfig, Transformer
from train_utils import (ConfigError, Progress, all_reduce_mean, get_lr, load_config, print0, seed_rank, set_lr,
                         setup, start, teardown, validation_loss, wrap)


@dataclasses.dataclass
class Config:
    # --- I/O
    out_dir: str = "out/pretrain"
    resume: bool = False  # continue from the latest checkpoint in out_dir
    # --- data
    data_path: str = "data/pretrain_hq.jsonl"
    val_data_path: str | None = None  # None: hold out val_fraction of the documents
    val_fraction: float = 0.01
    tokenizer_path: str | None = None  # None: the tokenizer shipped in tokenizer/
    # --- training length (model keys: see ModelConfig in model.py)
    batch_size: int = 64  # per rank
    accum_steps: int = 1
    max_steps: int | None = None  # None: epochs over the training windows
    epochs: int = 1
    # --- optimizer
    lr: float = 5e-4
    min_lr: float = 1e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0  # 0 disables clipping
    # --- schedule
    warmup_steps: int = 1000
    warmup_ratio: float | None = None  # if set: warmup_steps = warmup_ratio * max_steps
    # --- logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 2000
    eval_steps: int = 50
    save_interval: int = 5000
    keep_checkpoints: int = 3
    grad_log_interval: int = 0  # every this many steps, per-layer gradient norms (plot.py's gradient flow); 0: off
    profile: bool = False  # torch.profiler over steps 3-5: a Chrome trace in out_dir and the top ops table
    wandb: bool = False
    # --- system
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    compile: bool = False
    seed: int = 1337
    max_bad_steps: int = 10  # stop after this many non-finite steps in a row
    peak_flops: float = 0.0  # per device, for MFU; 0: measure a large matmul at startup


def main(argv: list[str]):
    cfg, model_cfg = load_config(argv, Config, ModelConfig)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    resume_from = start(cfg, model_cfg, run)

    # data: rank 0 tokenises (or finds the cache) first, then the other ranks read its cache
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but vocab_size is {model_cfg.vocab_size}")
    with run.rank0_first():
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer,
                                                "pretrain", verbose=run.master)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    loader = Loader(PretrainData(train_records, model_cfg.max_seq_len), cfg.batch_size, name="training windows",
                    **loader_args)
    val_loader = Loader(PretrainData(val_records, model_cfg.max_seq_len), cfg.batch_size,
                        name="validation windows", **loader_args)
    max_steps = cfg.max_steps or cfg.epochs * len(loader) // cfg.accum_steps
    warmup_steps = round(cfg.warmup_ratio * max_steps) if cfg.warmup_ratio is not None else cfg.warmup_steps
    print0(f"{len(loader.dataset):,} training and {len(val_loader.dataset):,} validation windows of "
           f"{model_cfg.max_seq_len + 1} tokens; {max_steps:,} steps of "
           f"{cfg.batch_size * cfg.accum_steps * run.world_size * model_cfg.max_seq_len:,} tokens")

    model = Transformer(model_cfg).to(run.device)
    print0(f"{model.num_params():,} parameters")
    seed_rank(cfg.seed, run)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), run.device.type)
    scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == "float16")  # float16 only
    progress = Progress("pretrain", cfg, model_cfg, run, model, optimizer, scaler, loader, max_steps)
    step = progress.resume(resume_from)
    raw_model, model = model, wrap(model, cfg, run)  # raw_model: unwrapped, for saving and evaluation

    def val_metrics() -> dict[str, float]:
        return {"val_loss": validation_loss(raw_model, val_loader, cfg.eval_steps, run)}

    while step < max_steps:
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        loss_sum = torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with progress.time("data"):
                X, Y, loss_mask, _ = loader.next_batch()
            # DDP all-reduces gradients in the backward of the last micro-step only
            with model.no_sync() if run.ddp and micro_step < cfg.accum_steps - 1 else nullcontext():
                with progress.time("forward"), run.autocast():
                    _, loss = model(X, Y, loss_mask)
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
        if step % cfg.eval_interval == 0 or step == max_steps:
            progress.validate(step, val_metrics)  # logs; saves best.pt on a new best
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            progress.save(step)
        if stopping:
            break
    print0(f"done: step {step}, best val_loss {progress.best_val_loss:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


if __name__ == "__main__":
    main(sys.argv[1:])
