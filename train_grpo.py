"""
Reinforcement learning with GRPO: every prompt gets a group of sampled completions, every completion a reward, and
the policy learns to make likelier the completions that beat their group's mean (grpo.py: the losses).

    python train_grpo.py configs/demo_grpo.py                        # the demo's doubling task
    python train_grpo.py --init_from=out/sft/best.pt --data_path=rlaif.jsonl --reward=answer
    python train_grpo.py configs/demo_tools_grpo.py                  # agent RL: the demo's calculator task
    python train_grpo.py --help                                      # every key, its default and meaning

A step: batch_size prompts per micro-batch (x accum_steps x ranks) -> group_size completions each, sampled from
the current policy together (engine.py: one batch, KV cache) -> rewards -> advantages within each group ->
ppo_epochs optimizer steps on the loss. The loss is the sum of the per-token losses over the completion tokens of
the whole step -- every micro-batch, every rank -- divided by their number: every token weighs alike, so a long
wrong answer is not excused by its length nor a short one punished more (a per-completion mean would), and
batch_size x accum_steps x ranks is exactly one big batch.

With tools (agent RL, MiniMind's train_agent.py): a completion is up to max_turns turns; a turn that calls tools
gets their results (tools.py runs them) and the next turn reads them. The rewards score the last turn (reward=
answer: against "answer" or MiniMind's "gt" list) and the calls (reward=calls: well formed, fitting the tools
offered); the tool results are in the rows but carry no loss.
"""
import torch

from checkpoint import EarlyStopping, prepare_training
from config import GRPOConfig
from errors import cli
from grpo import group_advantages, policy_loss, prepare_rl, roll_out, token_logprobs, validation_reward
from metrics import experts_row
from model import aux_loss
from optim import get_lr, set_lr
from runtime import all_reduce_sum, print0, teardown

PHASES = ("rollout", "reward", "forward", "backward", "optimizer")
# summed over ranks; stop_votes: the ranks that got Ctrl-C / SIGTERM
STATS = ["completions", "reward_sum", "reward_sq_sum", "tokens", "groups", "zero_adv_groups", "stop_votes"]


def main(argv: list[str]):
    rl = prepare_rl(argv, GRPOConfig)  # the policy, its rewards, prompts, schedule and reference
    cfg, run, model, tokenizer, rewarder, toolbox, loader, val_loader, schedule, reference_model, resume_from = rl
    max_steps, warmup_steps, steps_per_epoch = schedule

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold, "val_reward", maximize=True)
    training = prepare_training(cfg, "grpo", run, model, loader, early, resume_from, max_steps, PHASES)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    if step == 0:  # the starting model on the held-out prompts: what RL improves on
        with timer.paused():
            log.write({"step": 0, **validation_reward(raw_model, val_loader, rewarder, cfg, tokenizer, run, toolbox)})

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup_steps, max_steps=max_steps))
        # every micro-batch's rollouts come first: the loss divides by the completion tokens of them all
        with timer.phase("rollout"):
            batches = []
            for _ in range(cfg.accum_steps):
                indices = loader.next_batch()
                prompts = [loader.dataset[i] for i in indices]
                batches.append(roll_out(raw_model, prompts, indices, step, cfg, tokenizer, run, toolbox))
        with timer.phase("reward"):
            stats = torch.zeros(len(STATS))
            for b in batches:
                b.rewards = torch.tensor(rewarder(b.prompts, b.texts, b.conversations))
                b.advantages = group_advantages(b.rewards, cfg.group_size).to(run.device)
                groups = b.rewards.view(-1, cfg.group_size)
                stats += torch.tensor([len(b.rewards), b.rewards.sum(), (b.rewards ** 2).sum(), b.mask.sum().item(),
                                       len(groups), (groups == groups[:, :1]).all(dim=1).sum(), 0])
            stats[STATS.index("stop_votes")] = stop.received  # all ranks stop alike
            stats = dict(zip(STATS, all_reduce_sum(stats.to(run.device, torch.float64), run).tolist()))
            n_tokens = max(stats["tokens"], 1.0)
        with timer.phase("forward"), torch.no_grad(), run.autocast():  # log-probs that stay fixed over the epochs
            for b in batches:
                if cfg.ppo_epochs > 1:  # with one epoch the ratio's denominator is the update's own forward
                    b.old_logp = token_logprobs(raw_model.eval(), b.X, b.Y)
                    raw_model.train()
                if reference_model is not None:
                    with reference_model() as ref:
                        b.ref_logp = token_logprobs(ref, b.X, b.Y)
        for _ in range(cfg.ppo_epochs):
            sums = torch.zeros(3, device=run.device)  # the loss, kl and clipped tokens, summed over this rank's tokens
            aux_sum = torch.zeros((), device=run.device)
            for micro_step, b in enumerate(batches):
                timer.count(b.X, raw_model.flops_per_token(b.X.size(1)))  # before the work: an error names it
                with run.no_sync(model, last_micro_step=micro_step == cfg.accum_steps - 1):
                    with timer.phase("forward"), run.autocast():
                        logp = token_logprobs(model, b.X, b.Y)
                        old_logp = logp.detach() if b.old_logp is None else b.old_logp
                        loss_sum, m = policy_loss(logp, old_logp, b.ref_logp, b.advantages, b.mask, cfg.loss_type,
                                                  cfg.clip_eps, cfg.clip_high, cfg.beta)
                        loss = loss_sum * run.world_size / n_tokens  # x world_size: DDP averages the ranks' gradients
                        aux = aux_loss(model)  # the experts' load balancing (0 for a dense model)
                    with timer.phase("backward"):
                        scaler.scale(loss + aux / len(batches)).backward()
                sums += torch.stack([loss_sum.detach(), m["kl"], m["clipped"]])
                aux_sum += aux.detach()
            with timer.phase("optimizer"):
                loss, kl, clip_frac = all_reduce_sum(sums, run) / n_tokens  # the same on every rank
                scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
                log.grad_flow(step + 1, raw_model, cfg.grad_log_interval)
                guard.check(loss, grad_norm, optimizer)  # a NaN/Inf loss or gradient: this update is skipped
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        step += 1
        if profiler:
            profiler.step()

        stopping = stop.requested(stats["stop_votes"], step)  # Ctrl-C / SIGTERM on any rank: all ranks save and stop
        if step % cfg.log_interval == 0 or step == max_steps:  # the loop's host syncs (.item()), besides rewards
            skipped = guard.report(step, loss.item(), grad_norm.item())  # names skipped steps; too many stop the run
            mean = stats["reward_sum"] / stats["completions"]
            row = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "reward_mean": mean,
                   "reward_std": max(stats["reward_sq_sum"] / stats["completions"] - mean ** 2, 0.0) ** 0.5,
                   **({"kl": kl.item()} if cfg.beta else {}), "clip_frac": clip_frac.item(),
                   "completion_len": stats["tokens"] / stats["completions"],
                   "frac_zero_adv": stats["zero_adv_groups"] / stats["groups"], "skipped_steps": skipped}
            log.write(row | timer.read(step) | experts_row(raw_model, aux_sum / len(batches), run))
        if step % cfg.eval_interval == 0 or step % steps_per_epoch == 0 or step == max_steps:
            with timer.paused():
                val = validation_reward(raw_model, val_loader, rewarder, cfg, tokenizer, run, toolbox)
                log.write({"step": step, **val})
                if early.update(val["val_reward"]):
                    checkpoints.save("best.pt", step)
            stopping |= early.should_stop
        if step % cfg.save_interval == 0 or step == max_steps or stopping:
            with timer.paused():
                checkpoints.save(f"step_{step:07d}.pt", step)
        if stopping:  # a signal (saved above) or early stopping
            break
    stop.restore()
    print0(f"done: step {step}, best val_reward {early.best:.4f}, checkpoints in {cfg.out_dir}")
    teardown(run)


if __name__ == "__main__":
    cli(main)
