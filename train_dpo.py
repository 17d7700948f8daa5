"""
Direct preference optimisation: push an SFT model towards the chosen answer of each pair and away from the
rejected one, measured against a frozen copy of itself (the reference), with no reward model.

    python train_dpo.py configs/dpo_26m.py --init_from=out/sft/best.pt --data_path=dpo.jsonl
    python train_dpo.py --help                                        # every key, its default and meaning

The loss of a pair (Rafailov et al. 2023), with pi = log p_policy(answer | prompt), ref = the same under the
reference model, and the sums running over the answer's tokens (its </s> included, the prompt excluded):
    loss = -log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))
"""
import hashlib
import math
import os
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F

import lora
from checkpoint import (EarlyStopping, atomic_save, checkpoint_to_resume, finetune_model, frozen_model, load_tensors,
                        prepare_training)
from config import DPOConfig, load_config
from data import Loader, dpo_loaders
from errors import CheckpointError, cli
from losses import bits_per_byte, count_token_bytes, evaluate, lm_sums, pair_logprobs, piece_of
from metrics import experts_row
from model import aux_loss
from optim import get_lr, schedule_length, set_lr
from runtime import all_reduce_mean, print0, print_run, setup, teardown
from token_cache import expand_paths, file_digest
from tokenizer import load_tokenizer


METRICS = ["reward_margin", "reward_acc", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp"]


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


class Reference:
    """The frozen reference's log-probs of a batch's pairs: from the model on the fly, or looked up by pair index
    in tables computed once (precompute_ref: half the forward passes, and one model in memory). A LoRA policy is
    its own reference: the unwrapped policy with its adapters off (lora.adapters_off) is the init_from model."""

    def __init__(self, model=None, tables: dict[str, torch.Tensor] | None = None, length_norm: bool = True,
                 adapters_off: bool = False):
        self.model, self.tables, self.length_norm = model, tables, length_norm
        self.context = partial(lora.adapters_off, model) if adapters_off else nullcontext

    @torch.no_grad()
    def logprobs(self, batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-probs of a batch's pairs, (n_pairs,) each; split ("train" or "val") names the
        table."""
        if self.model is not None:
            with self.context():
                return pair_logprobs(self.model, batch, self.length_norm)
        return self.tables[split][batch.items].unbind(dim=1)


@torch.no_grad()
def reference_tables(ref_path: str, cfg, loaders: dict[str, Loader], run) -> dict[str, torch.Tensor]:
    """Per-pair reference log-probs (n_pairs, 2) = (chosen, rejected) for each loader's dataset, computed once
    and cached beside the data file, keyed on the reference checkpoint, the data, the options and how they are
    computed: dtype, device type and attention path (bfloat16 log-probs are not float32 ones, SDPA's round
    differently from the math path's)."""
    key = hashlib.blake2b(repr(("tables by split", file_digest(ref_path), file_digest(cfg.data_path), cfg.val_data_path and
                                file_digest(cfg.val_data_path), cfg.val_fraction, cfg.length_norm,
                                cfg.max_prompt_length, cfg.max_completion_length, cfg.skip_bad, run.dtype,
                                run.device.type, cfg.flash) + (("pack",) if cfg.pack else ())).encode(),
                          digest_size=8).hexdigest()
    path = f"{expand_paths(cfg.data_path)[0]}.ref-{key}.pt"  # beside the first data file
    if os.path.exists(path):
        try:
            return load_tensors(path)
        except CheckpointError as e:  # a cache: computed again rather than trusted
            print0(f"recomputing the reference log-probs: {e}")
    ref = frozen_model(ref_path, run.device, cfg.flash)
    tables = {}
    for split, loader in loaders.items():
        tables[split] = torch.zeros(len(loader.dataset.records), 2)  # a row per pair
        for batch in Loader(loader.dataset, loader.batch_size, loader.pad_id, run.device).batches(10**12):
            with run.autocast():
                logps = torch.stack(pair_logprobs(ref, batch, cfg.length_norm), dim=1).float().cpu()
            tables[split][batch.items.cpu()] = logps
    atomic_save(tables, path)
    print0(f"reference log-probs of {sum(len(t) for t in tables.values()):,} pairs cached in {path}")
    return tables


def pair_loss(policy, reference: Reference, batch, split: str, cfg):
    """DPO loss and metrics of a batch, and the policy's aux loss: chosen rows first, then rejected, through one
    forward pass each model."""
    logps = pair_logprobs(policy, batch, cfg.length_norm)
    aux = aux_loss(policy)  # taken before the reference runs: with LoRA it is this same model, adapters off
    return *dpo_loss(*logps, *reference.logprobs(batch, split), cfg.beta), aux


def validation_metrics(model, reference: Reference, val_loader, cfg, run, token_bytes) -> dict[str, float]:
    """val_loss, the validation rewards and val_bpb (bits per byte of the chosen answers, comparable with SFT's),
    on the first eval_steps validation batches."""
    def batch_sums(batch):
        loss, metrics, _ = pair_loss(model, reference, batch, "val", cfg)  # means over the pairs
        n = len(batch.items)  # pairs
        chosen = chosen_lm_sums(model, batch, token_bytes)
        return {"loss": loss * n, **{k: v * n for k, v in metrics.items()}, "pairs": loss.new_tensor(n),
                "nats": chosen["nats"], "bytes": chosen["bytes"]}

    model.eval()
    with run.autocast():
        sums = evaluate(batch_sums, val_loader.batches(cfg.eval_steps), run)
    model.train()
    pairs, val_bpb = sums.pop("pairs"), bits_per_byte(sums.pop("nats"), sums.pop("bytes"))
    return {f"val_{k}": v / pairs for k, v in sums.items()} | {"val_bpb": val_bpb}


def chosen_lm_sums(model, batch, token_bytes) -> dict[str, torch.Tensor]:
    """lm_sums of the chosen answers of a batch of pairs: its first half of rows, or each row's even pieces."""
    X, Y, loss_mask, items, positions, ends, _ = batch
    if positions is None:
        n = len(items)  # the chosen rows come first
        return lm_sums(model, X[:n], Y[:n], loss_mask[:n], token_bytes)
    return lm_sums(model, X, Y, loss_mask * (piece_of(ends, X) % 2 == 0), token_bytes, positions)


def make_reference(cfg, run, model, loader, val_loader) -> Reference:
    """The frozen reference (ref_from, else init_from): a second model; with LoRA and no ref_from, the policy
    model itself with its adapters off; with precompute_ref its log-probs of every pair, computed once by rank 0
    and cached beside the data."""
    if cfg.lora_rank and cfg.ref_from is None and not cfg.precompute_ref:
        return Reference(model, None, cfg.length_norm, adapters_off=True)
    if not cfg.precompute_ref:
        return Reference(frozen_model(cfg.ref_from or cfg.init_from, run.device, cfg.flash), None, cfg.length_norm)
    with run.rank0_first("waiting for rank 0 to compute the reference log-probs"):
        tables = reference_tables(cfg.ref_from or cfg.init_from, cfg, {"train": loader, "val": val_loader}, run)
    return Reference(tables={split: table.to(run.device) for split, table in tables.items()})


def main(argv: list[str]):
    (cfg,) = load_config(argv, DPOConfig)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = finetune_model(cfg, run)
    model_cfg = model.config
    cfg = cfg.fit_lengths(model_cfg.max_seq_len)
    print_run(cfg, model_cfg, run)
    resume_from = checkpoint_to_resume(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    loader, val_loader = dpo_loaders(cfg, tokenizer, model_cfg.max_seq_len, run)
    max_steps, warmup_steps, steps_per_epoch = schedule_length(cfg, loader, val_loader, run)
    reference = make_reference(cfg, run, model, loader, val_loader)

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold)
    training = prepare_training(cfg, "dpo", run, model, loader, early, resume_from, max_steps)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    watch = FailureWatch()
    token_bytes = count_token_bytes(tokenizer)  # for val_bpb

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # DPO's loss is a mean over pairs, and every micro-batch holds batch_size pairs: the mean of the
        # micro-batches' means is the mean over the whole step's pairs, on every rank alike
        sums = torch.zeros(1 + len(METRICS), device=run.device)  # the loss, then METRICS
        aux_sum = torch.zeros((), device=run.device)
        for micro_step in range(cfg.accum_steps):
            with timer.phase("data"):
                batch = loader.next_batch()
            timer.count(batch.X, raw_model.flops_per_token(batch.X.size(1)), batch.tokens)  # before the work: an error names it
            with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                with timer.phase("forward"), run.autocast():
                    loss, metrics, aux = pair_loss(model, reference, batch, "train", cfg)
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
            watch.update(loss.item(), means["chosen_logp"], step > warmup_steps)
        if step % cfg.eval_interval == 0 or step % steps_per_epoch == 0 or step == max_steps:
            with timer.paused():
                val_metrics = validation_metrics(raw_model, reference, val_loader, cfg, run, token_bytes)
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
    cli(main)
