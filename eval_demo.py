"""
Evaluate checkpoints on the demo's held-out questions (prepare_demo.py writes them to eval.jsonl), side by side.

    python eval_demo.py out/demo/pretrain/best.pt out/demo/sft/best.pt out/demo/dpo/best.pt \
        --dpo_pairs=data/demo/dpo_eval.jsonl --reference=out/demo/sft/best.pt

For each checkpoint: greedy answers to every question in the chat template, then exact-match accuracy (the
answer equals the expected sentence) and the rate of answers in the language the question was asked in,
overall and per kind of question. With --dpo_pairs: on held-out preference pairs, the reward accuracy against
the reference (DPO's reward margin > 0) and how often the model itself gives the chosen answer the higher
log-probability per token.
"""
import json
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from checkpoint import checkpoint_tokenizer, load_checkpoint, load_model
from config import load_config, usage, words
from data import DPOData, Loader
from engine import complete, prompt_ids
from errors import ConfigError, cli
from losses import pair_logprobs
from token_cache import tokenize_file

HAN = re.compile(r"[\u4e00-\u9fff]")


@dataclass
class Config:
    # --- I/O
    ckpts: list[str] = words("CKPT...")  # checkpoints to compare
    data: str = "data/demo/eval.jsonl"  # the held-out questions (prepare_demo.py)
    tokenizer_path: str | None = None  # None: the one the first checkpoint was trained with
    show: int = 3  # print this many example answers per checkpoint
    # --- preference pairs
    dpo_pairs: str | None = None  # held-out preference pairs (JSONL) to score
    reference: str | None = None  # the reference model of dpo_pairs' reward accuracy (the SFT model)
    length_norm: bool = False  # per-token mean log-probs for the pairs (as DPO's length_norm); False: sums


def answer_language(text: str) -> str:
    return "zh" if HAN.search(text) else "en"


def score(items: list[dict], answers: list[str]) -> dict[str, tuple[float, float, int]]:
    """kind -> (exact-match accuracy, asked-language rate, count), plus "all"."""
    groups = defaultdict(list)
    for item, answer in zip(items, answers):
        hit = (answer == item["answer"], answer_language(answer) == item["lang"])
        groups[item["kind"]].append(hit)
        groups["all"].append(hit)
    return {k: (sum(h[0] for h in v) / len(v), sum(h[1] for h in v) / len(v), len(v)) for k, v in groups.items()}


@torch.no_grad()
def pair_table(model, data: DPOData, pad_id: int, length_norm: bool) -> torch.Tensor:
    """Log-prob of the chosen and the rejected answer of every pair under an eval-mode model, (n_pairs, 2)."""
    table = torch.zeros(len(data), 2)
    for batch in Loader(data, 64, pad_id).batches(10**12):
        table[batch.items] = torch.stack(pair_logprobs(model, batch, length_norm), dim=1)
    return table


def preference(policy: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(reward accuracy: margin (pi_c - ref_c) - (pi_r - ref_r) > 0, own preference: pi_c > pi_r)."""
    margin = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    return (margin > 0).float().mean().item(), (policy[:, 0] > policy[:, 1]).float().mean().item()


def main(argv: list[str]):
    (args,) = load_config(argv, Config)
    if not args.ckpts:
        raise ConfigError(f"{usage([Config])}: name at least one checkpoint")

    tokenizer = checkpoint_tokenizer(load_checkpoint(args.ckpts[0]), args.tokenizer_path)  # the first one's

    def load_same(path: str):
        model, own, _ = load_model(path, tokenizer_path=args.tokenizer_path)
        if own.fingerprint != tokenizer.fingerprint:
            raise ConfigError(f"{path} was trained with another tokenizer than {args.ckpts[0]}: compare checkpoints "
                              "of one tokenizer")
        return model

    with open(args.data, encoding="utf-8") as f:
        items = [json.loads(line) for line in f]
    pairs = DPOData(tokenize_file(args.dpo_pairs, tokenizer, "dpo", verbose=False)) if args.dpo_pairs else None
    if pairs is not None and args.reference:
        reference = pair_table(load_same(args.reference), pairs, tokenizer.pad_id, args.length_norm)
    results, preferences = {}, {}
    for path in args.ckpts:
        model = load_same(path)
        prompts = [prompt_ids(tokenizer, [{"role": "user", "content": it["question"]}]) for it in items]
        answers = complete(model, tokenizer, prompts, max_new_tokens=48)
        results[path] = score(items, answers)
        if pairs is not None:
            own = pair_table(model, pairs, tokenizer.pad_id, args.length_norm)
            preferences[path] = preference(own, reference if args.reference else own)
        for item, answer in list(zip(items, answers))[: args.show]:
            print(f"{path}: {item['question']!r} -> {answer!r} (expected {item['answer']!r})")
    kinds = sorted({k for r in results.values() for k in r}, key=lambda k: (k == "all", k))
    print(f"\n{'checkpoint':<36}" + "".join(f"{k + ' acc/lang':>22}" for k in kinds))
    for path, r in results.items():
        print(f"{path:<36}" + "".join(f"{r[k][0]:>11.1%} /{r[k][1]:>7.1%}  " for k in kinds))
    print(f"({len(items)} held-out questions: " + ", ".join(f"{r[k][2]} {k}" for k in kinds if k != "all") + ")")
    if preferences:
        print(f"\n{'checkpoint':<36}{'reward acc vs reference':>26}{'prefers chosen':>18}   ({len(pairs)} held-out pairs)")
        for path, (reward_acc, own) in preferences.items():
            print(f"{path:<36}{reward_acc:>26.1%}{own:>18.1%}")
    return results, preferences


if __name__ == "__main__":
    cli(main)
