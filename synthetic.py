"""
Synthetic workloads for bench.py: each stage's training data of chosen lengths (Synthetic), and a pretraining file
of any size to tokenise (write_pretraining_file), from demo_data.py's text.

SFT conversations come in two length distributions (bench.py's `lengths` key), L the total tokens of a conversation,
chat template included, against max_tokens = max_seq_len + 1:
  uniform    1-3 turns, each message's budget max_tokens x U(1/4, 1) / (2 x turns): L from about max_tokens / 4 to a
             little over max_tokens (data.py cuts those), median ~0.7 x max_tokens. Padding to a batch's longest
             wastes ~27% of a batch of 8.
  lognormal  L ~ lognormal(median LOGNORMAL_MEDIAN x max_tokens, sigma LOGNORMAL_SIGMA), clipped to [the shortest
             conversation the turns allow, max_tokens - 1]: most conversations far shorter than max_seq_len, a long tail
             up to it, as in MiniMind's sft_mini_512.jsonl (conversations under 512 characters, so mostly far under
             512 tokens). The parameters are an assumption of that shape, not fitted to the file.
"""
import json
import math
import random

import demo_data
from token_cache import encode_dpo, encode_sft

LOGNORMAL_MEDIAN = 0.25  # x max_tokens: 128 of 513 for max_seq_len 512
LOGNORMAL_SIGMA = 0.9  # P(L > 2 x median) = 22%; 6% reach max_tokens
MIN_CONTENT = 4  # tokens of each message's content in a lognormal conversation, at least
LENGTHS = ("uniform", "lognormal")


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
        # the chat template's tokens around a conversation of 1, 2, 3 turns (one-token messages: minus 2 per turn)
        self.chat_template = {turns: self.length_of(self.one_token_conversation(turns)) - 2 * turns
                              for turns in (1, 2, 3)}

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

    def skewed_conversation(self, max_tokens: int) -> dict:
        """A conversation of about L tokens in all (lengths="lognormal", see above): 1-3 turns (fewer where L is too
        short for them), the content split evenly between its messages."""
        target = self.rng.lognormvariate(math.log(LOGNORMAL_MEDIAN * max_tokens), LOGNORMAL_SIGMA)
        turns = self.rng.randint(1, 3)
        while turns > 1 and target < self.chat_template[turns] + 2 * turns * MIN_CONTENT:
            turns -= 1
        # max_tokens - 1: data.py counts the closing newline after the last answer (which it then drops) against
        # max_seq_len + 1, and a longer conversation loses its earliest turns
        target = round(min(max_tokens - 1, max(target, self.chat_template[turns] + 2 * turns * MIN_CONTENT)))
        per_message, extra = divmod(target - self.chat_template[turns], 2 * turns)
        budgets = [per_message] * (2 * turns - 1) + [per_message + extra]  # the last answer takes the remainder
        return {"conversations": [{"role": ("user", "assistant")[i % 2], "content": self.text(n)}
                                  for i, n in enumerate(budgets)]}

    def one_token_conversation(self, turns: int) -> dict:
        return {"conversations": [{"role": role, "content": "x"}
                                  for _ in range(turns) for role in ("user", "assistant")]}

    def length_of(self, conversation: dict, max_tokens: int | None = None) -> int:
        """The conversation's tokens as train_sft.py reads them with max_seq_len + 1 = max_tokens (chat template
        included; a longer conversation loses its earliest turns, one whose prompt alone fills it is skipped: 0)."""
        ids_and_mask, _ = encode_sft(self.tok, conversation, max_tokens)
        return 0 if ids_and_mask is None else len(ids_and_mask[0])

    def conversations(self, max_tokens: int, n_items: int, lengths: str) -> list[dict]:
        """At least n_items conversations, and as many as fill n_items packed rows (rows of max_tokens - 1 positions:
        pack=True's batch_size counts rows), so that padded and packed runs read the same file without an epoch
        ending."""
        make = self.skewed_conversation if lengths == "lognormal" else self.conversation
        conversations, positions = [], 0
        while len(conversations) < n_items or positions < n_items * (max_tokens - 1):
            conversations.append(make(max_tokens))
            positions += max(0, self.length_of(conversations[-1], max_tokens) - 1)
        return conversations

    def pair(self, max_prompt: int, max_completion: int) -> dict:
        limits = (max_prompt - self.template[0], max_completion - self.template[1], max_completion - self.template[1])
        lengths = [self.rng.randint(min(8, limit), max(1, limit)) for limit in limits]
        return dict(zip(("prompt", "chosen", "rejected"), map(self.text, lengths)))

    def sum_prompt(self) -> dict:
        """An RL prompt whose answer (reward=answer) is a number: "What is 28 plus 65?", "请计算34+66。"."""
        a, b = self.rng.randint(1, 99), self.rng.randint(1, 99)
        question, _ = demo_data.sum_qa(a, b, self.rng.choice(("en", "zh")), self.rng)
        return {"conversations": [{"role": "user", "content": question}], "answer": str(a + b)}

    def stage_data(self, mode: str, cfg, model_cfg, n_items: int, lengths: str = "uniform") -> list[dict]:
        """n_items training windows / conversations (lengths: their distribution; enough for n_items packed rows
        too) / pairs of the stage's maximum length, or RL prompts."""
        if mode == "train":
            return self.documents(n_items * model_cfg.max_seq_len + model_cfg.max_seq_len)
        if mode == "sft":
            return self.conversations(cfg.max_seq_len + 1, n_items, lengths)
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
