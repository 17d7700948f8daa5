import io
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import sample
import train_sft
from chat import encode_chat
from checkpoint import load_model
from conftest import TINY_RUN, final_weights, read_metrics, train_losses
from data import pad_rows
from engine import prompt_ids
from errors import BadRecord
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer


def sft(tiny_pretrained, demo_dir, out_dir, *flags):
    train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out_dir}",
                    *TINY_RUN, "--batch_size=8", "--lr=5e-3", "--max_seq_len=64", *flags])


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


def test_sft_resume_continues_exactly(tiny_pretrained, demo_dir, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = ["--max_steps=10", "--save_interval=4", "--keep_checkpoints=10", "--eval_interval=5"]
    sft(tiny_pretrained, demo_dir, full, *flags)
    os.makedirs(resumed)
    shutil.copy(full / "step_0000004.pt", resumed)
    sft(tiny_pretrained, demo_dir, resumed, *flags, "--resume=True")
    a, b = train_losses(full), train_losses(resumed)
    assert set(b) == set(range(5, 11)) and all(a[s] == b[s] for s in b)
    wa, wb = final_weights(full, 10), final_weights(resumed, 10)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


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


def chat_args(**overrides):
    args = dict(temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0, max_new_tokens=16, system="Be brief.")
    return SimpleNamespace(**{**args, **overrides})


def test_a_scripted_two_turn_chat_feeds_history_in_the_template(tiny_sft, monkeypatch):
    model, _, config = load_model(str(tiny_sft))
    tok = load_tokenizer()
    assert config["stage"] == "sft"
    fed = []  # the ids each answer is generated from
    respond = sample.respond
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, *rest: fed.append(ids) or respond(model, tok, ids, *rest))
    lines = iter(["What is 2 + 3?", "法国的首都是哪里？"])

    def read(prompt):  # like input(): a line per call, then EOFError (Ctrl-D)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    history = sample.chat_loop(model, tok, chat_args(), chat=True, read=read, out=io.StringIO())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    expected_turn_two, _ = encode_chat(tok, history[:3], system="Be brief.")
    assert fed[1] == expected_turn_two  # turn one's question and answer, then turn two's question, in the template
    assert tok.decode(fed[1]).startswith("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is 2 + 3? [/INST]")
    assert tok.decode(fed[1]).endswith("</s><s>[INST] 法国的首都是哪里？ [/INST]")


def test_answers_are_reproducible_with_the_same_seed(tiny_sft):
    model, _, _ = load_model(str(tiny_sft))
    tok = load_tokenizer()
    ids = prompt_ids(tok, [{"role": "user", "content": "What is 2 + 3?"}], None, 40)
    greedy = [sample.respond(model, tok, ids, chat_args()) for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(5)
        sampled.append(sample.respond(model, tok, ids, chat_args(temperature=1.0, top_p=0.95), generator=generator))
    assert sampled[0] == sampled[1]


def test_the_cli_uses_the_template_for_chat_checkpoints_and_plain_text_for_pretrain(tiny_sft, tiny_pretrained,
                                                                                      monkeypatch, capsys):
    tok = load_tokenizer()
    fed = []
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, *rest: fed.append(ids) or "")
    sample.main(["--ckpt", str(tiny_sft), "--prompt", "What is 2 + 3?", "--max_new_tokens", "8"])
    sample.main(["--ckpt", str(tiny_pretrained), "--prompt", "The capital of", "--max_new_tokens", "8"])
    assert fed[0] == encode_chat(tok, [{"role": "user", "content": "What is 2 + 3?"}])[0]
    assert fed[1] == [tok.bos_id] + tok.encode("The capital of")
