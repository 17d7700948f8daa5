"""
Pretraining: next-token prediction on packed documents.

    python train_pretrain.py configs/26m.py --batch_size=32 --lr=3e-4        # one CPU or GPU
    torchrun --nproc_per_node=4 train_pretrain.py configs/26m.py             # DDP on 4 GPUs
    python train_pretrain.py --help                                          # every key, its default and meaning
"""
import dataclasses

import torch

from data import Loader, PretrainData, load_split, load_tokenizer
from model import ModelConfig, Transformer
from train_utils import (ConfigError, EarlyStopping, MetricsLog, StepTimer, StopSignal, TrainConfig, all_reduce_mean,
                         checkpoint_to_resume, cli, clip_gradients, count_token_bytes, get_lr, load_config, perplexity,
                         prepare_training, print0, print_run, schedule_length, set_lr, setup, start_profiler, teardown,
                         validation_loss, wrap)


@dataclasses.dataclass
class Config(TrainConfig):
    # --- I/O
    out_dir: str = "out/pretrain"
    # --- data
    data_path: str = "data/pretrain_hq.jsonl"  # JSONL {"text"} or .txt; or a glob / comma list, read as one


def load_data(cfg, model_cfg, run) -> tuple[Loader, Loader]:
    """Training and validation windows; rank 0 tokenises (or finds the cache) first, the other ranks then read it."""
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but vocab_size is {model_cfg.vocab_size}")
    with run.rank0_first("waiting for rank 0 to tokenise the data (or to find its cache)"):
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer,
                                                "pretrain", verbose=run.master)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    return (Loader(PretrainData(train_records, model_cfg.max_seq_len), cfg.batch_size, name="training windows",
                   **loader_args),
            Loader(PretrainData(val_records, model_cfg.max_seq_len), cfg.batch_size, name="validation windows",
                   **loader_args))


def main(argv: list[str]):
    cfg, model_cfg = load_config(argv, Config, ModelConfig)  # the model's keys are ModelConfig's (model.py)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    loader, val_loader = load_data(cfg, model_cfg, run)
    max_steps, warmup_steps, _ = schedule_length(cfg, loader, val_loader, run)

    model = Transformer(model_cfg).to(run.device)
    print0(f"{model.num_params():,} parameters")
    best = EarlyStopping()  # no patience: it only tracks the best validation loss
    optimizer, scaler, guard, checkpoints = prepare_training(cfg, model_cfg, "pretrain", run, model, loader, best)
    step = checkpoints.resume(resume_from)
    raw_model, model = model, wrap(model, cfg, run)  # raw_model: unwrapped, for saving, evaluation and FLOPs
    log, stop, profiler = MetricsLog(cfg, run, step, max_steps), StopSignal(), start_profiler(cfg, run)
    timer = StepTimer(run, cfg.peak_flops, step, max_steps)
    token_bytes = count_token_bytes(load_tokenizer(cfg.tokenizer_path))  # for val_bpb

    while step < max_steps:
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        loss_sum = torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with timer.phase("data"):
                X, Y, loss_mask, _ = loader.next_batch()
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    _, loss = model(X, Y, loss_mask)
                with timer.phase("backward"):
                    scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach()
            timer.count(X, raw_model.flops_per_token(X.size(1)))
        with timer.phase("optimizer"):
            loss = all_reduce_mean(loss_sum / cfg.accum_steps, run)  # all ranks must step, or skip, alike
            grad_norm = clip_gradients(model, optimizer, scaler, cfg.max_grad_norm)
            log.grad_flow(step + 1, raw_model, cfg.grad_log_interval)
            guard.step(optimizer, scaler, loss, grad_norm)  # a NaN/Inf update is skipped
        step += 1
        if profiler:
            profiler.step()

        stopping = False
        if step % cfg.log_interval == 0 or step == max_steps:  # the loop's only host syncs (.item())
            guard.report(step, loss.item(), grad_norm.item())
            log.write({"step": step, "loss": loss.item(), "ppl": perplexity(loss.item()), "lr": lr,
                       "grad_norm": grad_norm.item(), "skipped_steps": guard.reported, **timer.read(step)})
            stopping = stop.requested(run, step)  # Ctrl-C / SIGTERM, agreed on by all ranks
        if step % cfg.eval_interval == 0 or step == max_steps:
            with timer.paused():
                val = validation_loss(raw_model, val_loader, cfg.eval_steps, run, token_bytes)
                log.write({"step": step, **val})
                if best.update(val["val_loss"]):
                    checkpoints.save("best.pt", step)
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            with timer.paused():
                checkpoints.save(f"step_{step:07d}.pt", step)
        if stopping:  # a signal (saved above) or early stopping
            break
    stop.restore()
    print0(f"done: step {step}, best val_loss {best.best:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


if __name__ == "__main__":
    cli(main)
