"""
How good is a checkpoint? Six evaluations; each prints its figures and adds them to a report.

    python eval.py bpb --ckpt=out/pretrain/best.pt --data_path=data/pretrain_val.jsonl
    python eval.py sft --ckpt=out/sft/best.pt --data_path=data/sft_val.jsonl --max_records=200
    python eval.py choice --ckpt=out/sft/best.pt --task=ceval --data_dir=data/ceval-exam --shots=5
    python eval.py pairs --ckpt=out/reward/best.pt --data_path=data/dpo_eval.jsonl
    python eval.py pass --ckpt=out/grpo/best.pt --data_path=data/rl_val.jsonl --k=8
    python eval.py toolcall --ckpt=out/sft/best.pt --data_path=data/tool_eval.jsonl --tools=builtin
    python eval.py sft --help                                # every key of a sub-command, its default and meaning

bpb     bits per byte of a pretraining-format file: the summed cross-entropy in bits over the UTF-8 bytes of the
        scored tokens (special tokens count 0 bytes), so models with different tokenizers compare.
sft     held-out conversations: perplexity of the assistant tokens (the training loss), the model's answer to each
        last user turn scored against the reference (BLEU-4, ROUGE-L F1, exact match), samples kept in full.
choice  multiple-choice accuracy on C-Eval, CMMLU, MMLU or ARC files as their projects distribute them.
pairs   a reward model (train_reward.py) on preference pairs: how often the chosen answer scores higher.
pass    RL prompts with reference answers (train_grpo.py's): pass@1 of greedy answers, pass@1 and pass@k of k
        sampled ones (the final answer, its last number when the reference is one, equal to the reference).
toolcall conversations with tools offered, answered greedily with the calls run between turns: the final answer
        against the reference, how many conversations call, how many calls are well-formed and fit the tools
        offered, turns taken, conversations left unfinished.

BLEU and ROUGE count Chinese characters one by one and other text word by word, punctuation split off.
Each run writes report.json and report.md into the checkpoint's directory (or --out): its figures, the sections
other sub-commands wrote there for the same checkpoint, the checkpoint's config, a training summary from its
metrics.jsonl and links to plot.py's pictures.
"""
import csv
import dataclasses
import glob
import json
import math
import os
import re
from collections import Counter

import numpy as np
import torch

from chat import chatml_messages, encode_chat
from checkpoint import checkpoint_tokenizer, load_model
from config import check_device_and_dtype, load_config
from data import Loader, PretrainData, pad_rows, read_prompts
from engine import GREEDY, Sampling, complete
from errors import BadRecord, ConfigError, DataError, cli
from grpo import completion_texts, prompt_seed, rollout
from losses import count_token_bytes, lm_totals, sequence_logprobs
from fileio import atomic_write
from metrics import read_metrics
from rewards import answer_reward, reference
from reward_model import bradley_terry_loss, reward_model_from_checkpoint, score_ids
from runtime import setup
from token_cache import parse_line, tokenize_file
from tools import call_problem, check_tools, converse, load_toolbox, parse_reply, written_calls


@dataclasses.dataclass
class EvalConfig:
    # --- I/O
    ckpt: str = "out/sft/best.pt"  # a checkpoint written by train_pretrain/sft/dpo.py
    out: str | None = None  # where report.md and report.json go; None: the checkpoint's directory
    plots: str | None = None  # a directory of plot.py's pictures for the report to link; None: the checkpoint's
    tokenizer_path: str | None = None  # None: the one the checkpoint was trained with (another one is refused)
    # --- system
    batch_size: int = 16  # sequences per forward pass
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (what the device runs well: float32 on a CPU) | float32 | bfloat16 | float16
    seed: int = 1337  # sampling with temperature > 0

    def __post_init__(self):
        check_device_and_dtype(self.device, self.dtype)
        if self.batch_size < 1:
            raise ConfigError(f"config key 'batch_size' must be at least 1, got {self.batch_size}")


@dataclasses.dataclass
class BpbConfig(EvalConfig):
    # --- data
    data_path: str = "data/pretrain_val.jsonl"  # pretraining format: JSONL {"text"} or .txt; a glob / comma list
    max_windows: int | None = None  # windows of the model's max_seq_len + 1 tokens to score; None: all


@dataclasses.dataclass
class SFTConfig(EvalConfig):
    # --- data
    data_path: str = "data/sft_val.jsonl"  # SFT format, held out from training; each record ends with the answer
    max_records: int | None = 200  # the first this many records; None: all
    # --- generation
    max_new_tokens: int = 256  # at most, and at most what the context leaves after the prompt
    temperature: float = 0.0  # 0: greedy
    samples: int = 5  # records whose prompt, reference and answer are printed and kept in full


@dataclasses.dataclass
class ChoiceConfig(EvalConfig):
    # --- data
    task: str = "ceval"  # ceval | cmmlu | mmlu | arc
    data_dir: str = "data/ceval-exam"  # the unpacked files, as their project distributes them
    split: str = "val"  # ceval: val | dev; cmmlu: test | dev; mmlu: val | test | dev; arc: val | test | train
    shots: int = 0  # 0-5 solved questions of the same subject (from dev; ARC: train) before each question
    max_questions: int | None = None  # per subject; None: all
    # --- method
    method: str = "text"  # text: log-prob of each option's text (acc, acc_norm); letter: of its letter, chat template

    def __post_init__(self):
        super().__post_init__()
        if self.task not in TASKS:
            raise ConfigError(f"config key 'task' must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.method not in ("text", "letter"):
            raise ConfigError(f"config key 'method' must be text or letter, got {self.method!r}")
        if not 0 <= self.shots <= 5:
            raise ConfigError(f"config key 'shots' must be 0 to 5, got {self.shots}")


# -----------------------------------------------------------------------------
# the checkpoint and its tokenizer

def load(cfg: EvalConfig):
    """(eval-mode model, its tokenizer, the checkpoint's state, Run)."""
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model, tokenizer, state = load_model(cfg.ckpt, run.device, cfg.tokenizer_path)
    return model, tokenizer, state, run


# -----------------------------------------------------------------------------
# bpb

def eval_bpb(cfg: BpbConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state); so for eval_sft and eval_choice."""
    model, tokenizer, state, run = load(cfg)
    T = model.config.max_seq_len
    data = PretrainData(tokenize_file(cfg.data_path, tokenizer, "pretrain"), T)
    if len(data) == 0:
        raise DataError(f"{cfg.data_path}: fewer than the {T + 1} tokens of one window")
    windows = [data[i] for i in range(min(len(data), cfg.max_windows or len(data)))]  # memory-mapped views
    loader = Loader(windows, cfg.batch_size, tokenizer.pad_id, run.device)
    totals = lm_totals(model, loader.batches(len(windows)), count_token_bytes(tokenizer), run)
    result = {"data_path": cfg.data_path, "windows": len(windows), "window_tokens": T} | totals
    print(f"{cfg.data_path}: bpb {totals['bpb']:.4f} | loss {totals['loss']:.4f} | ppl {totals['ppl']:.2f} "
          f"({result['windows']:,} windows of {T} tokens: {totals['tokens']:,} tokens, {totals['bytes']:,} bytes)")
    return result, state


# -----------------------------------------------------------------------------
# sft: perplexity, BLEU-4, ROUGE-L, samples

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
            except BadRecord as e:
                raise DataError(f"{path}:{lineno}: {e}") from None
            records.append({"line": lineno, "messages": messages, "system": record.get("system")})
    if not records:
        raise DataError(f"{path}: no records")
    return records


def eval_sft(cfg: SFTConfig) -> tuple[dict, dict]:
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


# -----------------------------------------------------------------------------
# choice: multiple-choice benchmarks from local files

@dataclasses.dataclass
class Question:
    question: str
    options: list[str]
    answer: int  # index into options


LETTERS = "ABCDE"
TASKS = {  # task: (where its files come from, the language of its prompts)
    "ceval": ("https://huggingface.co/datasets/ceval/ceval-exam (ceval-exam.zip: val/, dev/, test/)", "zh"),
    "cmmlu": ("https://huggingface.co/datasets/haonan-li/cmmlu (cmmlu_v1_0_1.zip: dev/, test/)", "zh"),
    "mmlu": ("https://people.eecs.berkeley.edu/~hendrycks/data.tar (its data/ folder: dev/, val/, test/)", "en"),
    "arc": ("https://ai2-public-datasets.s3.amazonaws.com/arc/ARC-V1-Feb2018.zip (ARC-Easy/, ARC-Challenge/)", "en"),
}
ARC_SPLITS = {"train": "Train", "val": "Dev", "dev": "Dev", "test": "Test"}


def subject_files(task: str, data_dir: str, split: str) -> dict[str, str]:
    """{subject: file} of a split as the task's project lays it out."""
    if task == "arc":
        pattern = os.path.join(data_dir, "**", f"ARC-*-{ARC_SPLITS.get(split, split)}.jsonl")
        files = glob.glob(pattern, recursive=True)
        name = lambda path: os.path.basename(path).rsplit("-", 1)[0]  # noqa: E731  ARC-Challenge, ARC-Easy
    else:
        suffix = ".csv" if task == "cmmlu" else f"_{split}.csv"
        pattern = os.path.join(data_dir, split, f"*{suffix}")
        files = glob.glob(pattern)
        name = lambda path: os.path.basename(path)[: -len(suffix)]  # noqa: E731
    if not files:
        raise FileNotFoundError(f"no {task} files match {pattern}: download them from {TASKS[task][0]} and unpack "
                                f"them into data_dir (nothing is downloaded for you)")
    return {name(path): path for path in sorted(files)}


def read_questions(task: str, path: str) -> list[Question]:
    """A file's questions; DataError names the file, line and column of anything malformed."""
    questions = []
    with open(path, encoding="utf-8", newline="") as f:
        if task == "arc":
            for lineno, line in enumerate(f, 1):
                try:
                    record = parse_line(line.encode())
                    if record is None:
                        continue
                    choices = record["question"]["choices"]
                    labels = [c["label"] for c in choices]
                    questions.append(Question(record["question"]["stem"], [c["text"] for c in choices],
                                              labels.index(record["answerKey"])))
                except (BadRecord, KeyError, TypeError, ValueError) as e:
                    raise DataError(f"{path}:{lineno}: not an ARC question ({type(e).__name__}: {e})") from None
            return questions
        rows = csv.reader(f)
        if task == "mmlu":  # no header: question, A, B, C, D, answer
            columns = [0, 1, 2, 3, 4, 5]
        else:
            header = next(rows, [])
            names = ["question", "A", "B", "C", "D", "answer"]
            names = names if task == "ceval" else [n.capitalize() for n in names]  # CMMLU's
            missing = [n for n in names if n not in header]
            if missing:
                raise DataError(f"{path}: no column {missing[0]!r} in the header {header} ({task}'s are {names})")
            columns = [header.index(n) for n in names]
        for row in rows:
            where = f"{path}:{rows.line_num}"
            if len(row) <= max(columns):
                raise DataError(f"{where}: {len(row)} columns, expected at least {max(columns) + 1}")
            question, *options, answer = (row[c] for c in columns)
            if answer.strip() not in ("A", "B", "C", "D"):
                hint = " (C-Eval's test answers are not public: use --split=val)" if not answer.strip() else ""
                raise DataError(f"{where}: answer {answer!r} is not one of A, B, C, D{hint}")
            questions.append(Question(question, options, LETTERS.index(answer.strip())))
    return questions


def load_task(cfg: ChoiceConfig) -> dict[str, tuple[list[Question], list[Question]]]:
    """{subject: (questions, solved examples for the shots)}."""
    shots_split = "train" if cfg.task == "arc" else "dev"
    if not os.path.isdir(cfg.data_dir):
        raise FileNotFoundError(f"data_dir {cfg.data_dir} does not exist: download the {cfg.task} files from "
                                f"{TASKS[cfg.task][0]} and unpack them there (nothing is downloaded for you)")
    examples = subject_files(cfg.task, cfg.data_dir, shots_split) if cfg.shots else {}
    tasks = {}
    for subject, path in subject_files(cfg.task, cfg.data_dir, cfg.split).items():
        if cfg.shots and subject not in examples:
            raise FileNotFoundError(f"{path}: no {shots_split} file of subject {subject!r} for --shots={cfg.shots}")
        shots = read_questions(cfg.task, examples[subject])[: cfg.shots] if cfg.shots else []
        tasks[subject] = (read_questions(cfg.task, path)[: cfg.max_questions], shots)
    return tasks


def text_rows(tokenizer, q: Question, shots: list[Question], lang: str) -> list[tuple[list[int], list[int]]]:
    """method=text: one row per option, <s> + the solved examples + the question + the option's text, scored on
    the option's tokens (as lm-evaluation-harness scores a continuation)."""
    ask, answer, space = ("问题：", "\n答案：", "") if lang == "zh" else ("Question: ", "\nAnswer:", " ")
    context = "".join(f"{ask}{s.question}{answer}{space}{s.options[s.answer]}\n\n" for s in shots)
    context_ids = [tokenizer.bos_id] + tokenizer.encode(f"{context}{ask}{q.question}{answer}")
    rows = []
    for option in q.options:
        option_ids = tokenizer.encode(f"{space}{option}")
        rows.append((context_ids + option_ids, [0] * len(context_ids) + [1] * len(option_ids)))
    return rows


def letter_rows(tokenizer, q: Question, shots: list[Question], lang: str) -> list[tuple[list[int], list[int]]]:
    """method=letter: one row per option letter, the question and its lettered options as the user's turn in the
    chat template (the solved examples as earlier turns), scored on the assistant's answer: the letter and its end
    of turn."""
    instruction = "请直接回答选项字母。" if lang == "zh" else "Answer with the option's letter."

    def ask(x: Question) -> str:
        return "\n".join([x.question] + [f"{LETTERS[i]}. {o}" for i, o in enumerate(x.options)] + [instruction])

    history = [m for s in shots for m in ({"role": "user", "content": ask(s)},
                                          {"role": "assistant", "content": LETTERS[s.answer]})]
    return [encode_chat(tokenizer, history + [{"role": "user", "content": ask(q)},
                                              {"role": "assistant", "content": LETTERS[i]}])
            for i in range(len(q.options))]


def model_scorer(model, tokenizer, batch_size: int, run):
    """rows [(ids, loss_mask)] -> the summed log-probability of each row's masked tokens. A row longer than the
    context loses its beginning."""
    T = model.config.max_seq_len

    @torch.no_grad()
    def score(rows: list[tuple[list[int], list[int]]]) -> list[float]:
        rows = [(np.array(ids[-(T + 1):]), np.array(mask[-(T + 1):])) for ids, mask in rows]
        out = []
        for i in range(0, len(rows), batch_size):
            X, Y, M = (t.to(run.device) for t in pad_rows(rows[i : i + batch_size], tokenizer.pad_id))
            with run.autocast():
                out += sequence_logprobs(model, X, Y, M, length_norm=False).float().tolist()
        return out

    return score


def eval_choice_questions(tasks, score, tokenizer, method: str, lang: str) -> dict:
    """{subject: {n, acc, acc_norm, chance}, ..., "overall": the same over all questions}. score(rows) -> the
    log-probability of each row's scored tokens; acc picks the highest, acc_norm the highest per character of the
    option's text (method=text only: letters are one character each)."""
    make_rows = text_rows if method == "text" else letter_rows
    results, hits = {}, []
    for subject, (questions, shots) in tasks.items():
        correct = []  # (acc, acc_norm, chance) per question
        for q in questions:
            logps = score(make_rows(tokenizer, q, shots, lang))
            per_char = [lp / max(len(o), 1) for lp, o in zip(logps, q.options)]
            correct.append((int(np.argmax(logps)) == q.answer, int(np.argmax(per_char)) == q.answer,
                            1 / len(q.options)))
        results[subject] = summarise(correct, method)
        hits += correct
    results["overall"] = summarise(hits, method)
    return results


def summarise(correct: list[tuple[bool, bool, float]], method: str) -> dict:
    n = max(len(correct), 1)
    return {"n": len(correct), "acc": sum(c[0] for c in correct) / n,
            "acc_norm": sum(c[1] for c in correct) / n if method == "text" else None,
            "chance": sum(c[2] for c in correct) / n}


def eval_choice(cfg: ChoiceConfig) -> tuple[dict, dict]:
    tasks = load_task(cfg)  # before the model: a missing file fails fast
    model, tokenizer, state, run = load(cfg)
    if cfg.method == "letter" and state["stage"] == "pretrain":
        raise ConfigError(f"method=letter asks in the chat template: {cfg.ckpt} is a pretraining checkpoint (use text)")
    lang = TASKS[cfg.task][1]
    results = eval_choice_questions(tasks, model_scorer(model, tokenizer, cfg.batch_size, run), tokenizer,
                                    cfg.method, lang)
    print(f"{cfg.task} {cfg.split} ({cfg.data_dir}), {cfg.shots}-shot, scored by the option's "
          f"{'text' if cfg.method == 'text' else 'letter in the chat template'}:\n{choice_table(results)}")
    return {"task": cfg.task, "data_dir": cfg.data_dir, "split": cfg.split, "shots": cfg.shots, "method": cfg.method,
            "subjects": results}, state


def choice_table(results: dict) -> str:
    width = max(len(s) for s in results) + 2
    lines = [f"{'subject':<{width}}{'N':>6}{'acc':>9}{'acc_norm':>10}{'chance':>9}"]
    for subject, r in results.items():
        norm = f"{r['acc_norm']:>10.1%}" if r["acc_norm"] is not None else f"{'-':>10}"
        lines.append(f"{subject:<{width}}{r['n']:>6}{r['acc']:>9.1%}{norm}{r['chance']:>9.1%}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# pass: how often a completion's final answer is the reference (RL's prompts, reward=answer)

@dataclasses.dataclass
class PassConfig(EvalConfig):
    # --- data
    data_path: str = "data/rl_val.jsonl"  # train_grpo.py's prompts: {"conversations", "answer" or "gt"}, held out
    max_records: int | None = None  # the first this many prompts; None: all
    # --- generation
    k: int = 8  # sampled completions per prompt: pass@1 and pass@k are estimated from them
    temperature: float = 1.0  # of the sampled completions (pass@1 greedy is also reported)
    max_new_tokens: int = 256
    samples: int = 5  # prompts whose greedy answer is kept in full

    def __post_init__(self):
        super().__post_init__()
        if self.k < 1 or self.max_new_tokens < 1 or self.temperature <= 0:
            raise ConfigError(f"config keys 'k' and 'max_new_tokens' must be at least 1 and 'temperature' above 0, got "
                              f"{self.k}, {self.max_new_tokens}, {self.temperature}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k completions drawn from n, c of them right, is right (Chen et al. 2021's
    unbiased estimator): 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_pass(cfg: PassConfig) -> tuple[dict, dict]:
    model, tokenizer, state, run = load(cfg)
    prompts = read_prompts(cfg.data_path, tokenizer, model.config.max_seq_len - cfg.max_new_tokens,
                           need_reference=True, verbose=False)[: cfg.max_records]
    greedy, correct = [], []  # greedy: (text, right?) per prompt; correct: right sampled completions per prompt
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        ids, seeds = [p.ids for p in chunk], [prompt_seed(cfg.seed, 0, start + i) for i in range(len(chunk))]
        with run.autocast():
            rows = rollout(model, ids, None, 1, cfg.max_new_tokens, tokenizer.eos_id)
            sampled = rollout(model, ids, seeds, cfg.k, cfg.max_new_tokens, tokenizer.eos_id, cfg.temperature)
        texts = completion_texts(tokenizer, sampled)
        for i, (p, text) in enumerate(zip(chunk, completion_texts(tokenizer, rows))):
            greedy.append((text, answer_reward(text, reference(p.record))))
            correct.append(sum(answer_reward(t, reference(p.record)) for t in texts[i * cfg.k : (i + 1) * cfg.k]))
    n = len(prompts)
    result = {"data_path": cfg.data_path, "prompts": n, "k": cfg.k, "temperature": cfg.temperature,
              "max_new_tokens": cfg.max_new_tokens, "greedy_pass1": sum(right for _, right in greedy) / n,
              "pass1": sum(pass_at_k(cfg.k, int(c), 1) for c in correct) / n,
              "passk": sum(pass_at_k(cfg.k, int(c), cfg.k) for c in correct) / n,
              "samples": [{"line": p.where.rsplit(":", 1)[1], "prompt": p.messages[-1]["content"],
                           "reference": reference(p.record), "answer": text}
                          for p, (text, _) in list(zip(prompts, greedy))[: cfg.samples]]}
    print(f"{cfg.data_path}, {n} prompts: pass@1 greedy {result['greedy_pass1']:.1%} | sampled at temperature "
          f"{cfg.temperature}: pass@1 {result['pass1']:.1%}, pass@{cfg.k} {result['passk']:.1%}")
    return result, state


def render_pass(s: dict) -> list[str]:
    md = ["## Final answers (pass@k)", "", f"On the {s['prompts']} prompts of `{s['data_path']}`: does the completion's "
          f"final answer (its last number, when the reference is one) equal the reference? At most "
          f"{s['max_new_tokens']} new tokens; {s['k']} sampled completions per prompt at temperature {s['temperature']}.",
          "", "| metric | value |", "|---|---:|", f"| pass@1, greedy | {s['greedy_pass1']:.1%} |",
          f"| pass@1, sampled | {s['pass1']:.1%} |", f"| pass@{s['k']}, sampled | {s['passk']:.1%} |", "",
          "| # | prompt | reference | greedy answer |", "|---|---|---|---|"]
    return md + [f"| {x['line']} | {cell(x['prompt'])} | {cell(x['reference'])} | {cell(x['answer'])} |"
                 for x in s["samples"]]


# -----------------------------------------------------------------------------
# pairs: how often a reward model (train_reward.py) scores a pair's chosen answer above its rejected one

@dataclasses.dataclass
class PairsConfig(EvalConfig):
    # --- I/O
    ckpt: str = "out/reward/best.pt"  # a reward model, written by train_reward.py
    # --- data
    data_path: str = "data/dpo_eval.jsonl"  # preference pairs as train_dpo.py reads them, held out from training
    max_records: int | None = None  # the first this many pairs; None: all


def eval_pairs(cfg: PairsConfig) -> tuple[dict, dict]:
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model, state = reward_model_from_checkpoint(cfg.ckpt, run.device)
    tokenizer = checkpoint_tokenizer(state, cfg.tokenizer_path)
    lengths = {k: state["config"][k] for k in ("max_prompt_length", "max_completion_length")}
    records = tokenize_file(cfg.data_path, tokenizer, "dpo", **lengths)  # rendered and cut as in training
    pairs = [records[i] for i in range(min(len(records), cfg.max_records or len(records)))]
    if not pairs:
        raise DataError(f"{cfg.data_path}: no pairs")
    chosen = [np.concatenate([prompt, answer]).tolist() for prompt, answer, _ in pairs]
    rejected = [np.concatenate([prompt, answer]).tolist() for prompt, _, answer in pairs]
    with run.autocast():
        rewards = torch.tensor(score_ids(model.eval(), chosen + rejected, tokenizer.pad_id, cfg.batch_size))
    loss, metrics = bradley_terry_loss(*rewards.view(2, -1))
    result = {"data_path": cfg.data_path, "pairs": len(pairs), "loss": loss.item()} | \
        {k: v.item() for k, v in metrics.items()}
    print(f"{cfg.data_path}, {len(pairs)} pairs: the chosen answer scores higher in {result['pair_acc']:.1%} | mean "
          f"margin {result['reward_margin']:.3f} | Bradley-Terry loss {result['loss']:.4f}")
    return result, state


def render_pairs(s: dict) -> list[str]:
    return ["## Preference pairs", "", f"The reward model scores the chosen answer above the rejected one in "
            f"**{s['pair_acc']:.1%}** of the {s['pairs']} pairs of `{s['data_path']}`.", "",
            "| metric | value |", "|---|---:|", f"| pair accuracy | {s['pair_acc']:.1%} |",
            f"| mean margin, r_chosen - r_rejected | {s['reward_margin']:.3f} |",
            f"| mean reward, chosen / rejected | {s['chosen_reward']:.3f} / {s['rejected_reward']:.3f} |",
            f"| Bradley-Terry loss, -log sigmoid(margin) | {s['loss']:.4f} |"]


# -----------------------------------------------------------------------------
# toolcall: conversations with tools offered, answered with the calls run between turns (tools.converse)

@dataclasses.dataclass
class ToolCallConfig(EvalConfig):
    # --- data
    data_path: str = "data/tool_eval.jsonl"  # {"conversations": [system with "tools", user], "gt" or "answer"}
    max_records: int | None = None  # the first this many records; None: all
    tools: str = "builtin"  # what runs the calls: builtin, built-in names, or a file.py / module of your functions
    # --- generation (greedy)
    max_turns: int = 3  # model turns per conversation, at most (calls, their results, ..., the answer)
    max_new_tokens: int = 64  # per turn
    samples: int = 5  # conversations kept in full, every turn

    def __post_init__(self):
        super().__post_init__()
        if self.max_turns < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"config keys 'max_turns' and 'max_new_tokens' must be at least 1, got {self.max_turns}"
                              f" and {self.max_new_tokens}")


def offered_functions(p, toolbox, spec: str) -> dict[str, dict]:
    """The functions a record offers ({name: description}), each one the toolbox can run; and a list gt that holds
    something to look for."""
    _, tools = chatml_messages(p.messages)
    functions = check_tools(tools or [], f"{p.where}: tools")
    missing = [name for name in functions if name not in toolbox.functions]
    if missing:
        raise DataError(f"{p.where}: the record offers the tool {missing[0]!r}, which --tools={spec} cannot run "
                        f"(it has {', '.join(toolbox.functions)}); pass --tools=a file.py or module defining it")
    expected = p.record.get("answer", p.record.get("gt"))
    if isinstance(expected, list) and (not expected or not all(isinstance(x, (str, int, float)) for x in expected)):
        raise DataError(f"{p.where}: a list 'gt' must hold at least one string or number to find in the answer")
    return functions


def answer_right(answer: str, record: dict) -> bool:
    """The final answer against the record's reference (rewards.answer_reward); a list (MiniMind's gt) only when
    every item is in it -- a number among its numbers, by value; text, ignoring case."""
    return answer_reward(answer, reference(record)) == 1.0


def conversation_score(p, t, functions: dict[str, dict]) -> dict:
    """One trajectory's figures: every call it wrote (run or not: the last turn's are not), how many fit the
    functions offered, and whether it answered right."""
    calls, _ = written_calls(t.messages[len(p.messages):], t.text)  # the blocks that were not: t.malformed
    return {"calls": len(calls), "fitting": sum(call_problem(c, functions) is None for c in calls),
            "right": t.finish_reason == "stop" and answer_right(parse_reply(t.text).content, p.record)}


def steps_of(p, t) -> list[list[str]]:
    """A trajectory for a person: [kind, text] for each thing said after the prompt, the last turn last."""
    steps = []
    for m in t.messages[len(p.messages):]:
        if m["role"] == "tool":
            steps.append(["result", m["content"]])
            continue
        steps += [["assistant", m["content"]]] if m.get("content") else []
        steps += [["call", f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})"] for c in m["tool_calls"]]
    return steps + [["answer" if t.finish_reason == "stop" else f"last turn ({t.finish_reason})", t.text]]


def eval_toolcall(cfg: ToolCallConfig) -> tuple[dict, dict]:
    model, tokenizer, state, run = load(cfg)
    T = model.config.max_seq_len
    if tokenizer.chat_template != "chatml":
        raise ConfigError(f"{cfg.ckpt}: its tokenizer's {tokenizer.chat_template} chat template cannot show tools; "
                          "toolcall needs a checkpoint with MiniMind's ChatML one")
    if cfg.max_new_tokens >= T:
        raise ConfigError(f"config key 'max_new_tokens' must be below the model's max_seq_len ({T}), got "
                          f"{cfg.max_new_tokens}")
    toolbox = load_toolbox(cfg.tools)
    prompts = read_prompts(cfg.data_path, tokenizer, T - cfg.max_new_tokens, need_reference=True,
                           verbose=False)[: cfg.max_records]
    functions = [offered_functions(p, toolbox, cfg.tools) for p in prompts]
    trajectories = []
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = [(p.ids, p.messages, GREEDY) for p in prompts[start : start + cfg.batch_size]]
        with run.autocast():
            trajectories += converse(model, tokenizer, chunk, toolbox, cfg.max_turns, cfg.max_new_tokens)
    scores = [conversation_score(p, t, f) for p, t, f in zip(prompts, trajectories, functions)]
    n, calls, malformed = len(prompts), sum(s["calls"] for s in scores), sum(t.malformed for t in trajectories)
    result = {"data_path": cfg.data_path, "records": n, "tools": cfg.tools, "max_turns": cfg.max_turns,
              "max_new_tokens": cfg.max_new_tokens, "answer_acc": sum(s["right"] for s in scores) / n,
              "called": sum(s["calls"] > 0 for s in scores) / n, "calls": calls, "malformed": malformed,
              "call_fit": sum(s["fitting"] for s in scores) / (calls + malformed) if calls + malformed else None,
              "mean_turns": sum(t.turns for t in trajectories) / n,
              "unfinished": sum(t.finish_reason != "stop" for t in trajectories) / n,
              "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
              "samples": [{"line": p.where.rsplit(":", 1)[1], "prompt": p.messages[-1]["content"],
                           "reference": p.record.get("answer", p.record.get("gt")), "steps": steps_of(p, t),
                           "right": s["right"]}
                          for p, t, s in list(zip(prompts, trajectories, scores))[: cfg.samples]]}
    for i, x in enumerate(result["samples"], 1):
        print(f"--- sample {i} ({cfg.data_path}:{x['line']}, {'right' if x['right'] else 'wrong'})\n"
              f"prompt:    {x['prompt']}\nreference: {reference_text(x['reference'])}")
        print("\n".join(f"{kind + ':':<10} {text}" for kind, text in x["steps"]))
    fit = f"{result['call_fit']:.1%}" if result["call_fit"] is not None else "-"
    print(f"{cfg.data_path}, {n} conversations: answers right {result['answer_acc']:.1%} | called a tool "
          f"{result['called']:.1%} | calls that fit {fit} of {calls + malformed} | mean turns "
          f"{result['mean_turns']:.2f} | unfinished {result['unfinished']:.1%}")
    return result, state


def render_toolcall(s: dict) -> list[str]:
    fit = f"{s['call_fit']:.1%}" if s["call_fit"] is not None else "-"
    md = ["## Tool calling", "", f"On the {s['records']} conversations of `{s['data_path']}`, answered greedily with "
          f"the tools offered, each call run by `--tools={s['tools']}` and its result read back; at most "
          f"{s['max_turns']} turns of at most {s['max_new_tokens']} new tokens.", "", "| metric | value |", "|---|---:|",
          f"| answers right (final answer against the reference) | {s['answer_acc']:.1%} |",
          f"| conversations with at least one call | {s['called']:.1%} |",
          f"| calls well-formed and fitting the tools offered ({s['calls'] + s['malformed']} `<tool_call>` blocks, "
          f"{s['malformed']} malformed) | {fit} |", f"| mean turns | {s['mean_turns']:.2f} |",
          f"| unfinished (out of turns or tokens) | {s['unfinished']:.1%} |", "",
          f"The first {len(s['samples'])} conversations (# = line), every turn:", "",
          "| # | prompt | reference | turns | right |", "|---|---|---|---|---|"]
    shown = lambda text: cell(text.replace("&", "&amp;").replace("<", "&lt;"))  # noqa: E731  <tool_call> shows
    for x in s["samples"]:
        steps = "<br>".join(f"*{kind}:* {shown(text)}" for kind, text in x["steps"])
        md.append(f"| {x['line']} | {shown(x['prompt'])} | {shown(reference_text(x['reference']))} | {steps} | "
                  f"{'yes' if x['right'] else 'no'} |")
    return md


def reference_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# -----------------------------------------------------------------------------
# the report: report.json (every figure) and report.md (for a person), beside the checkpoint

def training_summary(state: dict, metrics_path: str) -> dict:
    """Steps, data seen, wall time and validation losses of the run that wrote the checkpoint."""
    cfg, stage, step = state["config"], state["stage"], state["step"]
    ranks = len(state.get("rng", [None]))  # one RNG state per rank
    per_step = cfg["batch_size"] * cfg["accum_steps"] * ranks
    seen = ({"tokens": step * per_step * state["model_config"]["max_seq_len"]} if stage == "pretrain"
            else {{"dpo": "pairs", "reward": "pairs", "grpo": "prompts"}.get(stage, "conversations"): step * per_step})
    summary = {"stage": stage, "checkpoint_step": step, "ranks": ranks} | seen
    if not os.path.exists(metrics_path):
        return summary | {"metrics": f"no {metrics_path}"}
    rows = read_metrics(metrics_path)
    val = [r for r in rows if "val_loss" in r]
    wall, last = 0.0, 0.0  # elapsed_s restarts at a resume: add up the stretches
    for r in rows:
        if "elapsed_s" in r:
            wall += r["elapsed_s"] - last if r["elapsed_s"] >= last else r["elapsed_s"]
            last = r["elapsed_s"]
    summary |= {"steps": max((r["step"] for r in rows), default=0), "wall_time_s": round(wall, 1)}
    if val:
        best = min(val, key=lambda r: r["val_loss"])
        summary |= {"final_val_loss": val[-1]["val_loss"], "final_val_step": val[-1]["step"],
                    "best_val_loss": best["val_loss"], "best_val_step": best["step"]}
        if "val_bpb" in val[-1]:
            summary["final_val_bpb"] = val[-1]["val_bpb"]
    return summary


def write_report(cfg: EvalConfig, state: dict, key: str, section: dict) -> str:
    """Add `section` under `key` to out/report.json (keeping other sections of the same checkpoint), render
    report.md from it; both written atomically. Returns report.md's path."""
    run_dir = os.path.dirname(os.path.abspath(cfg.ckpt))
    out = cfg.out or run_dir
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    report = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    if report.get("checkpoint") != os.path.abspath(cfg.ckpt):
        report = {"checkpoint": os.path.abspath(cfg.ckpt), "sections": {}}
    plots_dir = cfg.plots or run_dir
    report |= {"stage": state["stage"], "step": state["step"], "model_config": state["model_config"],
               "config": state["config"], "training": training_summary(state, os.path.join(run_dir, "metrics.jsonl")),
               "plots": [os.path.relpath(p, out) for p in sorted(glob.glob(os.path.join(plots_dir, "*.png")))]}
    report["sections"][key] = section
    for where, text in [(path, json.dumps(report, indent=1, ensure_ascii=False) + "\n"),
                        (os.path.join(out, "report.md"), render(report))]:
        with atomic_write(where, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"report: {os.path.join(out, 'report.md')}")
    return os.path.join(out, "report.md")


def render(report: dict) -> str:
    t = report["training"]
    seen = next(f"{t[k]:,} {k}" for k in ("tokens", "conversations", "pairs", "prompts") if k in t)
    here = os.path.relpath(report["checkpoint"])
    md = [f"# {report['checkpoint'] if here.startswith('..') else here}", "",
          f"{report['stage']} checkpoint at step {report['step']} ({seen} seen, {t['ranks']} rank(s))"
          + (f" of a {t['steps']}-step run of {t['wall_time_s'] / 60:.1f} min." if "steps" in t else f"; {t['metrics']}."),
          ""]
    if "final_val_loss" in t:
        bpb = f", val_bpb {t['final_val_bpb']:.4f}" if "final_val_bpb" in t else ""
        md += [f"The run's validation loss: final {t['final_val_loss']:.4f} (step {t['final_val_step']}{bpb}), best "
               f"{t['best_val_loss']:.4f} (step {t['best_val_step']}).", ""]
    md += [f"![{os.path.basename(p)}]({p})" for p in report["plots"]] + [""] * bool(report["plots"])
    for key, s in report["sections"].items():
        md += RENDER[key.split("/")[0]](s) + [""]
    md += ["<details><summary>config</summary>", "", "```json",
           json.dumps({k: report[k] for k in ("config", "model_config")}, indent=1, ensure_ascii=False),
           "```", "</details>", ""]
    return "\n".join(md)


def render_bpb(s: dict) -> list[str]:
    return ["## Bits per byte", "", f"**{s['bpb']:.4f} bits per byte** (loss {s['loss']:.4f}, ppl {s['ppl']:.2f}) on "
            f"`{s['data_path']}`: {s['windows']:,} windows of {s['window_tokens']} tokens, {s['tokens']:,} tokens, "
            f"{s['bytes']:,} bytes."]


def render_sft(s: dict) -> list[str]:
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
        prompt = "<br>".join(f"*{m['role']}:* {cell(m['content'])}" for m in x["prompt"])
        md.append(f"| {x['line']} | {prompt} | {cell(x['reference'])} | {cell(x['answer'])} |")
    return md


def cell(text: str) -> str:
    """Text in full inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def render_choice(s: dict) -> list[str]:
    how = "log-prob of each option's text (acc: summed; acc_norm: per character)" if s["method"] == "text" \
        else "probability of the answer letter in the chat template"
    md = [f"## {s['task']} ({s['split']}, {s['shots']}-shot)", "", f"`{s['data_dir']}`; scored by the {how}; overall "
          "is over all questions.", "", "| subject | N | acc | acc_norm | chance |", "|---|---:|---:|---:|---:|"]
    for subject, r in s["subjects"].items():
        norm = f"{r['acc_norm']:.1%}" if r["acc_norm"] is not None else "-"
        name = f"**{subject}**" if subject == "overall" else subject
        md.append(f"| {name} | {r['n']} | {r['acc']:.1%} | {norm} | {r['chance']:.1%} |")
    return md


RENDER = {"bpb": render_bpb, "sft": render_sft, "choice": render_choice, "pairs": render_pairs, "pass": render_pass,
          "toolcall": render_toolcall}
COMMANDS = {"bpb": (BpbConfig, eval_bpb), "sft": (SFTConfig, eval_sft), "choice": (ChoiceConfig, eval_choice),
            "pairs": (PairsConfig, eval_pairs), "pass": (PassConfig, eval_pass),
            "toolcall": (ToolCallConfig, eval_toolcall)}


def main(argv: list[str]):
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return
        raise ConfigError(f"the first argument must be a sub-command: {', '.join(COMMANDS)} (eval.py --help)")
    schema, evaluate = COMMANDS[argv[0]]
    (cfg,) = load_config(argv[1:], schema)
    section, state = evaluate(cfg)
    key = argv[0] if argv[0] != "choice" else f"choice/{cfg.task}/{cfg.split}/{cfg.shots}-shot/{cfg.method}"
    write_report(cfg, state, key, section)
    return section


if __name__ == "__main__":
    cli(main)
