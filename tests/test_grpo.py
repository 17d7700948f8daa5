"""GRPO (grpo.py, train_grpo.py): advantages, the two losses and the k3 KL against hand computations; rollouts
seeded per prompt; nothing after eos; the prompts file; a reward function's errors; batch x accum x ranks as one
batch; and a LoRA policy whose reference is itself with the adapters off."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import grpo
import train_grpo
from chat import encode_chat
from conftest import (REPO, TINY_RUN, greedy_alone, on_device, read_metrics, run_script, shorter_is_better, tiny,
                      write_jsonl)
from data import read_prompts
from errors import BadRecord, ConfigError, RewardError
from grpo import completion_batch, group_advantages, policy_loss, rollout, token_logprobs
from rewards import load_rewards

EOS, PAD = 2, 0


def batch(seed=0, n=6, T=10):
    """A tiny model and n rows of prompt + completion (completions of different lengths, some padding)."""
    model = tiny(vocab_size=97).train()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (3 + i % 2,), generator=g).tolist() for i in range(n)]
    completions = [torch.randint(3, 97, (2 + i,), generator=g).tolist() for i in range(n)]
    X, Y, mask = completion_batch(prompts, completions, EOS, PAD, "cpu")
    return model, X, Y, mask


# --- advantages ---------------------------------------------------------------------------------------

def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(rewards, 4)
    s = 0.5 / (0.5 + 1e-4)  # group 1: mean 0.5, std 0.5 (over the group)
    std2 = math.sqrt(((3 - 2) ** 2 + (1 - 2) ** 2 + 0 + 0) / 4)  # group 2: mean 2
    expected = [s, -s, -s, s, 1 / (std2 + 1e-4), -1 / (std2 + 1e-4), 0, 0, 0, 0, 0, 0]
    assert torch.allclose(a, torch.tensor(expected), atol=1e-6)
    assert (a[8:] == 0).all()  # equal rewards: exactly zero, not a rounding's 1e-12


def test_a_group_with_equal_rewards_gives_zero_gradient():
    model, X, Y, mask = batch()
    advantages = group_advantages(torch.tensor([0.7] * 3 + [1.0] * 3), 3)
    for loss_type in ("grpo", "cispo"):
        model.zero_grad()
        logp = token_logprobs(model, X, Y)
        loss, _ = policy_loss(logp, logp.detach(), None, advantages, mask, loss_type, 0.2, 5.0, 0.0)
        loss.backward()
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())


# --- the losses against a hand-written policy gradient --------------------------------------------------

@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_first_update_ratio_is_one_and_gradient_is_the_policy_gradient(loss_type):
    model, X, Y, mask = batch()
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.0, 2.0, -2.0])
    n_tokens = mask.sum()
    logp = token_logprobs(model, X, Y)
    loss, m = policy_loss(logp, logp.detach(), None, advantages, mask, loss_type, 0.2, 5.0, 0.0)
    if loss_type == "grpo":  # ratio exactly 1: each token's loss is -A, exactly
        assert loss == -(advantages[:, None] * mask).sum()
    assert m["clipped"] == 0
    (loss / n_tokens).backward()
    ours = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()  # REINFORCE written out: -sum over completion tokens of A * log softmax(logits)[target]
    logits, _ = model(X, Y)
    hand_logp = F.log_softmax(logits, dim=-1).gather(-1, Y[..., None])[..., 0]
    (-(advantages[:, None] * hand_logp * mask).sum() / n_tokens).backward()
    for a, b in zip(ours, [p.grad for p in model.parameters()]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_grpo_clips_a_stale_ratio_and_cispo_caps_its_weight():
    logp = torch.tensor([[0.0, math.log(2.0), math.log(0.5)]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    for A, zero_grad_token in ((1.0, 1), (-1.0, 2)):  # ratio 2 > 1.2 with A > 0; ratio 0.5 < 0.8 with A < 0
        logp.grad = None
        loss, m = policy_loss(logp, old, None, torch.tensor([A]), mask, "grpo", 0.2, 5.0, 0.0)
        loss.backward()
        assert m["clipped"] == 1 and logp.grad[0, zero_grad_token] == 0 and logp.grad[0, 0] == -A
    logp.grad = None
    loss, m = policy_loss(logp, old, None, torch.tensor([1.0]), mask, "cispo", 0.2, 1.5, 0.0)
    loss.backward()  # weights min(ratio, 1.5), detached: 1, 1.5, 0.5
    assert m["clipped"] == 1 and torch.allclose(logp.grad, torch.tensor([[-1.0, -1.5, -0.5]]))


def test_k3_kl_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding
    beta = 0.3
    loss, m = policy_loss(logp, logp.detach(), ref, torch.zeros(1), mask, "grpo", 0.2, 5.0, beta)
    kl = sum(math.exp(r - p) - (r - p) - 1 for p, r in [(-1.0, -1.5), (-2.0, -1.0), (-0.5, -0.5)])
    assert m["kl"].item() == pytest.approx(kl, rel=1e-6)
    assert loss.item() == pytest.approx(beta * kl, rel=1e-6)
    loss.backward()  # d/dlogp of beta * (exp(r - p) - (r - p) - 1) = beta * (1 - exp(r - p)); none for padding
    expected = [beta * (1 - math.exp(r - p)) for p, r in [(-1.0, -1.5), (-2.0, -1.0), (-0.5, -0.5)]] + [0.0]
    assert torch.allclose(logp.grad, torch.tensor([expected]), atol=1e-7)


def test_tokens_after_eos_carry_nothing():
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11, EOS], [12, EOS]]
    trailing = [[10, 11, EOS, 40, 41, 42], [12, EOS, 43]]  # whatever follows eos
    assert all(torch.equal(a, b) for a, b in zip(completion_batch(prompts, completions, EOS, PAD, "cpu"),
                                                  completion_batch(prompts, trailing, EOS, PAD, "cpu")))
    X, Y, mask = completion_batch(prompts, completions, EOS, PAD, "cpu")
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]  # the completions' tokens, eos included
    assert Y[0, 2:].tolist() == [10, 11, EOS]
    # and the padding after a short completion carries no loss: other ids there change nothing
    model = tiny(vocab_size=97)
    Y2 = Y.clone()
    Y2[1, 3:] = 50
    A = torch.tensor([1.0, -1.0])
    losses = [policy_loss(lp := token_logprobs(model, X, y), lp.detach(), None, A, mask, "cispo", 0.2, 5.0, 0.0)[0]
              for y in (Y, Y2)]
    assert losses[0] == losses[1]


# --- rollouts ----------------------------------------------------------------------------------------------

def test_rollouts_of_prompts_of_different_lengths_are_each_prompts_own(device):
    model = tiny(vocab_size=97).to(device).eval()  # each prompt's generator on the model's device
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    rows = rollout(model, prompts, None, 2, 6, eos_id=None)
    assert [r.tokens for r in rows] == [greedy_alone(model, p, 6) for p in prompts for _ in range(2)]
    # sampled: each prompt's rows draw from its own seed, whatever else is in the batch
    together = [r.tokens for r in rollout(model, prompts, [1, 2, 3], 4, 6, eos_id=None)]
    alone = [r.tokens for r in rollout(model, prompts[1:2], [2], 4, 6, eos_id=None)]
    assert together[4:8] == alone and len({tuple(t) for t in alone}) > 1


# --- prompts and rewards ---------------------------------------------------------------------------------

def test_prompts_drop_a_trailing_assistant_turn_and_take_answer_or_gt(tok, tmp_path):
    user = {"role": "user", "content": "What is double 3?"}
    path = write_jsonl(tmp_path / "rl.jsonl", [
        {"conversations": [user, {"role": "assistant", "content": ""}], "gt": 6},  # MiniMind's rlaif.jsonl
        {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, user],
         "answer": "6"}])
    a, b = read_prompts(path, tok, 64, need_reference=True, verbose=False)
    assert a.messages == [user] and a.ids == encode_chat(tok, [user])[0] and a.where == f"{path}:1"
    assert len(b.messages) == 3 and b.ids == encode_chat(tok, b.messages)[0]
    rewards = load_rewards("answer")
    assert rewards["answer"](a.messages, "3 + 3 = 6.", a.record) == 1.0  # gt 6, a number in the JSON
    assert rewards["answer"](b.messages, "3 + 3 = 7.", b.record) == 0.0


def test_bad_prompt_records_name_their_line(tok, tmp_path):
    user = {"role": "user", "content": "What is double 3?"}
    cases = [({"conversations": [user]}, "missing field 'answer'"),
             ({"conversations": [{"role": "assistant", "content": "x"}], "answer": "1"}, "no user message"),
             ({"conversations": [{"role": "user", "content": "word " * 200}], "answer": "1"}, "max_prompt_length=64")]
    for record, message in cases:
        path = write_jsonl(tmp_path / "rl.jsonl", [{"conversations": [user], "answer": "6"}, record])
        with pytest.raises(BadRecord, match=f"rl.jsonl:2: .*{message}"):
            read_prompts(path, tok, 64, need_reference=True, verbose=False)
    assert len(read_prompts(path, tok, 64, need_reference=True, skip_bad=True, verbose=False)) == 1


def test_unknown_reward_names_are_config_errors():
    with pytest.raises(ConfigError, match="'nonsense'"):
        load_rewards("answer,nonsense")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        load_rewards("no_such_module:f")


# --- training runs ---------------------------------------------------------------------------------------

def grpo_args(demo_dir, init_from, out_dir, *flags):
    return [f"--init_from={init_from}", f"--data_path={demo_dir}/grpo.jsonl",
            f"--val_data_path={demo_dir}/grpo_eval.jsonl", f"--out_dir={out_dir}", *TINY_RUN, "--group_size=4", "--max_new_tokens=8", "--temperature=1.0",
            "--lr=1e-3", "--warmup_steps=0", "--eval_interval=100", "--save_interval=100", *flags]


def test_a_raising_or_non_finite_reward_is_one_line_naming_the_record(demo_dir, tiny_sft, tmp_path):
    line = 7  # the one record the reward function fails on
    question = json.loads(open(f"{demo_dir}/grpo.jsonl", encoding="utf-8").readlines()[line - 1])["conversations"][0]
    module = tmp_path / "my_rewards.py"
    module.write_text("import math\n"
                      "def picky(messages, completion, record):\n"
                      f"    if messages[0]['content'] == {question['content']!r}:\n"
                      "        raise ValueError('not this one')\n"
                      "    return 1.0\n"
                      "def nan(messages, completion, record):\n"
                      "    return math.nan\n")
    with pytest.raises(RewardError, match=rf"grpo.jsonl:{line}: reward .*picky raised ValueError: not this one"):
        train_grpo.main(grpo_args(demo_dir, tiny_sft, tmp_path / "a", f"--reward={module}:picky", "--batch_size=60",
                                  "--max_steps=2"))
    result = run_script("train_grpo.py", *grpo_args(demo_dir, tiny_sft, tmp_path / "b", f"--reward={module}:nan",
                                                    "--batch_size=4", "--max_steps=1"))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "returned nan, not a finite number" in last


def test_a_run_logs_its_rewards_and_evaluates_the_starting_model(demo_dir, tiny_sft, tmp_path, device):
    out = tmp_path / "run"
    train_grpo.main(grpo_args(demo_dir, tiny_sft, out, *on_device(device, "--batch_size=4", "--max_steps=3",
                                                                  "--beta=0.1", "--eval_interval=3")))
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and set(rows[0]) >= {"val_reward", "val_pass1"}
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for key in ("reward_mean", "reward_std", "kl", "clip_frac", "completion_len", "frac_zero_adv"):
        assert all(math.isfinite(r[key]) for r in train), key
    # the policy is the reference before its first update: exactly on a CPU; a GPU's kernels for a forward with
    # and without autograd may round apart (k3 of a 1e-6 difference is 5e-13)
    assert train[0]["kl"] <= (0.0 if device == "cpu" else 1e-9)
    assert all(r["clip_frac"] == 0.0 for r in train)  # one epoch: every ratio is 1
    assert 1 <= train[0]["completion_len"] <= 8
    assert (out / "best.pt").exists()


def test_lora_policy_is_its_own_reference_with_the_adapters_off(demo_dir, tiny_sft, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "frozen_model", None)  # a separate reference model would fail to load
    out = tmp_path / "lora"
    train_grpo.main(grpo_args(demo_dir, tiny_sft, out, "--batch_size=4", "--max_steps=2", "--beta=0.1",
                              "--lora_rank=4", "--lora_alpha=8", "--lr=1e-2", shorter_is_better(tmp_path)))
    train = [r for r in read_metrics(out) if "loss" in r]
    assert train[0]["kl"] == 0.0 and train[1]["kl"] > 0  # adapters start at zero, then move away


STEPS = 3


def run_split(demo_dir, tiny_sft, out_dir, batch_size, accum_steps, ranks):
    args = grpo_args(demo_dir, tiny_sft, out_dir, f"--batch_size={batch_size}", f"--accum_steps={accum_steps}",
                     f"--max_steps={STEPS}", "--max_grad_norm=0", "--beta=0.1", "--ppo_epochs=2",
                     shorter_is_better(out_dir.parent))
    if ranks == 1:
        train_grpo.main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.join(REPO, "train_grpo.py"), *args]
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_batch_4_equals_2_x_accum_2_equals_2_ranks(demo_dir, tiny_sft, tmp_path):
    rows, weights = {}, {}
    for name, split in {"4x1": (4, 1, 1), "2x2": (2, 2, 1), "2 ranks x 1x2": (1, 2, 2)}.items():
        run_split(demo_dir, tiny_sft, tmp_path / name, *split)
        rows[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        weights[name] = torch.load(tmp_path / name / f"step_{STEPS:07d}.pt", weights_only=False)["model"]
    one = rows["4x1"]
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    for name in ("2x2", "2 ranks x 1x2"):
        for a, b in zip(one, rows[name], strict=True):
            for key in ("reward_mean", "completion_len", "frac_zero_adv"):  # the same rollouts
                assert a[key] == b[key], (name, a["step"], key)
            for key in ("loss", "grad_norm", "kl"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (name, a["step"], key, a[key], b[key])
        diff = max((weights["4x1"][k] - weights[name][k]).abs().max().item() for k in weights["4x1"])
        assert diff <= 1e-5, (name, diff)
    assert any(r["clip_frac"] > 0 or r["kl"] > 0 for r in one)  # the second epoch saw a ratio other than 1


# --- eval.py pass ------------------------------------------------------------------------------------------

def test_pass_at_k_by_hand():
    from tasks.passk import pass_at_k
    assert pass_at_k(8, 2, 1) == 0.25 and pass_at_k(8, 2, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)  # 1 - C(4, 2) / C(5, 2)


def test_eval_pass_reports_the_greedy_answers_own_score(demo_dir, tiny_sft, tmp_path):
    import eval as evaluation
    from checkpoint import load_model
    from engine import complete

    section = evaluation.main(["pass", f"--ckpt={tiny_sft}", f"--data_path={demo_dir}/grpo_eval.jsonl", "--k=4",
                               "--max_new_tokens=8", "--device=cpu", f"--out={tmp_path}", "--batch_size=7"])
    model, tokenizer, _ = load_model(str(tiny_sft))
    records = [json.loads(line) for line in open(f"{demo_dir}/grpo_eval.jsonl", encoding="utf-8")]
    answers = complete(model, tokenizer, [encode_chat(tokenizer, r["conversations"])[0] for r in records], 8)
    last_number = [re.findall(r"\d+", a)[-1:] for a in answers]  # the answers' integers, written out by hand
    right = [float(n == [r["answer"]]) for n, r in zip(last_number, records)]
    assert section["prompts"] == 40 and section["greedy_pass1"] == sum(right) / 40
    assert 0 <= section["pass1"] <= section["passk"] <= 1
    assert "pass@4, sampled" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_a_reward_models_score_is_added_to_the_rule_rewards(tok):
    from data import Prompt
    from grpo import Rewarder
    from model import ModelConfig, Transformer
    from reward_model import RewardModel, score

    torch.manual_seed(0)
    rm = RewardModel(Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=tok.vocab_size,
                                             max_seq_len=64))).eval()
    torch.nn.init.normal_(rm.score_head.weight)
    user = [{"role": "user", "content": "What is double 3?"}]
    prompts = [Prompt(encode_chat(tok, user)[0], user, {"answer": "6"}, "rl.jsonl:1")] * 3
    texts = ["3 + 3 = 6.", "3 + 3 = 7.", "6"]
    scores = score(rm, tok, [user] * 3, texts)
    assert len(set(scores)) == 3  # the completions score differently
    assert Rewarder({}, rm, tok)(prompts, texts) == scores
    assert Rewarder(load_rewards("answer"), rm, tok)(prompts, texts) == [s + a for s, a in zip(scores, [1.0, 0.0, 1.0])]


def test_a_run_with_minimind_chatml_template(demo_dir, tmp_path):
    # MiniMind's tokenizer and template (the default), from a random-weights checkpoint of its vocabulary
    import dataclasses

    from model import ModelConfig, Transformer
    from tokenizer import DEFAULT_DIR, load_tokenizer

    tokenizer = load_tokenizer(str(DEFAULT_DIR))
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=tokenizer.vocab_size, max_seq_len=64)
    torch.manual_seed(0)
    torch.save({"model": Transformer(cfg).state_dict(), "model_config": dataclasses.asdict(cfg)}, tmp_path / "init.pt")
    out = tmp_path / "run"
    train_grpo.main(grpo_args(demo_dir, tmp_path / "init.pt", out, f"--tokenizer_path={DEFAULT_DIR}",
                              "--batch_size=4", "--max_steps=2"))
    prompts = read_prompts(f"{demo_dir}/grpo_eval.jsonl", tokenizer, 56, verbose=False)
    assert tokenizer.decode(prompts[0].ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    train = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(1 <= r["completion_len"] <= 8 for r in train)
