"""eval.py sft: held-out conversations, the perplexity of their assistant tokens and the model's answers to their
last user turn against the reference (BLEU-4, ROUGE-L F1, exact match)."""
import dataclasses
import math
import re
from collections import Counter

import numpy as np
import torch

from chat import encode_chat
from data import Loader
from engine import Sampling, complete
from errors import BadRecord, ConfigError, DataError
from losses import count_token_bytes, lm_totals
from tasks.common import EvalConfig, cell, load
from token_cache import parse_line


@dataclasses.dataclass
class SFTEvalConfig(EvalConfig):
    # --- data
    data_path: str = "data/sft_val.jsonl"  # SFT format, held out from training; each record ends with the answer
    max_records: int | None = 200  # the first this many records; None: all
    # --- generation
    max_new_tokens: int = 256  # at most, and at most what the context leaves after the prompt
    temperature: float = 0.0  # 0: greedy
    samples: int = 5  # records whose prompt, reference and answer are printed and kept in full


# -----------------------------------------------------------------------------
# BLEU-4 and ROUGE-L

HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U000323af"
WORDS = re.compile(f"[{HAN}]|[^\\W{HAN}]+|[^\\w\\s]")  # a Chinese character | a word | one punctuation mark


def words(text: str) -> list[str]:
    """BLEU's and ROUGE's units: each Chinese character alone, other text by words, each punctuation mark alone."""
    return WORDS.findall(text)


def ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu4(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002), 0-100: the geometric mean of the clipped 1..4-gram precisions over the
    whole corpus, times the brevity penalty exp(1 - r/c) when the answers (c words) are shorter than the
    references (r). One reference per answer, no smoothing: 0 if some n-gram order has no match at all."""
    matches, totals, c, r = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hypotheses, references):
        hyp, ref = words(hyp), words(ref)
        c, r = c + len(hyp), r + len(ref)
        for n in range(1, 5):
            h, g = ngrams(hyp, n), ngrams(ref, n)
            matches[n - 1] += sum(min(k, g[gram]) for gram, k in h.items())
            totals[n - 1] += max(len(hyp) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return 100 * brevity * math.exp(log_precision)


def lcs_length(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)  # row[j]: LCS of a[:i] and b[:j], one row of the table at a time
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004), 0-100: the harmonic mean of LCS / answer length and LCS / reference length."""
    hyp, ref = words(hypothesis), words(reference)
    lcs = lcs_length(hyp, ref)
    return 0.0 if lcs == 0 else 100 * 2 * lcs / (len(hyp) + len(ref))


# -----------------------------------------------------------------------------
# the evaluation

def read_conversations(path: str, limit: int | None) -> list[dict]:
    """The first `limit` SFT records of a JSONL file, each ending with the assistant's (reference) answer."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) == limit:
                break
            try:
                record = parse_line(line.encode())
                if record is None:
                    continue
                messages = record.get("conversations")
                if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                        or messages[-1].get("role") != "assistant":
                    raise BadRecord("'conversations' must be a list of messages ending with the assistant's")
                if not isinstance(messages[-1].get("content"), str):
                    raise BadRecord("the last message, the reference answer, needs a string 'content'")
            except BadRecord as e:
                raise DataError(f"{path}:{lineno}: {e}") from None
            records.append({"line": lineno, "messages": messages, "system": record.get("system")})
    if not records:
        raise DataError(f"{path}: no records")
    return records


def evaluate(cfg: SFTEvalConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
    model, tokenizer, state, run = load(cfg)
    T = model.config.max_seq_len
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"config key 'max_new_tokens' must be at least 1, got {cfg.max_new_tokens}")
    records = read_conversations(cfg.data_path, cfg.max_records)
    encoded = []  # (ids, loss_mask) of whole conversations: the perplexity, as training computes the loss
    prompts, references = [], []
    for r in records:
        try:
            ids, mask = encode_chat(tokenizer, r["messages"], r["system"], max_len=T + 1)
            prompt, _ = encode_chat(tokenizer, r["messages"][:-1], r["system"], max_len=T - 1)  # room for 1 token
        except BadRecord as e:
            raise DataError(f"{cfg.data_path}:{r['line']}: {e}") from None
        encoded.append((np.array(ids), np.array(mask)))
        prompts.append(prompt)
        references.append(r["messages"][-1]["content"].strip())
    loader = Loader([(row,) for row in encoded], cfg.batch_size, tokenizer.pad_id, run.device)
    totals = lm_totals(model, loader.batches(len(encoded)), count_token_bytes(tokenizer), run)
    sampling = Sampling(cfg.temperature, generator=torch.Generator(run.device).manual_seed(cfg.seed))
    with run.autocast():
        answers = complete(model, tokenizer, prompts, cfg.max_new_tokens, sampling, cfg.batch_size)

    result = {"data_path": cfg.data_path, "records": len(records), "answer_tokens": totals["tokens"],
              "ppl": totals["ppl"], "loss": totals["loss"], "bpb": totals["bpb"],
              "bleu4": bleu4(answers, references),
              "rougeL_f1": sum(map(rouge_l, answers, references)) / len(records),
              "exact_match": sum(a == ref for a, ref in zip(answers, references)) / len(records),
              "generation": {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens},
              "samples": [{"line": r["line"], "prompt": r["messages"][:-1], "system": r["system"], "reference": ref,
                           "answer": a} for r, ref, a in list(zip(records, references, answers))[: cfg.samples]]}
    for i, s in enumerate(result["samples"], 1):
        print(f"--- sample {i} ({cfg.data_path}:{s['line']})\nprompt:    {s['prompt'][-1]['content']}\n"
              f"reference: {s['reference']}\nanswer:    {s['answer']}")
    how = "greedy" if cfg.temperature == 0 else f"temperature {cfg.temperature}"
    print(f"{cfg.data_path}, {len(records)} conversations: ppl {totals['ppl']:.3f} on {totals['tokens']:,} assistant "
          f"tokens (bpb {totals['bpb']:.4f}) | {how} answers: BLEU-4 {result['bleu4']:.2f} | "
          f"ROUGE-L F1 {result['rougeL_f1']:.2f} | exact match {result['exact_match']:.1%}")
    return result, state


def render(s: dict) -> list[str]:
    g = s["generation"]
    how = "greedy" if g["temperature"] == 0 else f"temperature {g['temperature']}"
    md = ["## SFT evaluation", "", f"On the first {s['records']} conversations of `{s['data_path']}`; answers {how}, "
          f"at most {g['max_new_tokens']} new tokens, to the last user turn, against the reference answer.", "",
          "| metric | value |", "|---|---:|",
          f"| perplexity of the {s['answer_tokens']:,} assistant tokens | {s['ppl']:.3f} |",
          f"| bits per byte of those tokens | {s['bpb']:.4f} |",
          f"| BLEU-4 (corpus, 0-100) | {s['bleu4']:.2f} |", f"| ROUGE-L F1 (mean, 0-100) | {s['rougeL_f1']:.2f} |",
          f"| exact match | {s['exact_match']:.1%} |", "",
          "BLEU and ROUGE count each Chinese character as a word, and split other text into words and punctuation.",
          f"The first {len(s['samples'])} conversations (# = line), in full:", ""]
    md += ["| # | prompt | reference | answer |", "|---|---|---|---|"]
    for x in s["samples"]:
        prompt = "<br>".join(f"*{m['role']}:* {cell(m.get('content') or '')}" for m in x["prompt"])  # null: a call
        md.append(f"| {x['line']} | {prompt} | {cell(x['reference'])} | {cell(x['answer'])} |")
    return md
