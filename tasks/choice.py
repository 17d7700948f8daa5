"""eval.py choice: multiple-choice accuracy on C-Eval, CMMLU, MMLU or ARC, read from the files their projects
distribute (nothing is downloaded)."""
import csv
import dataclasses
import glob
import os

import numpy as np
import torch

from chat import encode_chat
from data import pad_rows
from errors import BadRecord, ConfigError, DataError
from losses import sequence_logprobs
from tasks.common import EvalConfig, load
from token_cache import parse_line

LETTERS = "ABCDE"
TASKS = {  # task: (where its files come from, the language of its prompts)
    "ceval": ("https://huggingface.co/datasets/ceval/ceval-exam (ceval-exam.zip: val/, dev/, test/)", "zh"),
    "cmmlu": ("https://huggingface.co/datasets/haonan-li/cmmlu (cmmlu_v1_0_1.zip: dev/, test/)", "zh"),
    "mmlu": ("https://people.eecs.berkeley.edu/~hendrycks/data.tar (its data/ folder: dev/, val/, test/)", "en"),
    "arc": ("https://ai2-public-datasets.s3.amazonaws.com/arc/ARC-V1-Feb2018.zip (ARC-Easy/, ARC-Challenge/)", "en"),
}
ARC_SPLITS = {"train": "Train", "val": "Dev", "dev": "Dev", "test": "Test"}


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


@dataclasses.dataclass
class Question:
    question: str
    options: list[str]
    answer: int  # index into options


# -----------------------------------------------------------------------------
# the files, as each project lays them out

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


def arc_question(record: dict) -> Question:
    """An ARC record ({"question": {"stem", "choices": [{"label", "text"}]}, "answerKey"}) -> its Question;
    BadRecord says what is missing or of the wrong type."""
    q = record.get("question")
    if not isinstance(q, dict) or not isinstance(q.get("stem"), str) or not isinstance(q.get("choices"), list):
        raise BadRecord("'question' must be an object with a string 'stem' and a list 'choices'")
    for i, c in enumerate(q["choices"]):
        if not isinstance(c, dict) or not isinstance(c.get("label"), str) or not isinstance(c.get("text"), str):
            raise BadRecord(f"choice {i} must be an object with a string 'label' and a string 'text'")
    labels = [c["label"] for c in q["choices"]]
    if record.get("answerKey") not in labels:
        raise BadRecord(f"'answerKey' {record.get('answerKey')!r} is not one of the labels {labels}")
    return Question(q["stem"], [c["text"] for c in q["choices"]], labels.index(record["answerKey"]))


def read_arc(path: str) -> list[Question]:
    """An ARC JSONL file's questions; DataError names the file and line of anything malformed."""
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = parse_line(line.encode())
                if record is not None:
                    questions.append(arc_question(record))
            except BadRecord as e:
                raise DataError(f"{path}:{lineno}: not an ARC question ({e})") from None
    return questions


def read_csv(task: str, path: str) -> list[Question]:
    """A C-Eval, CMMLU or MMLU file's questions; DataError names the file and line of anything malformed."""
    questions = []
    with open(path, encoding="utf-8", newline="") as f:
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


def read_questions(task: str, path: str) -> list[Question]:
    """A file's questions; DataError names the file, line and column of anything malformed."""
    return read_arc(path) if task == "arc" else read_csv(task, path)


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


# -----------------------------------------------------------------------------
# scoring the options

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


# -----------------------------------------------------------------------------
# the evaluation

def evaluate(cfg: ChoiceConfig) -> tuple[dict, dict]:
    """(the report's section, the checkpoint's state)."""
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


def render(s: dict) -> list[str]:
    how = "log-prob of each option's text (acc: summed; acc_norm: per character)" if s["method"] == "text" \
        else "probability of the answer letter in the chat template"
    md = [f"## {s['task']} ({s['split']}, {s['shots']}-shot)", "", f"`{s['data_dir']}`; scored by the {how}; overall "
          "is over all questions.", "", "| subject | N | acc | acc_norm | chance |", "|---|---:|---:|---:|---:|"]
    for subject, r in s["subjects"].items():
        norm = f"{r['acc_norm']:.1%}" if r["acc_norm"] is not None else "-"
        name = f"**{subject}**" if subject == "overall" else subject
        md.append(f"| {name} | {r['n']} | {r['acc']:.1%} | {norm} | {r['chance']:.1%} |")
    return md
