"""An exported folder scored by lm-evaluation-harness (`--model hf`, a local multiple-choice task) gets what
`eval.py choice` gets for the checkpoint: the same acc, acc_norm and log-likelihood of every option, with nanomind's
tokenizer and with MiniMind's (whose plain text must start with bos in the export, as in pretraining)."""
import csv
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import convert
import eval as ev
from checkpoint import load_model
from runtime import Run
from tasks import choice
from test_export import MINIMIND_TOKENIZER, random_checkpoint
from tokenizer import NANOMIND_DIR

SUBJECTS = ["capitals", "arithmetic", "colours", "animals"]
# lm-eval runs in a process of its own: its imports (datasets, pyarrow) start a jemalloc thread, and a process
# holding one can deadlock a fork (token_cache's worker pool) in any later test
LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
folder, tasks, out = sys.argv[1:]
r = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", device="cpu", tasks=["nanomind_mixed"],
                    task_manager=TaskManager(include_path=tasks), batch_size=4, log_samples=True)
samples = [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in r["samples"]["nanomind_mixed"]]
json.dump({"results": r["results"]["nanomind_mixed"], "samples": samples}, open(out, "w"))
"""


def questions(n: int, seed: int) -> list[dict]:
    """Four-option questions in English and Chinese, some options several words long."""
    rng = random.Random(seed)
    words = ["Paris", "Nairobi", "the river Nile", "北京", "上海市", "seven", "42", "blue and green", "红色", "a cat",
             "熊猫", "an old grey wolf", "3.14", "东京", "Lima", "twelve apples"]
    out = []
    for i in range(n):
        options = rng.sample(words, 4)
        stem = rng.choice(["Which one is right?", "哪一个是正确的？", f"What is item {i}?", "Pick the best answer."])
        out.append({"question": stem, "options": options, "answer": rng.randrange(4)})
    return out


@pytest.mark.parametrize("tokenizer", ["nanomind", "minimind"])
def test_lm_eval_scores_the_export_as_eval_py_scores_the_checkpoint(tokenizer, tmp_path):
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", shape | {"vocab_size": 6400},
                             MINIMIND_TOKENIZER if tokenizer == "minimind" else NANOMIND_DIR, seed=3)
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    qs = questions(24, seed=1)
    (tmp_path / "mmlu" / "val").mkdir(parents=True)
    with open(tmp_path / "mmlu" / "val" / "mixed_val.csv", "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([q["question"], *q["options"], "ABCD"[q["answer"]]] for q in qs)
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in qs),
                                              encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mixed.yaml").write_text(
        "task: nanomind_mixed\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'questions.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{options}}\"\ndoc_to_target: answer\n"
        "target_delimiter: \" \"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # local folder and task: never the Hub
    done = subprocess.run([sys.executable, "-c", LM_EVAL, str(tmp_path / "hf"), str(tmp_path / "tasks"),
                           str(tmp_path / "theirs.json")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "theirs.json").read_text(encoding="utf-8"))
    ours = ev.main(["choice", f"--ckpt={ckpt}", "--task=mmlu", f"--data_dir={tmp_path / 'mmlu'}", "--device=cpu",
                    "--dtype=float32", f"--out={tmp_path / 'eval'}"])["subjects"]["overall"]
    results = theirs["results"]
    assert (results["acc,none"], results["acc_norm,none"]) == (ours["acc"], ours["acc_norm"])

    model, tok, _ = load_model(str(ckpt))
    score = choice.model_scorer(model.eval(), tok, 8, Run(torch.device("cpu"), "float32"))
    for sample in theirs["samples"]:
        q = qs[sample["doc_id"]]
        expected = score(choice.text_rows(tok, choice.Question(q["question"], q["options"], q["answer"]), [], "en"))
        got = [loglikelihood for (loglikelihood, _greedy), in sample["resps"]]
        assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-4, (got, expected)
