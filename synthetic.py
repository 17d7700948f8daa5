"""
Synthetic workloads for bench.py: each stage's training data of chosen lengths (Synthetic), and a pretraining file
of any size to tokenise (write_pretraining_file), from demo_data.py's text.
"""
import json
import random

import demo_data
from token_cache import encode_dpo


class Synthetic:
    """Demo-style bilingual text (demo_data.py) as pretraining documents, conversations and DPO pairs of
    random lengths up to a limit in tokens, and sums to work out as RL prompts, written as the JSONL the scripts
    read."""

    def __init__(self, tokenizer, seed: int = 1337):
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.ids = tokenizer.encode(" ".join(demo_data.documents(2000, 20, self.rng)))
        # what the chat template adds around a DPO prompt and an answer, in tokens (one-token texts: minus 1)
        prompt, answer, _ = encode_dpo(tokenizer, {"prompt": "x", "chosen": "x", "rejected": "x"})[0]
        self.template = (len(prompt) - 1, len(answer) - 1)

    def text(self, n_tokens: int) -> str:
        """A stretch of the text that encodes to at most n_tokens (a cut stretch can encode to a few more)."""
        start = self.rng.randrange(len(self.ids) - n_tokens)
        for n in range(n_tokens, 0, -1):
            text = self.tok.decode(self.ids[start : start + n]).strip()
            if text and len(self.tok.encode(text)) <= n_tokens:
                return text
        return "…"

    def documents(self, n_tokens: int) -> list[dict]:
        docs, total = [], 0
        while total < n_tokens:
            docs += [{"text": d} for d in demo_data.documents(200, 20, self.rng)]
            total += sum(len(self.tok.encode(d["text"])) + 2 for d in docs[-200:])  # + <s> </s>
        return docs

    def conversation(self, max_tokens: int) -> dict:
        turns = self.rng.randint(1, 3)
        per_message = max(8, self.rng.randint(max_tokens // 4, max_tokens) // (2 * turns) - 6)  # - template
        return {"conversations": [{"role": role, "content": self.text(per_message)}
                                  for _ in range(turns) for role in ("user", "assistant")]}

    def pair(self, max_prompt: int, max_completion: int) -> dict:
        limits = (max_prompt - self.template[0], max_completion - self.template[1], max_completion - self.template[1])
        lengths = [self.rng.randint(min(8, limit), max(1, limit)) for limit in limits]
        return dict(zip(("prompt", "chosen", "rejected"), map(self.text, lengths)))

    def sum_prompt(self) -> dict:
        """An RL prompt whose answer (reward=answer) is a number: "What is 28 plus 65?", "请计算34+66。"."""
        a, b = self.rng.randint(1, 99), self.rng.randint(1, 99)
        question, _ = demo_data.sum_qa(a, b, self.rng.choice(("en", "zh")), self.rng)
        return {"conversations": [{"role": "user", "content": question}], "answer": str(a + b)}

    def stage_data(self, mode: str, cfg, model_cfg, n_items: int) -> list[dict]:
        """n_items training windows / conversations / pairs of the stage's maximum length, or RL prompts."""
        if mode == "train":
            return self.documents(n_items * model_cfg.max_seq_len + model_cfg.max_seq_len)
        if mode == "sft":
            return [self.conversation(cfg.max_seq_len + 1) for _ in range(n_items)]
        if mode == "grpo":
            return [self.sum_prompt() for _ in range(n_items)]
        cfg = cfg.fit_lengths(model_cfg.max_seq_len)  # the prompt and answer lengths the script will use
        return [self.pair(cfg.max_prompt_length, cfg.max_completion_length) for _ in range(n_items)]


def write_pretraining_file(path: str, megabytes: float, rng: random.Random):
    """Demo-style JSONL of about `megabytes`: each record joins 2-10 demo_data documents (~1.7 KB, about the
    size of MiniMind's pretraining records), drawn from a pool so that writing GBs takes seconds, not minutes."""
    pool = demo_data.documents(2000, 20, rng)
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < megabytes * 1e6:
            f.writelines(json.dumps({"text": "\n".join(rng.choices(pool, k=rng.randint(2, 10)))}, ensure_ascii=False)
                         + "\n" for _ in range(5000))
