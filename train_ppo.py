"""
Reinforcement learning with PPO and a critic, as MiniMind's trainer/train_ppo.py and InstructGPT's RLHF do: a value
model predicts, at each completion token, the reward still to come, and a token's advantage is how much better the
completion went than that prediction (GAE, ppo.py). GRPO (train_grpo.py) finds its baseline in a group of
completions of each prompt instead; this script samples, rewards and clips as train_grpo.py does.

    python train_ppo.py configs/demo_ppo.py                          # the demo's doubling task
    python train_ppo.py --init_from=out/sft/best.pt --data_path=rlaif.jsonl --reward=answer
    python train_ppo.py --help                                       # every key, its default and meaning

A step: batch_size prompts per micro-batch (x accum_steps x ranks) -> group_size completions each, sampled and
rewarded as train_grpo.py's (grpo.roll_out, grpo.Rewarder: answer, rules, your function, a reward model; tools
too) -> without gradients, the rollout policy's log-probs, the reference's and the critic's values -> per-token
rewards, GAE advantages whitened over the step, the critic's returns -> ppo_epochs optimizer steps of the policy on
PPO's clipped loss and of the critic on the clipped value loss. Each loss is its sum over the completion tokens of
the whole step (every micro-batch, every rank) divided by their number, as in train_grpo.py: batch_size x
accum_steps x ranks is exactly one big batch.

Two choices:
- The critic is a separate copy of the policy (ppo.value_model: init_from's body with this run's switches, its own
  LoRA adapters when the policy has them, and a scalar head that starts at zero), as MiniMind's CriticModel; not a
  value head on the policy's body. A shared body would let the value loss pull on the features the policy samples
  from, and the weight between the two losses (MiniMind's vf_coef) would be one more knob to tune. Apart, each
  model has its own AdamW and lr, and Adam's steps do not depend on a loss's scale: no vf_coef. The price is a
  second model's memory and a forward and backward more per micro-batch.
- The KL to the reference is a per-token penalty in the reward, as classic RLHF PPO (Ziegler et al. 2019,
  InstructGPT): r_t = -beta (log p_rollout - log p_ref), plus the completion's reward on its last token. The critic
  learns the penalised return and GAE credits each token with its share, so PPO maximises E[reward] - beta KL
  itself. (train_grpo.py, which has no critic to learn it, adds k3 to the loss; so does MiniMind's PPO.)
"""
import torch

from checkpoint import EarlyStopping, prepare_training
from config import PPOConfig
from errors import cli
from grpo import policy_loss, prepare_rl, roll_out, sampling_mode, token_logprobs, validation_reward
from metrics import experts_row
from model import aux_loss
from optim import NonFiniteGuard, configure_optimizer, get_lr, set_lr
from ppo import explained_variance, gae, token_rewards, value_loss, value_model, whiten
from runtime import all_reduce_sum, print0, teardown, wrap

PHASES = ("rollout", "reward", "forward", "backward", "optimizer")
# summed over ranks; kl: log p_rollout - log p_ref; return and error (return - value): the explained variance;
# stop_votes: the ranks that got Ctrl-C / SIGTERM
STATS = ["completions", "reward_sum", "reward_sq_sum", "tokens", "kl_sum", "return_sum", "return_sq_sum",
         "error_sum", "error_sq_sum", "stop_votes"]


def rollout_stats(b, kl) -> torch.Tensor:
    """A micro-batch's share of STATS (stop_votes aside: 0), in float64."""
    m, error = b.mask, b.returns - b.values
    kl_sum = (kl * m).sum() if kl is not None else m.new_zeros(())
    sums = [len(b.rewards), b.rewards.sum(), (b.rewards ** 2).sum(), m.sum(), kl_sum, (b.returns * m).sum(),
            (b.returns ** 2 * m).sum(), (error * m).sum(), (error ** 2 * m).sum(), 0]
    return torch.stack([torch.as_tensor(s, dtype=torch.float64, device=m.device) for s in sums])


def main(argv: list[str]):
    rl = prepare_rl(argv, PPOConfig)  # the policy, its rewards, prompts, schedule and reference
    cfg, run, model, tokenizer, rewarder, toolbox, loader, val_loader, schedule, reference_model, resume_from = rl
    max_steps, warmup_steps, steps_per_epoch = schedule
    # the critic: a copy of the policy as it starts, with a scalar head; it, its optimizer and its guard are saved
    # in every checkpoint beside the policy's
    raw_critic = value_model(model)
    critic_optimizer = configure_optimizer(raw_critic, cfg.weight_decay, cfg.critic_lr, (cfg.beta1, cfg.beta2),
                                           run.device.type, cfg.optimizer, cfg.muon_lr, cfg.muon_momentum)
    critic_guard = NonFiniteGuard(raw_critic, cfg.max_bad_steps, run.device)
    critic_parts = {"critic": raw_critic, "critic_optimizer": critic_optimizer, "critic_guard": critic_guard}

    early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold, "val_reward", maximize=True)
    training = prepare_training(cfg, "ppo", run, model, loader, early, resume_from, max_steps, PHASES, critic_parts)
    model, raw_model, optimizer, scaler, guard, checkpoints, step, log, stop, profiler, timer = training
    critic = wrap(raw_critic, cfg, run)  # DDP (and compile) as the policy
    if step == 0:  # the starting model on the held-out prompts: what RL improves on
        with timer.paused():
            log.write({"step": 0, **validation_reward(raw_model, val_loader, rewarder, cfg, tokenizer, run, toolbox)})

    while step < max_steps:
        timer.begin(step)  # an out-of-memory error names the step
        length = {"warmup_steps": warmup_steps, "max_steps": max_steps}  # one schedule's shape, two peaks
        set_lr(optimizer, lr := get_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, **length))
        set_lr(critic_optimizer, get_lr(step, lr=cfg.critic_lr, min_lr=cfg.critic_min_lr, **length))
        with timer.phase("rollout"):  # train_grpo.py's: each prompt's completions seeded by (seed, step, prompt)
            batches = []
            for _ in range(cfg.accum_steps):
                indices = loader.next_batch()
                batches.append(roll_out(raw_model, [loader.dataset[i] for i in indices], indices, step, cfg,
                                        tokenizer, run, toolbox))
        with timer.phase("reward"):
            for b in batches:
                # float64: the logged sums are the same however the step is split
                b.rewards = torch.tensor(rewarder(b.prompts, b.texts, b.conversations), dtype=torch.float64,
                                         device=run.device)
        # what stays fixed over the epochs: the rollout's log-probs, the reference's and the critic's values (eval
        # mode: no dropout), then each token's reward, advantage and return
        with timer.phase("forward"), torch.no_grad(), run.autocast():
            stats = torch.zeros(len(STATS), dtype=torch.float64, device=run.device)
            for b in batches:
                with sampling_mode(raw_model), sampling_mode(raw_critic):
                    rollout_logp = token_logprobs(raw_model, b.X, b.Y) if cfg.beta or cfg.ppo_epochs > 1 else None
                    b.values = raw_critic(b.X)  # (n, T): at each position, the return still to come
                if reference_model is not None:
                    with reference_model() as ref:
                        b.ref_logp = token_logprobs(ref, b.X, b.Y)
                # one epoch: the ratio's denominator is the update's own forward, so the ratio is exactly 1
                b.old_logp = rollout_logp if cfg.ppo_epochs > 1 else None
                kl = rollout_logp - b.ref_logp if cfg.beta else None  # per token; its mean estimates KL(policy || ref)
                rewards = token_rewards(b.rewards, b.mask, kl, cfg.beta)
                b.advantages, b.returns = gae(rewards, b.values, b.mask, cfg.gamma, cfg.gae_lambda)
                stats += rollout_stats(b, kl)
            for b, advantages in zip(batches, whiten([b.advantages for b in batches], [b.mask for b in batches], run)):
                b.advantages = advantages
            stats[STATS.index("stop_votes")] = stop.received  # all ranks stop alike
            stats = dict(zip(STATS, all_reduce_sum(stats, run).tolist()))
            n_tokens = max(stats["tokens"], 1.0)
        for _ in range(cfg.ppo_epochs):
            # this rank's sums over its tokens: the policy loss, the value loss, the tokens each clip decided
            sums = torch.zeros(4, device=run.device)
            aux_sum = torch.zeros((), device=run.device)
            for micro_step, b in enumerate(batches):
                # before the work: an error names it; the critic's body costs what the policy's does, less its head
                timer.count(b.X, raw_model.flops_per_token(b.X.size(1)) + raw_critic.flops_per_token(b.X.size(1)))
                last = micro_step == cfg.accum_steps - 1
                with run.no_sync(model, last_micro_step=last), run.no_sync(critic, last_micro_step=last):
                    with timer.phase("forward"), run.autocast():
                        logp = token_logprobs(model, b.X, b.Y)
                        old_logp = logp.detach() if b.old_logp is None else b.old_logp
                        policy_sum, m = policy_loss(logp, old_logp, None, b.advantages, b.mask, cfg.loss_type,
                                                    cfg.clip_eps, cfg.clip_high, 0.0)  # the KL is in the rewards
                        value_sum, value_clipped = value_loss(critic(b.X), b.values, b.returns, b.mask, cfg.value_clip)
                        # x world_size: DDP averages the ranks' gradients; each loss reaches its own model only
                        loss = (policy_sum + value_sum) * run.world_size / n_tokens
                        aux = aux_loss(model) + aux_loss(critic)  # the experts' load balancing (0 for dense models)
                    with timer.phase("backward"):
                        scaler.scale(loss + aux / len(batches)).backward()
                sums += torch.stack([policy_sum.detach(), value_sum.detach(), m["clipped"], value_clipped])
                aux_sum += aux.detach()
            with timer.phase("optimizer"):
                loss, critic_loss, clip_frac, value_clip_frac = all_reduce_sum(sums, run) / n_tokens  # alike on every rank
                scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
                scaler.unscale_(critic_optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
                critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm or float("inf"))
                log.grad_flow(step + 1, raw_model, cfg.grad_log_interval)
                guard.check(loss, grad_norm, optimizer)  # a NaN/Inf loss or gradient: this update is skipped
                critic_guard.check(critic_loss, critic_grad_norm, critic_optimizer)
                scaler.step(optimizer)
                scaler.step(critic_optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)
        step += 1
        if profiler:
            profiler.step()

        stopping = stop.requested(stats["stop_votes"], step)  # Ctrl-C / SIGTERM on any rank: all ranks save and stop
        if step % cfg.log_interval == 0 or step == max_steps:  # the loop's host syncs (.item()), besides rewards
            # each guard names its skipped steps; too many in a row stop the run
            skipped = (guard.report(step, loss.item(), grad_norm.item()) +
                       critic_guard.report(step, critic_loss.item(), critic_grad_norm.item()))
            n, mean = stats["completions"], stats["reward_sum"] / stats["completions"]
            row = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                   "value_loss": critic_loss.item(), "critic_grad_norm": critic_grad_norm.item(), "reward_mean": mean,
                   "reward_std": max(stats["reward_sq_sum"] / n - mean ** 2, 0.0) ** 0.5,
                   **({"kl": stats["kl_sum"] / n_tokens} if cfg.beta else {}), "clip_frac": clip_frac.item(),
                   "value_clip_frac": value_clip_frac.item(),
                   "explained_var": explained_variance(n_tokens, stats["return_sum"], stats["return_sq_sum"],
                                                       stats["error_sum"], stats["error_sq_sum"]),
                   "completion_len": stats["tokens"] / n, "skipped_steps": skipped}
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
