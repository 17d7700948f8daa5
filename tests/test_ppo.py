"""PPO with a critic (ppo.py, train_ppo.py): GAE against a loop written out per row, the per-token rewards, the
whitening, the clipped value loss and both clip fractions on known numbers; the critic as a copy of the policy; a
run whose reward rises and whose critic learns; exact resume with the critic; 2 ranks == one process; LoRA."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_ppo
from checkpoint import load_checkpoint
from conftest import REPO, TINY_RUN, assert_resumes_exactly, read_metrics, shorter_is_better, tiny
from grpo import policy_loss
from ppo import explained_variance, gae, token_rewards, value_loss, value_model, whiten
from runtime import Run

ONE_PROCESS = Run(torch.device("cpu"), "float32")


def gae_by_hand(rewards, values, mask, gamma, lam):
    """GAE written out: per row, over the positions of its completion tokens only, back to front."""
    advantages, returns = np.zeros_like(values), np.zeros_like(values)
    for r in range(len(values)):
        steps = [t for t in range(values.shape[1]) if mask[r, t]]
        following_value = following_advantage = 0.0
        for t in reversed(steps):
            delta = rewards[r, t] + gamma * following_value - values[r, t]
            advantages[r, t] = following_advantage = delta + gamma * lam * following_advantage
            returns[r, t] = advantages[r, t] + values[r, t]
            following_value = values[r, t]
    return advantages, returns


# --- GAE and the per-token rewards ---------------------------------------------------------------

def test_gae_of_two_tokens_by_hand():
    rewards, values, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[9.0, 0.5, 0.2]]), torch.tensor([[0.0, 1, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.9)
    # last token: 1 - 0.2 = 0.8; the one before: 0 + 0.2 - 0.5 + 0.9 x 0.8 = 0.42; the prompt position: nothing
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.42, 0.8]]))
    assert torch.allclose(returns, torch.tensor([[0.0, 0.92, 1.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_equals_the_loop_per_row_with_prompts_padding_and_tool_results(gamma, lam):
    g = torch.Generator().manual_seed(0)
    # completions of different lengths after prompts of different lengths, padding after; row 2 has tool results
    # (mask 0) between two turns, which GAE must step over
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0],
                         [0, 1, 1, 0, 0, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.float32)
    values = torch.randn(mask.shape, generator=g)
    scores, kl = torch.tensor([1.0, -0.5, 2.0, 0.25]), torch.randn(mask.shape, generator=g)
    rewards = token_rewards(scores, mask, kl, beta=0.1)
    expected_rewards = -0.1 * kl * mask
    for r, last in enumerate([5, 2, 7, 7]):  # the reward comes on the last token the policy wrote
        expected_rewards[r, last] += scores[r]
    assert torch.allclose(rewards, expected_rewards)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    hand = gae_by_hand(rewards.numpy(), values.numpy(), mask.numpy(), gamma, lam)
    assert np.allclose(advantages.numpy(), hand[0], atol=1e-6) and np.allclose(returns.numpy(), hand[1], atol=1e-6)
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_without_beta_the_reward_is_the_score_on_the_last_token_alone():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(token_rewards(torch.tensor([3.0, -1.0]), mask), torch.tensor([[0, 0, 3.0, 0], [0, 0, 0, -1.0]]))


def test_whitening_spans_every_micro_batch_and_only_completion_tokens():
    g = torch.Generator().manual_seed(1)
    advantages = [torch.randn(3, 5, generator=g) * 4 + 2 for _ in range(2)]
    masks = [(torch.rand(3, 5, generator=g) > 0.3).float() for _ in range(2)]
    white = whiten(advantages, masks, ONE_PROCESS)
    values = torch.cat([w[m > 0] for w, m in zip(white, masks)])
    assert abs(values.mean().item()) < 1e-6 and values.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert all((w[m == 0] == 0).all() for w, m in zip(white, masks))
    whole = whiten([torch.cat(advantages)], [torch.cat(masks)], ONE_PROCESS)[0]  # one micro-batch of both
    assert torch.allclose(torch.cat(white), whole, atol=1e-6)


# --- the losses -------------------------------------------------------------------------------------

def test_the_clipped_value_loss_by_hand():
    old, returns = torch.zeros(1, 4), torch.ones(1, 4)
    values = torch.tensor([[0.5, 0.1, -0.5, 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding
    loss, clipped = value_loss(values, old, returns, mask, value_clip=0.2)
    # token 0: 0.5 is held at 0.2: (0.2 - 1)^2 = 0.64 beats (0.5 - 1)^2 = 0.25, so the clip decides: no gradient
    # token 1: 0.1 moved less than the clip: 0.81, gradient 0.1 - 1
    # token 2: -0.5 is held at -0.2, but (-0.2 - 1)^2 = 1.44 < (-1.5)^2 = 2.25: the unclipped counts, gradient -1.5
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25)) and clipped.item() == 1
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.9, -1.5, 0.0]]))


def test_the_policy_clip_fraction_counts_tokens_whose_gradient_the_clip_drops():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5, 2.0]])).requires_grad_()  # ratios against old log p = 0
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]])  # per token, as PPO's
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, m = policy_loss(logp, torch.zeros(1, 5), None, advantages, mask, "grpo", 0.2, 5.0, 0.0)
    # 1.5 with A > 0: clipped; 0.5 with A > 0 and 1.1: inside; 0.5 with A < 0: clipped; the last is padding
    assert m["clipped"].item() == 2
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, -1.1, 0.0, 0.0]]))


def test_explained_variance_from_sums():
    returns, values = np.array([1.0, 2.0, 3.0, 6.0]), np.array([1.5, 2.0, 2.5, 5.0])
    e = returns - values
    ours = explained_variance(4, returns.sum(), (returns ** 2).sum(), e.sum(), (e ** 2).sum())
    assert ours == pytest.approx(1 - e.var() / returns.var())
    assert explained_variance(4, 8.0, 16.0, 0.0, 1.0) == 0.0  # returns that do not vary explain nothing


def test_the_critic_is_a_copy_of_the_policy_whose_values_start_at_zero():
    policy = tiny(vocab_size=97, tie_embeddings=False)
    critic = value_model(policy)
    X = torch.randint(0, 97, (2, 7))
    assert torch.equal(critic(X), torch.zeros(2, 7))
    assert all(torch.equal(p, q) and p.data_ptr() != q.data_ptr()
               for p, q in zip(policy.parameters(), critic.body.parameters()))
    assert not critic.body.output.weight.requires_grad  # no value reads the LM head
    torch.nn.init.normal_(critic.score_head.weight)
    assert critic(X).shape == (2, 7) and critic(X).dtype == torch.float32 and critic(X).std() > 0


# --- training runs -----------------------------------------------------------------------------------

def ppo_args(demo_dir, init_from, out_dir, *flags):
    return [f"--init_from={init_from}", f"--data_path={demo_dir}/grpo.jsonl",
            f"--val_data_path={demo_dir}/grpo_eval.jsonl", f"--out_dir={out_dir}", *TINY_RUN, "--max_new_tokens=8",
            "--temperature=1.0", "--lr=1e-3", "--critic_lr=1e-2", "--critic_min_lr=1e-3", "--warmup_steps=0",
            "--eval_interval=100", "--save_interval=100", *flags]


@pytest.fixture
def short(tmp_path):
    """A toy task: the fewer characters a completion writes, the better (-1 for 20 of them)."""
    return shorter_is_better(tmp_path, 20)


def test_reward_rises_and_the_critic_learns_on_a_toy_task(demo_dir, tiny_sft, tmp_path, short):
    out = tmp_path / "run"
    train_ppo.main(ppo_args(demo_dir, tiny_sft, out, short, "--batch_size=8", "--group_size=2", "--max_steps=12",
                            "--lr=3e-3", "--beta=0.05", "--eval_interval=12"))
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and "val_reward" in rows[0]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    for key in ("value_loss", "explained_var", "clip_frac", "value_clip_frac", "kl", "reward_mean", "completion_len",
                "critic_grad_norm"):
        assert all(math.isfinite(r[key]) for r in train), key
    first, last = train[:3], train[-3:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.1  # shorter answers
    assert mean(last, "reward_mean") > mean(first, "reward_mean") / 2  # half the characters (not tokens: a token
    # may be a character or none, and the policy may keep writing tokens that spell less)
    assert mean(last, "value_loss") < mean(first, "value_loss") / 2  # the critic learned what an answer is worth
    # the values start at 0 and explain nothing; later some of the returns' variance
    assert train[0]["explained_var"] == 0.0 and max(r["explained_var"] for r in train) > 0.2
    assert train[0]["kl"] == 0.0 and mean(last, "kl") > 0  # the policy starts as the reference, then moves away
    assert any(r["clip_frac"] > 0 for r in train) and any(r["value_clip_frac"] > 0 for r in train)  # 2 epochs
    assert rows[-1]["val_reward"] > rows[0]["val_reward"]


def test_a_resumed_run_with_its_critic_repeats_the_uninterrupted_one_exactly(demo_dir, tiny_sft, tmp_path, short):
    def run(out_dir, *flags):
        train_ppo.main(ppo_args(demo_dir, tiny_sft, out_dir, short, "--batch_size=4", "--max_steps=4", "--save_interval=2",
                                "--keep_checkpoints=5", "--dropout=0.1", *flags))

    assert_resumes_exactly(run, tmp_path / "full", tmp_path / "resumed", saved=2, last=4)
    a, b = (load_checkpoint(str(tmp_path / d / "step_0000004.pt")) for d in ("full", "resumed"))
    assert all(torch.equal(a["critic"][k], b["critic"][k]) for k in a["critic"])  # the critic too
    assert a["critic_optimizer"]["state"] and a["critic_guard"] == b["critic_guard"]


def test_two_ranks_train_as_one_process(demo_dir, tiny_sft, tmp_path, short):
    # the critic at the policy's lr: Adam turns rounding in a near-zero gradient into steps of up to lr
    args = [short, "--accum_steps=2", "--max_steps=3", "--max_grad_norm=0", "--group_size=2", "--critic_lr=1e-3",
            "--critic_min_lr=1e-4"]
    train_ppo.main(ppo_args(demo_dir, tiny_sft, tmp_path / "one", "--batch_size=2", *args))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train_ppo.py"), *ppo_args(demo_dir, tiny_sft, tmp_path / "two", "--batch_size=1", *args)]
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = ([r for r in read_metrics(tmp_path / d) if "loss" in r] for d in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert a["completion_len"] == b["completion_len"], a["step"]  # the same rollouts
        for key in ("reward_mean", "loss", "value_loss", "grad_norm", "critic_grad_norm", "kl", "explained_var",
                    "clip_frac"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    a, b = (load_checkpoint(str(tmp_path / d / "step_0000003.pt")) for d in ("one", "two"))
    for part in ("model", "critic"):
        assert max((a[part][k] - b[part][k]).abs().max().item() for k in a[part]) <= 1e-5, part
    assert any(r["clip_frac"] > 0 for r in one)  # the second epoch saw ratios other than 1


def test_a_lora_policy_and_critic_save_their_adapters_and_head_only(demo_dir, tiny_sft, tmp_path, short):
    out = tmp_path / "lora"
    train_ppo.main(ppo_args(demo_dir, tiny_sft, out, short, "--batch_size=4", "--max_steps=2", "--lora_rank=4",
                            "--lora_alpha=8", "--lr=1e-2"))
    train = [r for r in read_metrics(out) if "loss" in r]
    assert train[0]["kl"] == 0.0 and train[1]["kl"] != 0.0  # the reference is the policy with its adapters off
    state = load_checkpoint(str(out / "step_0000002.pt"))
    assert state["model"] and all(k.endswith((".lora_a", ".lora_b")) for k in state["model"])
    assert set(state["critic"]) == {f"body.{k}" for k in state["model"]} | {"score_head.weight"}
    assert not torch.equal(state["critic"]["score_head.weight"], torch.zeros_like(state["critic"]["score_head.weight"]))
