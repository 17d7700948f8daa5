"""
A reward model: an SFT model with a scalar head on each sequence's last token (reward_model.py), trained to score
the chosen answer of each preference pair (the pairs train_dpo.py reads) above the rejected one. Its best.pt is
what train_grpo.py takes as reward_model; eval.py pairs measures how often it ranks held-out pairs right.

    python train_reward.py --init_from=out/sft/best.pt --data_path=data/dpo.jsonl
    python train_reward.py --help                                     # every key, its default and meaning

The loss of a pair (Bradley-Terry), with r the head's reward of prompt + answer:
    loss = -log sigmoid(r_chosen - r_rejected)
"""
import torch

from checkpoint import EarlyStopping, checkpoint_to_resume, finetune_model, prepare_training
from config import RewardConfig, load_config
from data import dpo_loaders
from errors import cli
from losses import evaluate
from metrics import experts_row
from model import aux_loss
from optim import get_lr, schedule_length, set_lr
from reward_model import RewardModel, batch_scores, bradley_terry_loss
from runtime import all_reduce_mean, print0, print_run, setup, teardown
from tokenizer import load_tokenizer

METRICS = ["pair_acc", "reward_margin", "chosen_reward", "rejected_reward"]


def pair_loss(model, batch):
    """Bradley-Terry loss and metrics of a batch of pairs, in one forward pass."""
    return bradley_terry_loss(*batch_scores(model, batch))


def validation_metrics(model, val_loader, cfg, run) -> dict[str, float]:
    """val_loss and the validation METRICS, means over the pairs of the first eval_steps validation batches."""
    def batch_sums(batch):
        loss, metrics = pair_loss(model, batch)  # means over the batch's pairs
        n = len(batch.items)
        return {"loss": loss * n, **{k: v * n for k, v in metrics.items()}, "pairs": loss.new_tensor(n)}

    model.eval()
    with run.autocast():
        sums = evaluate(batch_sums, val_loader.batches(cfg.eval_steps), run)
    model.train()
    pairs = sums.pop("pairs")
    return {f"val_{k}": v / pairs for k, v in sums.items()}


def main(argv: list[str]):
    (cfg,) = load_config(argv, RewardConfig)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    body = finetune_model(cfg, run)
    model_cfg = body.config
    cfg = cfg.fit_lengths(model_cfg.max_seq_len)
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    loader, val_loader = dpo_loaders(cfg, tokenizer, model_cfg.max_seq_len, run, whole=True)
    max_steps, warmup_steps, steps_per_epoch = schedule_length(cfg, loader, val_loader, run)
    model = RewardModel(body)

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold)
    training = prepare_training(cfg, "reward", run, model, loader, early, resume_from, max_steps)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # the loss is a mean over pairs, and every micro-batch holds batch_size pairs: the mean of the
        # micro-batches' means is the mean over the whole step's pairs, on every rank alike
        sums = torch.zeros(1 + len(METRICS), device=run.device)  # the loss, then METRICS
        aux_sum = torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with timer.phase("data"):
                batch = loader.next_batch()
            timer.count(batch.X, raw_model.flops_per_token(batch.X.size(1)), batch.tokens)  # before the work: an error names it
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    loss, metrics = pair_loss(model, batch)
                    aux = aux_loss(model)  # the experts' load balancing (0 for a dense model)
                with timer.phase("backward"):
                    scaler.scale((loss + aux) / cfg.accum_steps).backward()
            sums += torch.stack([loss.detach(), *(metrics[k].float() for k in METRICS)])
            aux_sum += aux.detach()
        with timer.phase("optimizer"):
            # all ranks step, skip and stop alike
            loss, *metrics, stop_votes = all_reduce_mean(torch.cat([sums / cfg.accum_steps, stop.vote().view(1)]), run)
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
            means = dict(zip(METRICS, torch.stack(metrics).tolist()))
            skipped = guard.report(step, loss.item(), grad_norm.item())  # names skipped steps; too many stop the run
            log.write({"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), **means,
                       "skipped_steps": skipped, **timer.read(step),
                       **experts_row(raw_model, aux_sum / cfg.accum_steps, run)})
        if step % cfg.eval_interval == 0 or step % steps_per_epoch == 0 or step == max_steps:
            with timer.paused():
                val_metrics = validation_metrics(raw_model, val_loader, cfg, run)
                log.write({"step": step, **val_metrics})
                if early.update(val_metrics["val_loss"]):
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
