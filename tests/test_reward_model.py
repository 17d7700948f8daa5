"""Reward model: the head reads each row's last real token (padding changes nothing), the Bradley-Terry loss and pair
accuracy by hand, answers scored as training renders them, a short run learns learnable pairs, an exact resume, a
reward checkpoint refused by load_model in one line, and eval.py pairs reporting what score() gives."""
import json
import math
import re

import pytest
import torch

import eval as evaluation
import train_reward
from checkpoint import load_model
from conftest import CONVERSATION, TINY_RUN, assert_resumes_exactly, read_metrics, tiny, write_jsonl
from config import RewardConfig, load_config
from errors import CheckpointError, ConfigError
from reward_model import RewardModel, answer_ids, bradley_terry_loss, load_reward_model, score, score_ids
from token_cache import dpo_prompt_and_answers, encode_dpo
from tokenizer import load_tokenizer

HAN = re.compile("[\u4e00-\u9fff]")


def reward(init_from, data_path, out_dir, *flags):
    """A tiny reward-model run: batches of 8 pairs, lr 3e-3, no warmup, prompts and answers of 32 tokens at most."""
    train_reward.main([f"--init_from={init_from}", f"--data_path={data_path}", f"--out_dir={out_dir}", *TINY_RUN,
                       "--batch_size=8", "--lr=3e-3", "--warmup_ratio=None", "--warmup_steps=0",
                       "--max_prompt_length=32", "--max_completion_length=32", *flags])


def prompts_and_answers(path) -> tuple[list[list[dict]], list[str], list[str]]:
    """A pairs file read with plain json: (prompts, chosen answers, rejected answers)."""
    with open(path, encoding="utf-8") as f:
        triples = [dpo_prompt_and_answers(json.loads(line)) for line in f]
    return [p for p, _, _ in triples], [c["content"] for _, c, _ in triples], [r["content"] for _, _, r in triples]


def other_language(line: str) -> bool:
    """Whether a pair's answers are in two languages: Chinese characters in one of them only."""
    _, chosen, rejected = dpo_prompt_and_answers(json.loads(line))
    return bool(HAN.search(chosen["content"])) != bool(HAN.search(rejected["content"]))


@pytest.fixture(scope="module")
def language_pairs(demo_dir, tmp_path_factory):
    """The demo pairs whose rejected answer is in the other language: a surface feature even the tiny model can
    learn to see."""
    lines = (demo_dir / "dpo.jsonl").read_text(encoding="utf-8").splitlines(True)
    lines = [line for line in lines if other_language(line)]
    path = tmp_path_factory.mktemp("pairs") / "language_pairs.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tiny_sft, language_pairs, tmp_path_factory):
    """A reward model trained for 40 steps at lr 1e-2 on the language pairs, its validation set the last 20% of
    them (15 pairs)."""
    out = tmp_path_factory.mktemp("reward")
    reward(tiny_sft, language_pairs, out, "--lr=1e-2", "--val_fraction=0.2", "--max_steps=40", "--eval_interval=8",
           "--eval_steps=100", "--early_stopping_patience=1000")
    return out


def test_the_head_reads_the_last_real_token_and_padding_after_it_changes_nothing():
    model = RewardModel(tiny()).eval()
    torch.nn.init.normal_(model.score_head.weight, generator=torch.Generator().manual_seed(0))  # a zero head says 0
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(3, 97, (5,), generator=g).tolist(), torch.randint(3, 97, (11,), generator=g).tolist()
    alone = score_ids(model, [short], pad_id=0, batch_size=1)[0]
    assert score_ids(model, [long, short, long], pad_id=0)[1] == pytest.approx(alone, abs=1e-6)
    padded = torch.tensor([short + [7] * 6, long])  # padding of any id, the length given explicitly
    with torch.no_grad():
        ends = torch.tensor([4, 11 + 10])  # each row's last real token in padded.flatten(), the rows 11 long
        batch = model(padded, ends)
        assert batch[0].item() == pytest.approx(alone, abs=1e-6)
        assert model(padded, ends - 1)[0].item() != pytest.approx(alone, abs=1e-3)  # another token
        changed = padded.clone()
        changed[0, 4] = (changed[0, 4] + 1) % 97  # the last real token itself
        assert model(changed, ends)[0].item() != pytest.approx(alone, abs=1e-3)


def test_a_fresh_head_scores_zero():
    model = RewardModel(tiny())
    assert model(torch.randint(0, 97, (3, 9)), torch.tensor([8, 12, 18])).tolist() == [0.0, 0.0, 0.0]


def test_the_bradley_terry_loss_and_pair_accuracy_by_hand():
    chosen = torch.tensor([2.0, -1.0, 0.5, 3.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0, 0.5, -1.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    # margins 1, -1, 0, 4; -log sigmoid(x) = log(1 + e^-x); a tie is not a right ranking
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-x)) for x in (1, -1, 0, 4)) / 4, rel=1e-6)
    assert m["pair_acc"].item() == 0.5 and m["reward_margin"].item() == pytest.approx(1.0)
    assert m["chosen_reward"].item() == pytest.approx(1.125) and m["rejected_reward"].item() == pytest.approx(0.125)
    loss.backward()  # d/dr_chosen of -log sigmoid(m) / n = -sigmoid(-m) / n
    assert chosen.grad.tolist() == pytest.approx([-1 / (1 + math.exp(x)) / 4 for x in (1, -1, 0, 4)], rel=1e-6)


@pytest.mark.parametrize("template", ["llama2", "chatml"])
def test_score_renders_an_answer_as_training_renders_the_pair(template, tok):
    tokenizer = tok if template == "llama2" else load_tokenizer()  # nanomind's own; MiniMind's, the default
    prompt = CONVERSATION[:-1]  # a system prompt, a whole turn, then the user's question
    record = {"chosen": CONVERSATION, "rejected": prompt + [{"role": "assistant", "content": "在亚洲。"}]}
    (prompt_ids, chosen, rejected), _ = encode_dpo(tokenizer, record)
    assert answer_ids(tokenizer, prompt, CONVERSATION[-1]["content"]) == [*prompt_ids, *chosen]
    assert answer_ids(tokenizer, prompt, "在亚洲。") == [*prompt_ids, *rejected]
    assert chosen[-1] == rejected[-1] == tokenizer.eos_id  # </s> or <|im_end|>: the end of the answer's turn


def test_training_logs_the_loss_and_accuracy_of_the_validation_pairs_by_hand(trained, language_pairs):
    last = [r for r in read_metrics(trained) if "val_loss" in r][-1]
    lines = language_pairs.read_text(encoding="utf-8").splitlines()
    held_out = write_jsonl(trained / "held_out.jsonl", [json.loads(x) for x in lines[-round(0.2 * len(lines)):]])
    state = torch.load(trained / f"step_{last['step']:07d}.pt", weights_only=False)
    model, tokenizer = load_reward_model(str(trained / "best.pt"), "cpu")
    model.load_state_dict(state["model"])  # the weights of the last evaluation
    prompts, chosen, rejected = prompts_and_answers(held_out)
    c, r = score(model, tokenizer, prompts, chosen), score(model, tokenizer, prompts, rejected)
    margins = [a - b for a, b in zip(c, r)]
    assert last["val_pair_acc"] == pytest.approx(sum(m > 0 for m in margins) / len(margins), abs=1e-6)
    assert last["val_loss"] == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / len(margins), rel=1e-4)
    assert last["val_reward_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-5)


def test_a_short_run_learns_to_rank_held_out_learnable_pairs(trained):
    rows = read_metrics(trained)
    (first,) = [r for r in rows if r.get("step") == 1 and "loss" in r]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["pair_acc"] == 0.0  # the zero head
    evals = [r for r in rows if "val_loss" in r]
    assert evals[-1]["step"] == 40 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["val_pair_acc"] >= 0.9 and evals[-1]["val_loss"] < 0.5 * math.log(2)
    assert torch.load(trained / "best.pt", weights_only=False)["stage"] == "reward"


def test_reward_training_resumes_exactly(tiny_sft, demo_dir, tmp_path):
    lines = (demo_dir / "dpo.jsonl").read_text(encoding="utf-8").splitlines()[:60]
    data = write_jsonl(tmp_path / "pairs.jsonl", [json.loads(x) for x in lines])
    flags = ["--max_steps=8", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=4", "--dropout=0.1",
             "--val_fraction=0.2"]
    assert_resumes_exactly(lambda out, *more: reward(tiny_sft, data, out, *flags, *more), tmp_path / "full",
                           tmp_path / "resumed", saved=4, last=8)
    last_val = [[r for r in read_metrics(tmp_path / run) if "val_loss" in r][-1] for run in ("full", "resumed")]
    assert last_val[0]["step"] == last_val[1]["step"] == 8 and last_val[0] == last_val[1]


def test_a_reward_checkpoint_is_no_language_model_and_an_sft_one_no_reward_model(trained, tiny_sft):
    with pytest.raises(CheckpointError, match=r"best\.pt is a reward model \(train_reward\.py\), not a language model"):
        load_model(str(trained / "best.pt"))
    with pytest.raises(CheckpointError, match=r"best\.pt is not a reward model but a sft checkpoint"):
        load_reward_model(str(tiny_sft), "cpu")
    with pytest.raises(ConfigError, match="'lora_rank' must be 0"):
        load_config(["--lora_rank=4"], RewardConfig)
    with pytest.raises(ConfigError, match=r"= 129 exceeds the model's max_seq_len = 128"):
        load_config(["--max_prompt_length=64", "--max_completion_length=65"], RewardConfig)[0].fit_lengths(128)


def test_eval_pairs_reports_what_score_gives(trained, demo_dir, tmp_path):
    pairs = demo_dir / "dpo.jsonl"  # every kind of pair: some ranked right, some not
    section = evaluation.main(["pairs", f"--ckpt={trained / 'best.pt'}", f"--data_path={pairs}", "--device=cpu",
                               f"--out={tmp_path}", "--batch_size=5"])
    model, tokenizer = load_reward_model(str(trained / "best.pt"), "cpu")
    prompts, chosen, rejected = prompts_and_answers(pairs)
    c, r = score(model, tokenizer, prompts, chosen), score(model, tokenizer, prompts, rejected)
    margins = [a - b for a, b in zip(c, r)]
    assert section["pairs"] == len(prompts) and 0 < section["pair_acc"] < 1
    assert section["pair_acc"] == pytest.approx(sum(m > 0 for m in margins) / len(margins), abs=1e-6)
    assert section["reward_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-5)
    assert section["chosen_reward"] == pytest.approx(sum(c) / len(c), rel=1e-5, abs=1e-6)
    assert section["loss"] == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / len(margins), rel=1e-5)
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["sections"]["pairs"] == section and report["stage"] == "reward"
    assert f"**{section['pair_acc']:.1%}** of the {len(prompts)} pairs" in (tmp_path / "report.md").read_text()
