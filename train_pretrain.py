"""
Pretraining: next-token prediction on packed documents.

    python train_pretrain.py configs/26m.py --batch_size=32 --lr=3e-4        # one CPU or GPU
    torchrun --nproc_per_node=4 train_pretrain.py configs/26m.py             # DDP on 4 GPUs
    python train_pretrain.py --help                                          # every key, its default and meaning

The keys are config.PretrainConfig's and the model's (model.ModelConfig).
"""
import torch

from checkpoint import EarlyStopping, checkpoint_to_resume, prepare_training
from config import PretrainConfig, load_config
from data import pretrain_loaders
from errors import ConfigError, cli
from losses import count_token_bytes, perplexity, validation_loss
from metrics import experts_row
from model import ModelConfig, Transformer, aux_loss
from optim import get_lr, schedule_length, set_lr
from runtime import all_reduce_mean, print0, print_run, setup, teardown
from tokenizer import load_tokenizer


def main(argv: list[str]):
    cfg, model_cfg = load_config(argv, PretrainConfig, ModelConfig)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but vocab_size is {model_cfg.vocab_size}")
    loader, val_loader = pretrain_loaders(cfg, tokenizer, model_cfg.max_seq_len, run)
    max_steps, warmup_steps, _ = schedule_length(cfg, loader, val_loader, run)

    model = Transformer(model_cfg).to(run.device)
    print0(f"{model.num_params():,} parameters" +
           (f", {model.num_params(active=True):,} of them active per token" if model_cfg.n_experts else ""))
    best = EarlyStopping()  # no patience: it only tracks the best validation loss
    training = prepare_training(cfg, "pretrain", run, model, loader, best, resume_from, max_steps)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    token_bytes = count_token_bytes(tokenizer)  # for val_bpb

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        loss_sum, aux_sum = torch.zeros((), device=run.device), torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with timer.phase("data"):
                X, Y, loss_mask, *_ = loader.next_batch()  # windows of one stream: no padding, no positions
            timer.count(X, raw_model.flops_per_token(X.size(1)))  # before the work: an error names it
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    _, loss = model(X, Y, loss_mask)
                    aux = aux_loss(model)  # the experts' load balancing (0 for a dense model)
                with timer.phase("backward"):
                    scaler.scale((loss + aux) / cfg.accum_steps).backward()
            loss_sum += loss.detach()
            aux_sum += aux.detach()
        with timer.phase("optimizer"):
            # all ranks step, skip and stop alike
            loss, stop_votes = all_reduce_mean(torch.stack([loss_sum / cfg.accum_steps, stop.vote()]), run)
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
