"""
Evaluate checkpoints on the demo's held-out questions (prepare_demo.py writes them to eval.jsonl), side by side.

    python eval_demo.py out/demo/pretrain/best.pt out/demo/sft/best.pt

For each checkpoint: greedy answers to every question in the chat template, then exact-match accuracy (the
answer equals the expected sentence) and the rate of answers in the language the question was asked in,
overall and per kind of question.
"""
import argparse
import json
import re
from collections import defaultdict

import torch

from data import encode_chat, load_tokenizer
from sample import load_model

HAN = re.compile(r"[\u4e00-\u9fff]")


def answer_language(text: str) -> str:
    return "zh" if HAN.search(text) else "en"


@torch.no_grad()
def answer_all(model, tokenizer, questions: list[str], max_new_tokens: int = 48, batch_size: int = 64) -> list[str]:
    """Greedy answers. Prompts of equal length share a batch, so no padding (and no attention mask) is needed."""
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}])[0] for q in questions]
    by_length = defaultdict(list)
    for i, ids in enumerate(prompts):
        by_length[len(ids)].append(i)
    answers = [""] * len(questions)
    device = next(model.parameters()).device
    for length, indices in by_length.items():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            idx = torch.tensor([prompts[i] for i in chunk], device=device)
            new = min(max_new_tokens, model.config.max_seq_len - length)
            out = model.generate(idx, new, temperature=0, eos_id=tokenizer.eos_id)[:, length:]
            for i, row in zip(chunk, out.tolist()):
                row = row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row
                answers[i] = tokenizer.decode(row).strip(" ")
    return answers


def score(items: list[dict], answers: list[str]) -> dict[str, tuple[float, float, int]]:
    """kind -> (exact-match accuracy, asked-language rate, count), plus "all"."""
    groups = defaultdict(list)
    for item, answer in zip(items, answers):
        hit = (answer == item["answer"], answer_language(answer) == item["lang"])
        groups[item["kind"]].append(hit)
        groups["all"].append(hit)
    return {k: (sum(h[0] for h in v) / len(v), sum(h[1] for h in v) / len(v), len(v)) for k, v in groups.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpts", nargs="+", help="checkpoints to compare")
    p.add_argument("--data", default="data/demo/eval.jsonl")
    p.add_argument("--tokenizer_path")
    p.add_argument("--show", type=int, default=3, help="print this many example answers per checkpoint")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer_path)
    with open(args.data, encoding="utf-8") as f:
        items = [json.loads(line) for line in f]
    results = {}
    for path in args.ckpts:
        model, _ = load_model(path)
        answers = answer_all(model, tokenizer, [it["question"] for it in items])
        results[path] = score(items, answers)
        for item, answer in list(zip(items, answers))[: args.show]:
            print(f"{path}: {item['question']!r} -> {answer!r} (expected {item['answer']!r})")
    kinds = sorted({k for r in results.values() for k in r}, key=lambda k: (k == "all", k))
    print(f"\n{'checkpoint':<36}" + "".join(f"{k + ' acc/lang':>22}" for k in kinds))
    for path, r in results.items():
        print(f"{path:<36}" + "".join(f"{r[k][0]:>11.1%} /{r[k][1]:>7.1%}  " for k in kinds))
    print(f"({len(items)} held-out questions: " + ", ".join(f"{r[k][2]} {k}" for k in kinds if k != "all") + ")")
    return results


if __name__ == "__main__":
    main()
