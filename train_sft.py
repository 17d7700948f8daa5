"""
Supervised fine-tuning: teach a pretrained model the chat template, with loss on the assistant's tokens only.

    python train_sft.py configs/sft_26m.py --init_from=out/pretrain/best.pt --data_path=sft_mini_512.jsonl
    python train_sft.py --help                                        # every key, its default and meaning

The keys are config.SFTConfig's; the model is init_from's.
"""
import torch

from checkpoint import EarlyStopping, checkpoint_to_resume, finetune_model, prepare_training
from config import SFTConfig, load_config
from data import sft_loaders
from errors import ConfigError, cli
from losses import count_token_bytes, perplexity, validation_loss
from metrics import experts_row
from model import aux_loss
from optim import get_lr, schedule_length, set_lr
from runtime import all_reduce_mean, all_reduce_sum, print0, print_run, setup, teardown
from tokenizer import load_tokenizer


def main(argv: list[str]):
    (cfg,) = load_config(argv, SFTConfig)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = finetune_model(cfg, run)
    model_cfg = model.config
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    if cfg.max_seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"max_seq_len {cfg.max_seq_len} exceeds the model's {model_cfg.max_seq_len} ({cfg.init_from})")
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    loader, val_loader = sft_loaders(cfg, tokenizer, cfg.max_seq_len, run)
    max_steps, warmup_steps, steps_per_epoch = schedule_length(cfg, loader, val_loader, run)

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold)
    training = prepare_training(cfg, "sft", run, model, loader, early, resume_from, max_steps)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    token_bytes = count_token_bytes(tokenizer)  # for val_bpb
    if step == 0:  # the pretrained model on the validation conversations: what SFT improves on
        with timer.paused():
            log.write({"step": 0, **validation_loss(raw_model, val_loader, cfg.eval_steps, run, token_bytes)})

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # the step's loss is the mean over the answer tokens of all its micro-batches on all ranks, so that
        # batch_size x accum_steps x ranks is exactly one big batch: count those tokens before any backward
        with timer.phase("data"):
            batches = [loader.next_batch() for _ in range(cfg.accum_steps)]
            n_tokens = all_reduce_sum(sum(batch.loss_mask.sum() for batch in batches), run).clamp(min=1)
        loss_sum, aux_sum = torch.zeros((), device=run.device), torch.zeros((), device=run.device)
        for micro_step, (X, Y, loss_mask, _, positions, _, real_tokens) in enumerate(batches):
            timer.count(X, raw_model.flops_per_token(X.size(1)), real_tokens)  # before the work: an error names it
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    # over this micro-batch's answer tokens; positions: packed rows' (pack=True)
                    _, ce_sum = model(X, Y, loss_mask, reduction="sum", positions=positions)
                    loss = ce_sum * run.world_size / n_tokens  # x world_size: DDP averages the ranks' gradients
                    aux = aux_loss(model)  # the experts' load balancing (0 for a dense model)
                with timer.phase("backward"):
                    scaler.scale(loss + aux / cfg.accum_steps).backward()
            loss_sum += loss.detach()
            aux_sum += aux.detach()
        with timer.phase("optimizer"):
            # the loss = the whole step's sum / n_tokens, the same on every rank; all ranks stop alike
            loss, stop_votes = all_reduce_mean(torch.stack([loss_sum, stop.vote()]), run)
            scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            log.grad_flow(step + 1, raw_model, cfg.grad_log_interval)
            guard.check(loss, grad_norm, optimizer)  # a NaN/Inf loss or gradient: this step is skipped
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        if profiler:
            profiler.step()

        stopping = stop.requested(stop_votes, step)  # Ctrl-C / SIGTERM on any rank: all ranks save and stop
        if step % cfg.log_interval == 0 or step == max_steps:  # the loop's only host syncs (.item())
            skipped = guard.report(step, loss.item(), grad_norm.item())  # names skipped steps; too many stop the run
            log.write({"step": step, "loss": loss.item(), "ppl": perplexity(loss.item()), "lr": lr,
                       "grad_norm": grad_norm.item(), "skipped_steps": skipped, **timer.read(step),
                       **experts_row(raw_model, aux_sum / cfg.accum_steps, run)})
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
