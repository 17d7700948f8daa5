"""
Supervised fine-tuning: teach a pretrained model the chat template, with loss on the assistant's tokens only.

    python train_sft.py configs/sft_26m.py --init_from=out/pretrain/best.pt --data_path=sft_mini_512.jsonl
    python train_sft.py --help                                        # every key, its default and meaning
"""
import dataclasses

import torch

from data import Loader, SFTData, load_split, load_tokenizer
from train_utils import (ConfigError, EarlyStopping, FinetuneConfig, MetricsLog, StepTimer, StopSignal, all_reduce_mean,
                         all_reduce_sum, checkpoint_to_resume, cli, clip_gradients, count_token_bytes, get_lr,
                         finetune_model, load_config, perplexity, prepare_training, print0, print_run, schedule_length,
                         set_lr, setup, start_profiler, teardown, validation_loss, wrap)


@dataclasses.dataclass
class Config(FinetuneConfig):
    # --- I/O
    out_dir: str = "out/sft"
    # --- data
    data_path: str = "data/sft_mini_512.jsonl"  # JSONL {"conversations": [{"role", "content"}, ...]}; or a glob / comma list
    max_seq_len: int = 512  # longer conversations lose their earliest turns
    # --- training length
    batch_size: int = 32  # per rank; batches pad to their longest conversation
    epochs: int = 10  # an upper bound: early stopping usually ends it sooner
    # --- optimizer: AdamW, weight decay on matrices only
    lr: float = 2e-5
    min_lr: float = 2e-6
    weight_decay: float = 0.01
    # --- schedule: linear warmup to lr, cosine decay to min_lr, stepped once per optimizer step
    warmup_steps: int = 0
    warmup_ratio: float | None = 0.05


def load_data(cfg, model_cfg, run, max_seq_len: int | None = None) -> tuple[Loader, Loader]:
    """Training and validation conversations of up to max_seq_len (default cfg.max_seq_len) + 1 tokens; rank 0
    tokenises (or finds the cache) first."""
    max_seq_len = max_seq_len or cfg.max_seq_len
    if max_seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"max_seq_len {max_seq_len} exceeds the model's {model_cfg.max_seq_len} ({cfg.init_from})")
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    with run.rank0_first("waiting for rank 0 to tokenise the data (or to find its cache)"):
        train_records, val_records = load_split(cfg.data_path, cfg.val_data_path, cfg.val_fraction, tokenizer, "sft",
                                                max_len=max_seq_len + 1, skip_bad=cfg.skip_bad, verbose=run.master)
    loader_args = dict(pad_id=tokenizer.pad_id, device=run.device, seed=cfg.seed, rank=run.rank, world_size=run.world_size)
    return (Loader(SFTData(train_records), cfg.batch_size, name="training conversations", **loader_args),
            Loader(SFTData(val_records), cfg.batch_size, name="validation conversations", **loader_args))


def main(argv: list[str]):
    (cfg,) = load_config(argv, Config)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = finetune_model(cfg, run)
    model_cfg = model.config
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    loader, val_loader = load_data(cfg, model_cfg, run)
    max_steps, warmup_steps, steps_per_epoch = schedule_length(cfg, loader, val_loader, run)

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold)
    optimizer, scaler, guard, checkpoints = prepare_training(cfg, model_cfg, "sft", run, model, loader, early)
    step = checkpoints.resume(resume_from)
    raw_model, model = model, wrap(model, cfg, run)  # raw_model: unwrapped, for saving, evaluation and FLOPs
    log, stop, profiler = MetricsLog(cfg, run, step, max_steps), StopSignal(), start_profiler(cfg, run)
    token_bytes = count_token_bytes(load_tokenizer(cfg.tokenizer_path))  # for val_bpb
    if step == 0:  # the pretrained model on the validation conversations: what SFT improves on
        log.write({"step": 0, **validation_loss(raw_model, val_loader, cfg.eval_steps, run, token_bytes)})
    timer = StepTimer(run, cfg.peak_flops, step, max_steps)

    while step < max_steps:
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # the step's loss is the mean over the answer tokens of all its micro-batches on all ranks, so that
        # batch_size x accum_steps x ranks is exactly one big batch: count those tokens before any backward
        with timer.phase("data"):
            batches = [loader.next_batch() for _ in range(cfg.accum_steps)]
            n_tokens = all_reduce_sum(sum(loss_mask.sum() for _, _, loss_mask, _ in batches), run).clamp(min=1)
        loss_sum = torch.zeros((), device=run.device)
        for micro_step, (X, Y, loss_mask, _) in enumerate(batches):
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    _, ce_sum = model(X, Y, loss_mask, reduction="sum")  # over this micro-batch's answer tokens
                    loss = ce_sum * run.world_size / n_tokens  # x world_size: DDP averages the ranks' gradients
                with timer.phase("backward"):
                    scaler.scale(loss).backward()
            loss_sum += loss.detach()
            timer.count(X, raw_model.flops_per_token(X.size(1)))
        with timer.phase("optimizer"):
            loss = all_reduce_mean(loss_sum, run)  # = the whole step's sum / n_tokens, the same on every rank
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
        if step % cfg.eval_interval == 0 or step % steps_per_epoch == 0 or step == max_steps:
            with timer.paused():
                val = validation_loss(raw_model, val_loader, cfg.eval_steps, run, token_bytes)
                log.write({"step": step, **val})
                if early.update(val["val_loss"]):
                    checkpoints.save("best.pt", step)
            stopping |= early.should_stop
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            with timer.paused():
                checkpoints.save(f"step_{step:07d}.pt", step)
        if stopping:  # a signal (saved above) or early stopping
            break
    stop.restore()
    print0(f"done: step {step}, best val_loss {early.best:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


if __name__ == "__main__":
    cli(main)
