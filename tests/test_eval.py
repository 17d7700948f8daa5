"""eval.py and the validation loss: bits per byte by hand and in every stage, BLEU-4 and ROUGE-L equal to sacrebleu and
rouge-score, the SFT evaluation, multiple-choice accuracy on C-Eval, CMMLU, MMLU and ARC files; its command line."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sacrebleu  # test-only dependencies (requirements.txt): the reference BLEU and ROUGE
import torch
import torch.nn.functional as F

import eval as ev
import sample
import train_dpo
from chat import encode_chat
from checkpoint import load_model
from conftest import REPO, TINY_CONTEXT, TINY_RUN, read_metrics
from data import Loader, SFTData, pad_rows
from errors import DataError
from losses import count_token_bytes, validation_loss
from model import ModelConfig, Transformer
from runtime import Run
from tasks import choice, sft
from token_cache import load_split
import tokenizer as tk
from tokenizer import load_tokenizer
from train_tokenizer import main as train_tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CPU = ["--device=cpu", "--dtype=float32"]


def tiny_model(max_seq_len: int, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len)).eval()


def save_checkpoint(path, model, stage: str = "pretrain") -> str:
    """A checkpoint as the training scripts write it, as far as eval.py reads one."""
    tok = load_tokenizer()
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "stage": stage,
                "step": 0, "config": {"tokenizer_path": None, "batch_size": 1, "accum_steps": 1}, "rng": [None],
                "tokenizer": {"path": None, "fingerprint": tok.fingerprint, "chat_template": tok.chat_template}}, path)
    return str(path)


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return str(path)


# -----------------------------------------------------------------------------
# bits per byte

def test_token_bytes_add_up_to_the_text_and_special_tokens_count_zero(tmp_path):
    text = "Bits per byte: 每个字节的比特数 (ünïcödé, emoji 🙂🚀), digits 12345.\n\tend"
    corpus = tmp_path / "corpus.txt"  # a small SentencePiece model: its byte pieces must count 1 byte each
    words = "the quick brown fox jumps over a lazy dog while 敏捷的棕色狐狸跳过了懒狗 and bits per byte".split()
    corpus.write_text("\n\n".join(" ".join(words[i % 7 :] + words[: i % 5]) for i in range(300)), encoding="utf-8")
    train_tokenizer([str(corpus), "--vocab_size=320", f"--out={tmp_path / 'sp'}", "--backend=sentencepiece"])
    sentencepiece = load_tokenizer(tmp_path / "sp")
    assert sentencepiece.__class__.__name__ == "SentencePieceTokenizer"
    for tok in (load_tokenizer(), load_tokenizer(tk.NANOMIND_DIR), sentencepiece):
        counts = count_token_bytes(tok)
        assert int(counts[tok.encode(text)].sum()) == len(text.encode("utf-8"))
        assert counts[tok.bos_id] == counts[tok.eos_id] == counts[tok.pad_id] == 0
    nanomind = load_tokenizer(tk.NANOMIND_DIR)
    assert all(count_token_bytes(nanomind)[i] == 0 for ids in nanomind.chat_tokens.values() for i in ids)  # [INST]


def test_bpb_of_a_text_is_its_nats_over_ln2_over_its_bytes(tmp_path):
    """eval.py bpb = the cross-entropy of every target by hand, in bits, over the documents' UTF-8 bytes: the
    <s> and </s> between documents are scored but are 0 bytes."""
    tok = load_tokenizer()
    docs = ["The capital of Kenya is Nairobi.", "肯尼亚的首都是内罗毕。 Ünïcödé 🙂"]
    ids = [t for d in docs for t in [tok.bos_id, *tok.encode(d), tok.eos_id]]
    model = tiny_model(max_seq_len=len(ids) - 1)  # the two documents are exactly one window
    ckpt = save_checkpoint(tmp_path / "m.pt", model)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": d} for d in docs])
    section = ev.main(["bpb", f"--ckpt={ckpt}", f"--data_path={data}", *CPU])

    x = torch.tensor(ids)
    with torch.no_grad():
        logits, _ = model(x[None, :-1], x[None, 1:])
    nats = F.cross_entropy(logits[0], x[1:], reduction="sum").item()
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert section["windows"] == 1 and section["tokens"] == len(ids) - 1 and section["bytes"] == n_bytes
    assert section["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    report = json.load(open(tmp_path / "report.json", encoding="utf-8"))
    assert report["sections"]["bpb"]["bpb"] == section["bpb"]


def test_validation_loss_weighs_every_token_alike_and_bpb_counts_the_answers_bytes_not_the_template():
    """val_loss of SFT conversations in batches of different sizes: all answer tokens' nats over their number (what
    eval.py reports too), not a mean of the batches' means; val_bpb: those nats over the bytes of ' {answer} '
    (llama2)."""
    tok = load_tokenizer(tk.NANOMIND_DIR)
    convs = [[{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
              {"role": "user", "content": "和呢？"}, {"role": "assistant", "content": "五。"}],
             [{"role": "user", "content": "Where is Peru?"},
              {"role": "assistant", "content": "Peru is in South America."}]]
    model = tiny_model(max_seq_len=64)
    rows = [tuple(np.array(a) for a in encode_chat(tok, c)) for c in convs]
    nats, tokens, means = 0.0, 0.0, []
    for ids, mask in rows:
        X, Y, M = pad_rows([(ids, mask)], tok.pad_id)
        with torch.no_grad():
            _, ce = model(X, Y, reduction="none")
        nats, tokens = nats + (ce * M).sum().item(), tokens + M.sum().item()
        means.append((ce * M).sum().item() / M.sum().item())
    n_bytes = sum(len(f" {m['content']} ".encode()) for c in convs for m in c if m["role"] == "assistant")
    loader = Loader(SFTData([(ids, mask) for ids, mask in rows]), batch_size=1, pad_id=tok.pad_id)
    val = validation_loss(model, loader, 10, Run(torch.device("cpu"), "float32"), count_token_bytes(tok))
    assert val["val_loss"] == pytest.approx(nats / tokens, rel=1e-6)
    assert abs(nats / tokens - sum(means) / len(means)) > 1e-3  # the batches' answers differ in length: it matters
    assert val["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_every_stage_logs_val_bpb(tiny_pretrained, tiny_sft, demo_dir, tmp_path):
    for run_dir in (tiny_pretrained.parent, tiny_sft.parent):
        rows = [r for r in read_metrics(run_dir) if "val_loss" in r]
        assert rows and all(0 < r["val_bpb"] < 10 for r in rows)
    train_dpo.main([f"--init_from={tiny_sft}", f"--data_path={demo_dir}/dpo.jsonl", f"--out_dir={tmp_path}", *TINY_RUN,
                    "--batch_size=4", "--max_steps=1", "--lr=0", "--min_lr=0", "--eval_steps=2"])
    (row,) = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    # lr 0: the policy is the SFT model; val_bpb: its bits per byte on the first 2 x 4 validation pairs' chosen answers
    tok = load_tokenizer()
    _, val = load_split(f"{demo_dir}/dpo.jsonl", None, 0.05, tok, "dpo", max_prompt_length=32,
                        max_completion_length=33, verbose=False)
    model = load_model(str(tiny_sft))[0]
    nats = n_bytes = 0.0
    for i in range(8):
        prompt, chosen, _ = val[i]
        ids = np.concatenate([prompt, chosen])
        X, Y, M = pad_rows([(ids, np.r_[np.zeros(len(prompt)), np.ones(len(chosen))])], tok.pad_id)
        with torch.no_grad():
            _, ce = model(X, Y, reduction="none")
        nats += (ce * M).sum().item()
        special = {tok.eos_id, *tok.added_tokens.values()}  # 0 bytes: eos, and ChatML's think tags
        n_bytes += len(tok.decode([t for t in chosen if t not in special]).encode())
    assert row["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


# -----------------------------------------------------------------------------
# BLEU-4 and ROUGE-L against the reference implementations

HYPS = ["the cat sat on the mat", "there is a dog in the garden today", "a quick brown fox jumps over the dog",
        "it is raining", "we went to the market and bought apples and pears"]
REFS = ["the cat is sitting on the mat", "a dog is in the garden", "the quick brown fox jumped over the lazy dog",
        "it is raining heavily in the city tonight", "we went to the market and bought some apples"]
MIXED_HYPS = ["肯尼亚的首都是内罗毕。", "The capital of Peru is Lima, I think.", "三加五等于八。", "秘鲁在南美洲，对吧？"]
MIXED_REFS = ["肯尼亚的首都是内罗毕。", "The capital of Peru is Lima.", "三加五等于八。", "秘鲁位于南美洲。"]


def test_words_split_chinese_by_character_and_other_text_by_word_and_punctuation():
    assert sft.words("卢旺达的首都是Kigali。It's 3.5 km, ok?") == [
        "卢", "旺", "达", "的", "首", "都", "是", "Kigali", "。", "It", "'", "s", "3", ".", "5", "km", ",", "ok", "?"]


def test_bleu4_equals_sacrebleu():
    for hyps, refs in ((HYPS, REFS), (REFS, HYPS), (HYPS[:2], REFS[:2])):  # answers shorter, longer
        expected = sacrebleu.corpus_bleu(hyps, [refs], smooth_method="none").score  # its 13a tokenizer agrees here
        assert sft.bleu4(hyps, refs) == pytest.approx(expected, abs=1e-9)
    assert sft.bleu4(HYPS, REFS) not in (0.0, 100.0)
    # Chinese and punctuation: sacrebleu on our words, joined by spaces
    joined = lambda texts: [" ".join(sft.words(t)) for t in texts]  # noqa: E731
    expected = sacrebleu.corpus_bleu(joined(MIXED_HYPS), [joined(MIXED_REFS)], smooth_method="none", tokenize="none")
    assert sft.bleu4(MIXED_HYPS, MIXED_REFS) == pytest.approx(expected.score, abs=1e-9)
    assert sft.bleu4(["a b c"], ["x y z w"]) == 0.0


# rouge-score runs in a process of its own: it imports pandas and pyarrow, whose jemalloc thread can deadlock a
# fork (token_cache's worker pool) in any later test of this process
ROUGE = """
import json, sys
from types import SimpleNamespace
from rouge_score import rouge_scorer
from tasks import sft
plain, mixed = json.loads(sys.stdin.read())
scorer = rouge_scorer.RougeScorer(["rougeL"])  # lower-cases and drops punctuation: none in HYPS/REFS
ours = rouge_scorer.RougeScorer(["rougeL"], tokenizer=SimpleNamespace(tokenize=sft.words))
print(json.dumps([[scorer.score(r, h)["rougeL"].fmeasure for h, r in plain],
                  [ours.score(r, h)["rougeL"].fmeasure for h, r in mixed]]))
"""


def test_rouge_l_equals_rouge_score():
    pairs = [list(zip(HYPS, REFS)), list(zip(MIXED_HYPS, MIXED_REFS))]
    done = subprocess.run([sys.executable, "-c", ROUGE], input=json.dumps(pairs), cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for expected, these in zip(json.loads(done.stdout), pairs):
        for f, (h, r) in zip(expected, these, strict=True):
            assert sft.rouge_l(h, r) == pytest.approx(100 * f, abs=1e-9)
    assert sft.rouge_l("秘鲁在南美洲", "秘鲁位于南美洲") == pytest.approx(100 * 2 * 5 / (6 + 7))


# -----------------------------------------------------------------------------
# eval.py sft

def test_sft_eval_perplexity_answers_and_report(tiny_sft, demo_dir, tmp_path):
    out = tmp_path / "report"
    section = ev.main(["sft", f"--ckpt={tiny_sft}", f"--data_path={demo_dir}/sft.jsonl", "--max_records=6",
                       "--max_new_tokens=12", "--samples=6", "--batch_size=4", f"--out={out}", *CPU])
    tok, (model, _, _) = load_tokenizer(), load_model(str(tiny_sft))
    records = [json.loads(line) for line in open(f"{demo_dir}/sft.jsonl", encoding="utf-8")][:6]
    nats = tokens = 0.0
    for r in records:  # perplexity: the training loss (masked to the answers) over all 6 conversations' tokens
        ids, mask = encode_chat(tok, r["conversations"], r.get("system"), max_len=TINY_CONTEXT + 1)
        X, Y, M = pad_rows([(np.array(ids), np.array(mask))], tok.pad_id)
        with torch.no_grad():
            _, ce_sum = model(X, Y, M, reduction="sum")
        nats, tokens = nats + ce_sum.item(), tokens + M.sum().item()
    assert section["answer_tokens"] == tokens and section["ppl"] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    # the answers are sample.py's greedy answers, one conversation at a time
    for r, s in zip(records, section["samples"]):  # prompts cut to leave one position, answers to what is left
        ids, _ = encode_chat(tok, r["conversations"][:-1], r.get("system"), max_len=TINY_CONTEXT - 1)
        args = SimpleNamespace(max_new_tokens=min(12, TINY_CONTEXT - len(ids)), temperature=0, top_k=None, top_p=None,
                               repetition_penalty=1.0)
        assert s["answer"] == sample.respond(model, tok, ids, args).strip()
        assert s["reference"] == r["conversations"][-1]["content"]
    answers, refs = [s["answer"] for s in section["samples"]], [s["reference"] for s in section["samples"]]
    assert section["bleu4"] == sft.bleu4(answers, refs)
    assert section["rougeL_f1"] == pytest.approx(sum(map(sft.rouge_l, answers, refs)) / 6)
    report = json.load(open(out / "report.json", encoding="utf-8"))
    assert report["sections"]["sft"]["ppl"] == section["ppl"] and report["training"]["steps"] == 150
    md = (out / "report.md").read_text(encoding="utf-8")
    assert f"| {section['ppl']:.3f} |" in md and refs[0] in md


def test_sft_eval_in_the_chatml_template(tmp_path):
    """MiniMind's tokenizer: the same perplexity by hand, and bits per byte over what the assistant's turn writes
    ("<think>\\n\\n</think>\\n\\n" then the answer: the tags and <|im_end|> are special, the 4 newlines are bytes)."""
    tok_dir = str(tk.DEFAULT_DIR)  # MiniMind's
    tok, model = load_tokenizer(tok_dir), tiny_model(max_seq_len=64)
    ckpt = save_checkpoint(tmp_path / "chatml.pt", model, stage="sft")
    state = torch.load(ckpt, weights_only=False)
    state["config"]["tokenizer_path"] = tok_dir
    torch.save(state, ckpt)
    convs = [[{"role": "user", "content": "肯尼亚的首都是哪里？"}, {"role": "assistant", "content": "内罗毕。"}],
             [{"role": "user", "content": "Where is Peru?"}, {"role": "assistant", "content": "In South America."}]]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in convs])
    section = ev.main(["sft", f"--ckpt={ckpt}", f"--data_path={data}", "--max_new_tokens=6", *CPU])
    nats = 0.0
    for c in convs:
        ids, mask = encode_chat(tok, c)
        X, Y, M = pad_rows([(np.array(ids), np.array(mask))], tok.pad_id)
        with torch.no_grad():
            nats += model(X, Y, M, reduction="sum")[1].item()
    n_bytes = sum(4 + len(c[-1]["content"].encode()) for c in convs)
    assert section["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    args = SimpleNamespace(max_new_tokens=6, temperature=0, top_k=None, top_p=None, repetition_penalty=1.0)
    for c, s in zip(convs, section["samples"]):
        assert s["answer"] == sample.respond(model, tok, encode_chat(tok, c[:-1])[0], args).strip()


def test_sft_eval_names_a_bad_line(tiny_sft, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": "hello"}]},
                                                {"conversations": [{"role": "user", "content": "no answer"}]}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*ending with the assistant"):
        ev.main(["sft", f"--ckpt={tiny_sft}", f"--data_path={data}", f"--out={tmp_path}", *CPU])


def test_sft_eval_names_a_line_whose_reference_answer_is_null(tmp_path):
    """MiniMind's ChatML template shows a null content as empty; as the reference answer it is a data error."""
    ckpt = save_checkpoint(tmp_path / "chatml.pt", tiny_model(max_seq_len=64), stage="sft")
    state = torch.load(ckpt, weights_only=False)
    state["config"]["tokenizer_path"] = str(tk.DEFAULT_DIR)
    torch.save(state, ckpt)
    data = write_jsonl(tmp_path / "null.jsonl", [{"conversations": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "hello"}]},
                                                 {"conversations": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": None}]}])
    with pytest.raises(DataError, match=r"null.jsonl:2: the last message, the reference answer, needs a string"):
        ev.main(["sft", f"--ckpt={ckpt}", f"--data_path={data}", f"--out={tmp_path}", *CPU])


# -----------------------------------------------------------------------------
# eval.py choice

Q = choice.Question
EXPECTED = {  # the fixture files, read by hand
    "ceval": {"physics": [Q("水在标准大气压下的沸点是多少摄氏度？", ["90", "100", "110", "120"], 1),
                          Q("光在真空中传播的速度约为多少，单位是米每秒？", ["3×10^8", "3×10^6", "340", "1,500"], 0)]},
    "cmmlu": {"anatomy": [Q("人体最大的器官是？", ["心脏", "肝脏", "皮肤", "肺"], 2),
                          Q("成年人的正常体温大约是\n多少摄氏度？", ["35", "37", "39", "41"], 1)]},
    "mmlu": {"astronomy": [Q("Which planet is closest to the Sun?", ["Venus", "Mercury", "Earth", "Mars"], 1),
                           Q("How many moons does Mars have, as far as we know?", ["0", "1", "2", "3"], 2)]},
    "arc": {"ARC-Challenge": [Q("Which force pulls objects toward Earth?",
                                ["magnetism", "friction", "gravity", "tension", "lift"], 2)],
            "ARC-Easy": [Q("Which of these is a source of light?", ["the Sun", "the Moon", "a mirror", "a rock"], 0),
                         Q("What do plants need to make food?", ["sand", "sunlight", "noise"], 1)]},
}
SHOTS = {"ceval": Q("力的国际单位是什么？", ["焦耳", "瓦特", "牛顿", "帕斯卡"], 2),
         "cmmlu": Q("人有几个肺？", ["一个", "两个", "三个", "四个"], 1),
         "mmlu": Q("What is the largest planet?", ["Jupiter", "Saturn", "Earth", "Venus"], 0)}
SPLIT = {"ceval": "val", "cmmlu": "test", "mmlu": "val", "arc": "val"}


def choice_cfg(task, **kw) -> choice.ChoiceConfig:
    return choice.ChoiceConfig(task=task, data_dir=os.path.join(FIXTURES, task), split=SPLIT[task], **kw)


@pytest.mark.parametrize("task", list(EXPECTED))
def test_choice_files_read_in_each_format(task):
    tasks = choice.load_task(choice_cfg(task, shots=1))
    assert {s: qs for s, (qs, _) in tasks.items()} == EXPECTED[task]
    if task in SHOTS:
        assert all(shots == [SHOTS[task]] for _, shots in tasks.values())
    else:
        assert tasks["ARC-Easy"][1][0].options == ["solid", "liquid", "gas", "plasma"]


def test_choice_accuracy_per_subject_and_overall_with_a_stub_scorer():
    """A scorer that knows each option's log-prob by its text: acc takes the highest sum, acc_norm the highest per
    character. The rows must score exactly the option's tokens."""
    tok = load_tokenizer()
    logps = {"aa": -1.0, "b": -1.5, "cccc": -3.0, "dd": -4.0,  # per char -0.5, -1.5, -0.75, -2: both right
             "Rome": -1.0, "Paris": -1.1, "Sydney": -3.0,  # per char -0.25, -0.22, -0.5: acc wrong, acc_norm right
             # (per token, 1, 1 and 5 of them: -1, -1.1, -0.6, Sydney)
             "p": -1.0, "q": -2.0, "r": -3.0, "s": -4.0}  # both wrong
    tasks = {"A": ([Q("one?", ["aa", "b", "cccc", "dd"], 0), Q("two?", ["Rome", "Paris", "Sydney"], 1)], []),
             "B": ([Q("three?", ["p", "q", "r", "s"], 2)], [])}

    def stub(rows):
        return [logps[tok.decode([t for t, m in zip(ids, mask) if m]).removeprefix(" ")] for ids, mask in rows]

    results = choice.eval_choice_questions(tasks, stub, tok, "text", "en")
    assert results["A"] == {"n": 2, "acc": 0.5, "acc_norm": 1.0, "chance": pytest.approx((1 / 4 + 1 / 3) / 2)}
    assert results["B"] == {"n": 1, "acc": 0.0, "acc_norm": 0.0, "chance": 0.25}
    assert results["overall"] == {"n": 3, "acc": pytest.approx(1 / 3), "acc_norm": pytest.approx(2 / 3),
                                  "chance": pytest.approx((1 / 4 + 1 / 3 + 1 / 4) / 3)}


def test_choice_scores_are_the_rows_log_probs_by_hand():
    tok, model = load_tokenizer(), tiny_model(max_seq_len=64)
    q = EXPECTED["mmlu"]["astronomy"][0]
    rows = choice.text_rows(tok, q, [SHOTS["mmlu"]], "en")
    score = choice.model_scorer(model, tok, 3, Run(torch.device("cpu"), "float32"))(rows)  # padded, 2 batches
    for option, (ids, mask), got in zip(q.options, rows, score):
        x = torch.tensor(ids)
        with torch.no_grad():
            logits, _ = model(x[None, :-1], x[None, 1:])
        logp = logits[0].log_softmax(-1).gather(1, x[1:, None])[:, 0]
        assert got == pytest.approx((logp * torch.tensor(mask[1:])).sum().item(), rel=1e-5)
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == " " + option


def test_a_model_trained_on_the_answers_gets_them_all(tmp_path):
    """A tiny model memorises the right option (text) and letter (chat) of every MMLU fixture question; eval.py
    choice must then find every answer, by both methods; untrained, it does not."""
    tok = load_tokenizer()
    questions, _ = choice.load_task(choice_cfg("mmlu"))["astronomy"]
    rows = []
    for q in questions:
        rows.append(choice.text_rows(tok, q, [], "en")[q.answer])
        rows.append(choice.letter_rows(tok, q, [], "en")[q.answer])
    model = tiny_model(max_seq_len=128, seed=1).train()
    X, Y, M = pad_rows([(np.array(i), np.array(m)) for i, m in rows], tok.pad_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(160):  # to a loss near 0: every answer, text and letter, memorised
        _, loss = model(X, Y, M)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt = save_checkpoint(tmp_path / "sft.pt", model.eval(), stage="sft")
    args = [f"--ckpt={ckpt}", "--task=mmlu", f"--data_dir={FIXTURES}/mmlu", *CPU]
    for method in ("text", "letter"):
        section = ev.main(["choice", *args, f"--method={method}"])
        assert section["subjects"]["overall"]["acc"] == 1.0 and section["subjects"]["overall"]["n"] == 2
    report = json.load(open(tmp_path / "report.json", encoding="utf-8"))
    assert set(report["sections"]) == {"choice/mmlu/val/0-shot/text", "choice/mmlu/val/0-shot/letter"}
    untrained = save_checkpoint(tmp_path / "untrained.pt", tiny_model(max_seq_len=128, seed=1), stage="sft")
    section = ev.main(["choice", *args, f"--ckpt={untrained}", f"--out={tmp_path / 'untrained'}"])
    assert section["subjects"]["overall"]["acc"] < 1.0


def test_choice_says_where_to_get_missing_files_and_names_bad_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match="huggingface.co/datasets/ceval/ceval-exam"):
        choice.load_task(choice.ChoiceConfig(task="ceval", data_dir=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match="people.eecs.berkeley.edu"):
        choice.load_task(choice.ChoiceConfig(task="mmlu", data_dir=str(tmp_path)))
    os.makedirs(tmp_path / "test")
    (tmp_path / "test" / "law_test.csv").write_text("id,question,A,B,C,D,answer\n0,q,a,b,c,d,\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"law_test.csv:2: answer '' .*--split=val"):
        choice.load_task(choice.ChoiceConfig(task="ceval", data_dir=str(tmp_path), split="test"))
    good = {"question": {"stem": "q", "choices": [{"text": "a", "label": "A"}, {"text": "b", "label": "B"}]},
            "answerKey": "B"}
    for bad, what in [(good | {"answerKey": "C"}, r"'answerKey' 'C' is not one of the labels \['A', 'B'\]"),
                      (good | {"question": {"stem": "q", "choices": [{"text": "a"}]}}, "choice 0 must be an object"),
                      ({"question": "q"}, "'question' must be an object")]:
        arc = write_jsonl(tmp_path / "ARC-Easy-Dev.jsonl", [good, bad])
        with pytest.raises(DataError, match=rf"ARC-Easy-Dev.jsonl:2: not an ARC question \({what}"):
            choice.read_questions("arc", arc)


def test_cli_help_and_a_missing_data_dir_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ev.main(["sft", "--help"])
    assert "--max_records=200" in capsys.readouterr().out
    result = subprocess.run([sys.executable, "eval.py", "choice", "--task=cmmlu", f"--data_dir={tmp_path}/cmmlu"],
                            cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: data_dir") and "haonan-li/cmmlu" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
