"""
PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022's RLHF recipe, MiniMind's trainer/train_ppo.py): the
parts train_ppo.py adds to GRPO's rollouts, rewards and clipped loss (grpo.py). A value model learns to predict,
at each completion token, the return still to come; a token's advantage is how much better things went than that
prediction (GAE), so no group of completions per prompt is needed to find a baseline.

  ValueModel, value_model   the critic: a copy of the policy's body with a scalar head, read at every position
  token_rewards     a completion's reward on its last token, minus beta x (log p_rollout - log p_ref) on every token
  gae               generalised advantage estimation over each row's completion tokens, and the critic's returns
  whiten            advantages to mean 0 and std 1 over every completion token of the step (every rank)
  value_loss        the clipped value loss, 0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2), summed

Per completion token t (tool results and padding skipped: they are not the policy's actions), with V the critic's
values at the rollout and t+1 the next token the policy wrote (V = 0 after the last):
    delta_t = r_t + gamma V_{t+1} - V_t      A_t = delta_t + gamma lambda A_{t+1}      R_t = A_t + V_t
"""
import copy

import torch

from reward_model import RewardModel
from runtime import all_reduce_sum


class ValueModel(RewardModel):
    """A reward model read at every position instead of the last: the value of the prefix up to each token. Its
    head starts at zero (every value 0), so the first advantages are the rewards themselves, whitened."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Ids (B, T) -> values (B, T) in float32: values[:, j] estimates the return from the token Y[:, j] on."""
        h = self.body.hidden_states(idx)  # (B, T, dim)
        # a dot product in float32, as the reward model's: under autocast a Linear would round values to bfloat16
        return (h.float() * self.score_head.weight.float()).sum(dim=-1)


def value_model(policy) -> ValueModel:
    """The critic: a copy of the policy as it starts -- init_from's weights, this run's switches, its own LoRA
    adapters when the policy has them -- under a zero scalar head. An untied LM head, which no value needs, is
    frozen: under DDP a parameter without a gradient would stall the reduction."""
    body = copy.deepcopy(policy)
    if not body.config.tie_embeddings:
        body.output.requires_grad_(False)
    return ValueModel(body)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  beta: float = 0.0) -> torch.Tensor:
    """(n, T) per-token rewards: each row's score (n,) on its last completion token (the reward comes at the end);
    with beta, minus beta x kl (n, T) -- log p_rollout - log p_ref, the KL's per-token estimate -- on every
    completion token, as in classic RLHF PPO. 0 outside the completions."""
    rewards = -beta * kl * mask if beta else torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.size(1), device=mask.device)
    last = (positions * (mask > 0)).argmax(dim=1)  # (n,) the index of each row's last completion token
    rewards[torch.arange(mask.size(0), device=mask.device), last] += scores.to(rewards)
    return rewards


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (n, T) each, 0 where mask is 0: GAE over each row's completion tokens, back to front.
    A position outside the mask (prompt, tool results, padding) is no step of the policy's: it passes the next
    token's value and advantage on untouched, so a tool turn's results do not break the chain."""
    n, T = values.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(n, device=values.device)  # V after the last token: the completion has ended
    next_advantage = torch.zeros(n, device=values.device)
    for t in reversed(range(T)):  # (n,) at a time: T small steps, no Python loop over rows
        written = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(written, advantage, 0.0)
        next_value = torch.where(written, values[:, t], next_value)
        next_advantage = torch.where(written, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], run, eps: float = 1e-8) -> list[torch.Tensor]:
    """Each micro-batch's advantages (n, T) less their mean, over their std: both over every completion token of
    the step, every micro-batch and every rank (in float64), so that any split of the step whitens alike."""
    sums = torch.stack([torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()]).double()
                        for a, m in zip(advantages, masks)]).sum(dim=0)
    total, squares, n = all_reduce_sum(sums, run).tolist()
    mean = total / max(n, 1.0)
    std = max(squares / max(n, 1.0) - mean ** 2, 0.0) ** 0.5
    return [(a - mean) / (std + eps) * m for a, m in zip(advantages, masks)]


def value_loss(values, old_values, returns, mask, value_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the clipped value loss summed over the completion tokens, the number of tokens where the clip decided it).
    values (n, T): the critic's now, with their graph; old_values: at the rollout; returns: the targets. A value
    that moved more than value_clip from the rollout's is held there, and where that makes the loss larger the
    larger one counts, with no gradient: the critic cannot take big steps on one batch (the policy's clip, for V)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss, loss_clipped = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(loss, loss_clipped)
    return (per_token * mask).sum(), ((loss_clipped > loss) * mask).sum()


def explained_variance(n: float, return_sum: float, return_sq_sum: float, error_sum: float,
                       error_sq_sum: float) -> float:
    """1 - Var(R - V) / Var(R) from sums over n completion tokens of the returns R and the errors R - V: 1 when the
    critic foresees every return, 0 when it does no better than their mean (or the returns do not vary), below 0
    when worse."""
    return_var = return_sq_sum / n - (return_sum / n) ** 2
    error_var = error_sq_sum / n - (error_sum / n) ** 2
    return 1.0 - error_var / return_var if return_var > 0 else 0.0
