"""
Reinforcement learning from rewards, GRPO-style (Shao et al. 2024): the parts train_grpo.py, eval.py and bench.py
share. No value model: each prompt gets a group of completions, and a completion's advantage is how much better
its reward is than its group's.

  rollout           each prompt's group of completions, sampled together through the engine, seeded per prompt
  agent_rollout     the same with tools: each completion runs up to max_turns turns, the calls run between them
  completion_batch  prompts + completions -> X, Y and the mask of the completions' tokens (nothing after eos)
  Rewarder          the rewards of completions: the summed reward functions plus a reward model's score
  group_advantages  (r - group mean) / (group std + eps); 0 for a group whose rewards are all equal
  policy_loss       the summed per-token GRPO or CISPO loss, plus beta times the k3 estimate of the KL to the reference

The two losses, per completion token, with ratio = p_policy / p_rollout and A the completion's advantage:
    grpo   -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)        PPO's clipped surrogate
    cispo  -min(ratio, clip_high).detach() * A * log p_policy                  CISPO (MiniMax-M1, 2025)
Both have the gradient -A * grad log p_policy while ratio is 1; they differ in what a stale rollout does: grpo
drops the gradient of tokens whose ratio left the clip range, cispo keeps every token's, its weight capped.
k3 (Schulman 2020), per token, with d = log p_ref - log p_policy: exp(d) - d - 1 >= 0, an unbiased estimate of
KL(policy || reference) whose samples are never negative.
"""
import contextlib
import math
import numbers

import numpy as np
import torch

from data import pad_rows
from engine import Row, Sampling, answer_text, decode
from errors import RewardError
from reward_model import score
from tools import Trajectory, converse


def prompt_seed(seed: int, step: int, index: int) -> int:
    """The seed of a prompt's rollouts at a step: a function of the prompt, not of the batch it is in, so that
    any split of a step's prompts over micro-batches and ranks samples the same completions."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


def group_samplings(model, n: int, seeds: list[int] | None, temperature: float, top_p: float | None) -> list[Sampling]:
    """A Sampling for each of n prompts, drawing from a generator of its own seed on the model's device; seeds
    None: greedy."""
    if seeds is None:
        return [Sampling(temperature=0.0) for _ in range(n)]
    device = next(model.parameters()).device
    return [Sampling(temperature, top_p=top_p, generator=torch.Generator(device).manual_seed(s)) for s in seeds]


@contextlib.contextmanager
def sampling_mode(model):
    """The model in eval mode (sampling without dropout), then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def rollout(model, prompts: list[list[int]], seeds: list[int] | None, group_size: int, max_new_tokens: int,
            eos_id: int, temperature: float = 1.0, top_p: float | None = None) -> list[Row]:
    """group_size completions of each prompt, all decoded together (each prompt prefilled once): the rows,
    prompt by prompt. Each prompt's rows draw from a generator of its own seed; seeds None: greedy."""
    samplings = group_samplings(model, len(prompts), seeds, temperature, top_p)
    rows = [Row(list(p), max_new_tokens, s, eos_id) for p, s in zip(prompts, samplings) for _ in range(group_size)]
    with sampling_mode(model):
        return decode(model, rows)


@torch.no_grad()
def agent_rollout(model, tokenizer, prompts: list, seeds: list[int] | None, group_size: int, max_new_tokens: int,
                  max_turns: int, toolbox, temperature: float = 1.0, top_p: float | None = None) -> list[Trajectory]:
    """rollout with tools: group_size conversations from each prompt (data.Prompt: ids and messages), all decoded
    together turn by turn (tools.converse); seeds None: greedy."""
    samplings = group_samplings(model, len(prompts), seeds, temperature, top_p)
    items = [(p.ids, p.messages, s) for p, s in zip(prompts, samplings) for _ in range(group_size)]
    with sampling_mode(model):
        return converse(model, tokenizer, items, toolbox, max_turns, max_new_tokens)


def completion_batch(prompts: list[list[int]], completions: list[list[int]], eos_id: int, pad_id: int, device,
                     generated: list[list[int]] | None = None):
    """(X, Y, mask) for rows prompt + completion, padded; mask is 1 where Y is a completion token, its eos
    included. A completion ends at its first eos: nothing after it is in the row. With tools, a completion is
    every turn and the tool results between them: generated marks the tokens the policy wrote (mask 1), and the
    results it read carry no loss."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if generated is None:
            completion = completion[: completion.index(eos_id) + 1] if eos_id in completion else completion
        written = np.ones(len(completion), np.uint8) if generated is None else np.array(generated[i], np.uint8)
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), written])
        rows.append((np.array(prompt + completion), mask))
    return tuple(t.to(device) for t in pad_rows(rows, pad_id))


def token_logprobs(model, X, Y) -> torch.Tensor:
    """(n, T) log p(Y[t] | X[..t]): minus the per-token cross-entropy (the model's float32 log-softmax)."""
    _, ce = model(X, Y, reduction="none")
    return -ce


class Rewarder:
    """Rewards of completions: the sum of the reward functions {name: fn(messages, completion, record) -> float}
    and, with a reward model (reward_model.py), its score. A function that raises or returns anything but a finite
    number stops the run with a RewardError naming the record."""

    def __init__(self, functions: dict, reward_model=None, tokenizer=None):
        self.functions, self.reward_model, self.tokenizer = functions, reward_model, tokenizer

    def __call__(self, prompts: list, texts: list[str], conversations: list[list[dict]] | None = None) -> list[float]:
        """prompts: data.Prompt of each completion (repeated over its group); texts: the completions (with tools:
        the last turns); conversations: what each completion answers (with tools: the prompt's messages and the
        earlier turns with their calls and results; default: the prompt's messages)."""
        totals = []
        conversations = conversations or [p.messages for p in prompts]
        for prompt, text, messages in zip(prompts, texts, conversations):
            total = 0.0
            for name, fn in self.functions.items():
                try:
                    value = fn(messages, text, prompt.record)
                except Exception as e:
                    raise RewardError(f"{prompt.where}: reward {name} raised {type(e).__name__}: {e}") from None
                if not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise RewardError(f"{prompt.where}: reward {name} returned {value!r}, not a finite number")
                total += float(value)
            totals.append(total)
        if self.reward_model is not None:
            scores = score(self.reward_model, self.tokenizer, conversations, texts)
            for i, (prompt, s) in enumerate(zip(prompts, scores)):
                if not math.isfinite(s):
                    raise RewardError(f"{prompt.where}: the reward model scored a completion {s}")
                totals[i] += s
        return totals


def completion_texts(tokenizer, rows: list[Row]) -> list[str]:
    return [answer_text(tokenizer, row) for row in rows]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(n_prompts * group_size,) rewards, group by group -> advantages (r - group mean) / (group std + eps), the
    std over the group (not its sample estimate); exactly 0 for a group whose rewards are all equal, which then
    teaches nothing."""
    r = rewards.view(-1, group_size)
    advantages = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, 0.0, advantages).flatten()


def policy_loss(logp, old_logp, ref_logp, advantages, mask, loss_type: str, clip_eps: float, clip_high: float,
                beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the per-token loss summed over the completion tokens, {"kl": the k3 values summed, "clipped": the tokens
    whose ratio was clipped}). logp: (n, T) the policy's log-probs, with their graph; old_logp: the rollout
    policy's; ref_logp: the reference's (None when beta is 0); advantages (n,); mask (n, T): completion tokens."""
    ratio = torch.exp((logp - old_logp) * mask)  # masked positions: exp(0), finite, no gradient
    A = advantages[:, None]
    if loss_type == "grpo":
        per_token = -torch.min(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)
        clipped = ((ratio < 1 - clip_eps) & (A < 0)) | ((ratio > 1 + clip_eps) & (A > 0))  # where min picks the clip
    elif loss_type == "cispo":
        per_token = -ratio.clamp(max=clip_high).detach() * A * logp
        clipped = ratio > clip_high
    else:
        raise ValueError(f"loss_type must be grpo or cispo, got {loss_type!r}")
    kl = torch.zeros_like(logp)
    if beta:
        d = (ref_logp - logp) * mask
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    return (per_token * mask).sum(), {"kl": (kl * mask).sum().detach(), "clipped": (clipped * mask).sum()}
