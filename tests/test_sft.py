"""SFT: it lowers the pretrained model's validation loss, its loss ignores every target but the assistant's, early
stopping ends a run that no longer improves, a bad line names its file and line unless skipping is asked."""
import json
import os

import pytest
import torch

import train_sft
from chat import encode_chat
from conftest import TINY_RUN, read_metrics, sft
from data import pad_rows
from errors import BadRecord
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer


def test_sft_lowers_the_validation_loss_of_the_pretrained_model(tiny_pretrained, demo_dir, tmp_path):
    sft(tiny_pretrained, demo_dir, tmp_path, "--max_steps=40", "--eval_interval=40", "--eval_steps=8")
    val = [r["val_loss"] for r in read_metrics(tmp_path) if "val_loss" in r]
    assert len(val) == 2  # step 0 (the pretrained model) and the end
    assert val[1] < 0.9 * val[0]
    assert torch.load(tmp_path / "best.pt", weights_only=False)["stage"] == "sft"


def test_the_loss_ignores_user_and_system_targets():
    tok = load_tokenizer()
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128))
    ids, mask = encode_chat(tok, [{"role": "user", "content": "What is 2 + 3?"},
                                  {"role": "assistant", "content": "2 + 3 = 5."}], system="Be brief.")
    X, Y, M, = pad_rows([(torch.tensor(ids).numpy(), torch.tensor(mask).numpy())], tok.pad_id)
    _, loss = model(X, Y, M)
    for t in range(Y.size(1)):
        changed = Y.clone()
        changed[0, t] = (changed[0, t] + 1) % 6400
        _, other = model(X, changed, M)
        if M[0, t] == 0:  # a target inside <s>, [INST], the system prompt, the user's words or [/INST]
            assert torch.equal(other, loss)
        else:  # an assistant token or its </s>
            assert not torch.equal(other, loss)


def test_early_stopping_when_the_validation_loss_stops_improving(tiny_pretrained, demo_dir, tmp_path, capsys):
    # lr 0: the model cannot change, so after the first evaluation of SFT (step 3) no later one improves;
    # step 0 (the pretrained model) is reported but is no candidate for best.pt
    sft(tiny_pretrained, demo_dir, tmp_path, "--lr=0", "--min_lr=0", "--max_steps=100", "--eval_interval=3",
        "--early_stopping_patience=2")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 6, 9]
    assert max(r["step"] for r in rows) == 9 and "early stopping" in capsys.readouterr().out
    assert os.path.exists(tmp_path / "step_0000009.pt") and os.path.exists(tmp_path / "best.pt")


def test_a_bad_sft_line_stops_with_file_and_line_unless_skipping_is_asked(tiny_pretrained, demo_dir, tmp_path):
    lines = open(f"{demo_dir}/sft.jsonl", encoding="utf-8").read().splitlines()[:300]
    lines.insert(41, json.dumps({"conversations": [{"role": "user", "content": "only a question"}]}))
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(BadRecord, match=r"bad\.jsonl:42: the last message must be the assistant's"):
        train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={path}", f"--out_dir={tmp_path / 'a'}",
                        *TINY_RUN, "--max_steps=1", "--max_seq_len=64", "--batch_size=8"])
    train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={path}", f"--out_dir={tmp_path / 'b'}",
                    *TINY_RUN, "--max_steps=1", "--max_seq_len=64", "--batch_size=8", "--skip_bad=True"])
