"""
Reinforcement learning from rewards, GRPO-style (Shao et al. 2024): the parts train_grpo.py, train_ppo.py, eval.py
and bench.py share. No value model: each prompt gets a group of completions, and a completion's advantage is how
much better its reward is than its group's (train_ppo.py takes each token's from a critic instead: ppo.py).

  rollout           each prompt's group of completions, sampled together through the engine, seeded per prompt
  agent_rollout     the same with tools: each completion runs up to max_turns turns, the calls run between them
  completion_batch  prompts + completions -> X, Y and the mask of the completions' tokens (nothing after eos)
  Rewarder          the rewards of completions: the summed reward functions plus a reward model's score
  group_advantages  (r - group mean) / (group std + eps); 0 for a group whose rewards are all equal
  policy_loss       the summed per-token GRPO or CISPO loss, plus beta times the k3 estimate of the KL to the reference
  prepare_rl, roll_out, validation_reward   what train_grpo.py and train_ppo.py share: an RL run's policy,
                    rewards, tools, prompts, schedule and reference; a micro-batch's Rollouts; the held-out reward

The two losses, per completion token, with ratio = p_policy / p_rollout and A the completion's advantage:
    grpo   -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)        PPO's clipped surrogate
    cispo  -min(ratio, clip_high).detach() * A * log p_policy                  CISPO (MiniMax-M1, 2025)
Both have the gradient -A * grad log p_policy while ratio is 1; they differ in what a stale rollout does: grpo
drops the gradient of tokens whose ratio left the clip range, cispo keeps every token's, its weight capped.
k3 (Schulman 2020), per token, with d = log p_ref - log p_policy: exp(d) - d - 1 >= 0, an unbiased estimate of
KL(policy || reference) whose samples are never negative.
"""
import contextlib
import dataclasses
import math
import numbers
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

import lora
from checkpoint import checkpoint_to_resume, finetune_model, frozen_model
from config import GRPOConfig, load_config
from data import Prompt, PromptLoader, pad_rows, prompt_loaders
from engine import Row, Sampling, answer_text, decode
from errors import ConfigError, RewardError
from losses import evaluate
from optim import schedule_length
from reward_model import load_reward_model, score
from rewards import answer_reward, load_rewards, reference
from runtime import Run, print_run, setup
from tokenizer import Tokenizer, load_tokenizer
from tools import Toolbox, Trajectory, converse, load_toolbox


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
    policy's; ref_logp: the reference's (None when beta is 0); advantages (n,) each completion's, or (n, T) each
    token's (PPO's); mask (n, T): completion tokens."""
    ratio = torch.exp((logp - old_logp) * mask)  # masked positions: exp(0), finite, no gradient
    A = advantages[:, None] if advantages.dim() == 1 else advantages
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


# -----------------------------------------------------------------------------
# what an RL run's loop works with, train_grpo.py's and train_ppo.py's alike: its policy, rewards, tools, prompts and
# schedule, a micro-batch's rollouts as training rows, the KL's reference, the held-out reward

class RLSetup(NamedTuple):
    """An RL run before its training starts (prepare_rl), in the order the scripts unpack it."""
    cfg: GRPOConfig  # or a PPOConfig; max_prompt_length fitted to the model
    run: Run
    model: torch.nn.Module  # the policy: init_from with this run's switches (and LoRA adapters), unwrapped
    tokenizer: Tokenizer
    rewarder: "Rewarder"
    toolbox: Toolbox | None  # None: one turn, no tools
    loader: PromptLoader  # the training prompts
    val_loader: PromptLoader  # the held-out prompts
    schedule: tuple[int, int, int]  # max_steps, warmup_steps, steps_per_epoch
    reference: Callable | None  # make_reference's: a context giving the KL's reference; None for beta 0
    resume_from: str | None  # the checkpoint to resume from; None: a fresh run


def prepare_rl(argv: list[str], schema) -> RLSetup:
    """The config (schema's keys from argv), the process, the policy, the rewards and tools, the prompts, the
    schedule and the reference of an RL run, checked and printed as every training run is."""
    (cfg,) = load_config(argv, schema)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = finetune_model(cfg, run)
    cfg = cfg.fit_lengths(model.config.max_seq_len)
    print_run(cfg, model.config, run)
    resume_from = checkpoint_to_resume(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    rewarder, toolbox = load_rewarder(cfg, tokenizer, run.device)
    loader, val_loader = prompt_loaders(cfg, tokenizer, run, need_reference="answer" in rewarder.functions)
    schedule = schedule_length(cfg, loader, val_loader, run)
    return RLSetup(cfg, run, model, tokenizer, rewarder, toolbox, loader, val_loader, schedule,
                   make_reference(cfg, model), resume_from)


def load_rewarder(cfg, tokenizer, device):
    """(the Rewarder, the toolbox or None) that cfg's reward, reward_model and tools keys name. Tools need
    MiniMind's ChatML template."""
    functions = load_rewards(cfg.reward)
    if not functions and not cfg.reward_model:
        raise ConfigError("reward=none scores with a reward model alone: pass reward_model=RM.pt")
    # the reward model brings its own tokenizer: it may differ from the policy's
    reward_model, reward_tokenizer = load_reward_model(cfg.reward_model, device) if cfg.reward_model else (None, None)
    rewarder = Rewarder(functions, reward_model, reward_tokenizer)
    toolbox = load_toolbox(cfg.tools) if cfg.tools else None
    if toolbox is not None and tokenizer.chat_template != "chatml":
        raise ConfigError("config key 'tools': this tokenizer's [INST] chat template cannot show tools; tools need "
                          "MiniMind's ChatML one")
    return rewarder, toolbox


@dataclasses.dataclass
class Rollouts:
    """One micro-batch of a step: its prompts' completions as training rows, with what the loss needs."""
    prompts: list[Prompt]  # the prompt of each completion (group by group)
    texts: list[str]  # each completion (with tools: its last turn)
    conversations: list[list[dict]]  # what each text answers (with tools: the earlier turns, calls and results too)
    X: torch.Tensor
    Y: torch.Tensor
    mask: torch.Tensor  # 1 on the tokens the policy wrote
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # (n,) each completion's (GRPO); (n, T) each token's (PPO)
    old_logp: torch.Tensor | None = None  # the rollout policy's log-probs (ppo_epochs > 1)
    ref_logp: torch.Tensor | None = None  # the reference's (beta > 0)
    values: torch.Tensor | None = None  # (n, T) the critic's values at the rollout (PPO)
    returns: torch.Tensor | None = None  # (n, T) the critic's targets: advantages + values, before whitening (PPO)


def roll_out(raw_model, prompts: list[Prompt], indices: list[int], step: int, cfg, tokenizer, run, toolbox=None,
             greedy: bool = False) -> Rollouts:
    """group_size sampled completions of each prompt, each prompt's seeded by (seed, step, its index); greedy: one
    greedy completion each. With a toolbox, each completion is a conversation of up to max_turns turns."""
    seeds = None if greedy else [prompt_seed(cfg.seed, step, i) for i in indices]
    group = 1 if greedy else cfg.group_size
    repeated = [p for p in prompts for _ in range(group)]
    with run.autocast():
        if toolbox is None:
            rows = rollout(raw_model, [p.ids for p in prompts], seeds, group, cfg.max_new_tokens, tokenizer.eos_id,
                           cfg.temperature, cfg.top_p)
            X, Y, mask = completion_batch([r.prompt for r in rows], [r.tokens for r in rows], tokenizer.eos_id,
                                          tokenizer.pad_id, run.device)
            return Rollouts(repeated, completion_texts(tokenizer, rows), [p.messages for p in repeated], X, Y, mask)
        turns = agent_rollout(raw_model, tokenizer, prompts, seeds, group, cfg.max_new_tokens, cfg.max_turns, toolbox,
                              cfg.temperature, cfg.top_p)
    X, Y, mask = completion_batch([t.prompt for t in turns], [t.ids for t in turns], tokenizer.eos_id,
                                  tokenizer.pad_id, run.device, [t.generated for t in turns])
    return Rollouts(repeated, [t.text for t in turns], [t.messages for t in turns], X, Y, mask)


def make_reference(cfg, model):
    """A context that gives the KL's reference model: None for beta 0 (none is loaded); with LoRA the policy
    itself with its adapters off; else a frozen copy of init_from."""
    if not cfg.beta:
        return None
    if cfg.lora_rank:
        return partial(lora.adapters_off, model)
    frozen = frozen_model(cfg.init_from, next(model.parameters()).device, cfg.flash)
    return partial(contextlib.nullcontext, frozen)


@torch.no_grad()
def validation_reward(raw_model, val_loader, rewarder: Rewarder, cfg, tokenizer, run, toolbox=None) -> dict[str, float]:
    """val_reward: the mean reward of greedy completions of the held-out prompts (the first eval_steps batches of
    every rank); val_pass1, with reward=answer: the fraction whose final answer is the reference."""
    def batch_sums(indices):
        b = roll_out(raw_model, [val_loader.dataset[i] for i in indices], indices, 0, cfg, tokenizer, run, toolbox,
                     greedy=True)
        sums = {"reward": sum(rewarder(b.prompts, b.texts, b.conversations)), "prompts": len(b.prompts)}
        if "answer" in rewarder.functions:
            sums["pass"] = sum(answer_reward(t, reference(p.record)) == 1.0 for p, t in zip(b.prompts, b.texts))
        return {k: torch.tensor(float(v)) for k, v in sums.items()}

    totals = evaluate(batch_sums, val_loader.batches(cfg.eval_steps), run)
    n = totals.pop("prompts")
    return {"val_reward": totals["reward"] / n} | ({"val_pass1": totals["pass"] / n} if "pass" in totals else {})
