"""diagnose.py: overfit and lr_find, the data report (near duplicates included), activation checks that name a bad
layer, a memory estimate equal to what autograd saves, experts' shares equal to a hand count with the collapsed ones
named, and its command line."""
import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import matplotlib.image
import pytest
import torch

import diagnose
import memory
import model as model_py
from conftest import REPO, TINY_MODEL
from errors import CheckpointError, ConfigError
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second intra-op thread, and on a busy 2-core machine its synchronisation
    made these tests 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**TINY | overrides))


def random_batch(batch_size=4, seed=0):
    ids = torch.randint(0, TINY["vocab_size"], (batch_size, TINY["max_seq_len"] + 1),
                        generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:], torch.ones(batch_size, TINY["max_seq_len"])


# --- overfit and lr_find ------------------------------------------------------------------------

def test_overfit_memorises_one_batch_but_not_labels_shuffled_every_step():
    losses, passed = diagnose.overfit(tiny_model(), random_batch(), steps=60, lr=1e-2)
    assert passed and losses[-1] < 0.1 * losses[0] and len(losses) < 60  # stops once it passes (~25 steps)
    losses, passed = diagnose.overfit(tiny_model(), random_batch(), steps=60, lr=1e-2, shuffle_labels=True)
    assert not passed and len(losses) == 60 and min(losses) > 0.5 * losses[0]


def test_lr_find_sweeps_up_then_stops_when_the_loss_explodes():
    batch = random_batch()
    lrs, losses, suggested = diagnose.lr_find(tiny_model(), lambda: batch, steps=100)
    assert len(lrs) == len(losses) < 100  # stopped before lr reached 1
    assert lrs[0] == pytest.approx(1e-7) and all(b > a for a, b in zip(lrs, lrs[1:]))
    assert not losses[-1] <= 4 * min(losses[:-1])  # the stop was an explosion
    assert all(v <= 4 * min(losses[: i + 1]) for i, v in enumerate(losses[:-1]))  # and not earlier
    assert 1e-7 <= suggested < lrs[-1]
    # the suggestion sits where the loss falls: the loss a few steps later is clearly lower
    i = lrs.index(suggested)
    assert losses[min(i + 5, len(losses) - 2)] < losses[max(i - 5, 0)]


def test_suggest_lr_picks_the_steepest_descent():
    lrs = [10 ** (-7 + 7 * i / 99) for i in range(100)]
    losses = [5 - 4 / (1 + math.exp(-(i - 60) / 3)) for i in range(100)]  # falls fastest at step 60
    assert diagnose.suggest_lr(lrs, losses) == pytest.approx(lrs[60])
    assert diagnose.suggest_lr(lrs[:70] + [1e-1], losses[:70] + [float("nan")]) == pytest.approx(lrs[60])


# --- data report --------------------------------------------------------------------------------

def test_data_report_counts_duplicates_long_documents_and_bad_lines(tmp_path):
    tok = load_tokenizer()
    short = ["hello world", "你好，世界", "one two three", "the cat sat"]
    long = [" ".join(["word"] * 100), " ".join(["猫"] * 100)]
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in short + [short[0], short[0]] + long]
    lines += ["{not json", "", json.dumps({"title": "no text field"}), "[" * 5000 + "]" * 5000, "[1]"]
    path = tmp_path / "pretrain.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = diagnose.data_report(str(path), tok, "pretrain", max_seq_len=32)
    assert (r["records"], r["duplicates"], r["bad_records"], r["over_max_seq_len"]) == (8, 2, 4, 2)
    assert r["duplicate_rate"] == pytest.approx(2 / 8)
    assert r["lengths"][0] == len(tok.encode("hello world")) + 2  # <s> ... </s>
    assert r["max"] == max(len(tok.encode(t)) + 2 for t in long) > 33
    assert r["p50"] <= r["p95"] <= r["max"] and "✓" in r["sample"]


def test_data_report_for_sft_counts_loss_tokens_and_conversations_without_any(tmp_path):
    tok = load_tokenizer()

    def chat(user, answer):
        return {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    records = [chat("1+1?", "2"), chat("hi", "hello"), chat("2+2?", "4"), chat("1+1?", "2"),
               chat(" ".join(["long"] * 100), "cut off")]  # the prompt alone fills max_seq_len
    lines = [json.dumps(r) for r in records] + [json.dumps({"conversations": [{"role": "user", "content": "x"}]})]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = diagnose.data_report(str(path), tok, "sft", max_seq_len=32)
    assert (r["records"], r["duplicates"], r["bad_records"], r["over_max_seq_len"], r["no_loss_records"]) == (5, 1, 1, 1, 1)
    assert 0 < r["loss_token_fraction"] < 0.5  # answers are short next to the template and prompts
    assert "✗" in r["sample"] and "✓" in r["sample"]


def test_data_reports_near_duplicates_and_warns_over_one_percent(tmp_path, capsys):
    rng = random.Random(0)
    texts = [" ".join("".join(rng.choices("etaoinshrdlu", k=rng.randint(2, 7))) for _ in range(120)) for _ in range(60)]
    edited = texts[7][:100] + "x" + texts[7][101:300] + "  " + texts[7][300:].replace(" ", "\n", 1)  # Jaccard 0.98
    for name, lines in [("clean", texts), ("near", texts[:20] + [edited] + texts[20:])]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        diagnose.main(["data", f"--data_path={path}", "--max_seq_len=64", "--device=cpu", f"--out_dir={tmp_path}"])
        out = capsys.readouterr().out
        (line,) = [s for s in out.splitlines() if s.startswith("near duplicates")]
        if name == "clean":
            assert ": 0 (0.00%)" in line and "✗" not in line
        else:  # 1 of 61 records: 1.6%
            assert ": 1 (1.64%)" in line and "✗ over 1%: deduplicate" in line
            assert "line 21 ~ line 8, similarity" in out  # the copy, then the record it copies


# --- activations --------------------------------------------------------------------------------

def test_activations_healthy_model_has_no_issues():
    assert diagnose.check_activations(tiny_model(), random_batch()) == []


@pytest.mark.parametrize("layer, bad, weight_issue", [
    ("layers.1.attention.wq", float("nan"), "not finite"),
    ("layers.0.feed_forward.w2", 1e8, "std"),
])
def test_activations_name_the_layer_with_an_injected_bad_weight(layer, bad, weight_issue):
    model = tiny_model()
    with torch.no_grad():
        model.get_submodule(layer).weight[0, 0] = bad
    issues = diagnose.check_activations(model, random_batch())
    assert issues[0][0] == layer  # the first bad output is where the problem starts, not downstream
    assert any(name == f"{layer}.weight" and weight_issue in problem for name, problem in issues)
    assert not any(name.startswith("layers.0.attention") for name, _ in issues)  # upstream stays clean


# --- memory -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flash, grad_checkpoint, dtype", [(True, False, "float32"), (False, False, "float32"),
                                                           (True, True, "float32"), (True, False, "bfloat16"),
                                                           (False, False, "bfloat16"), (True, True, "bfloat16")])
@pytest.mark.parametrize("tile", [64, 8])  # the math path in one tile (T = 32) and in four
def test_memory_estimate_matches_what_autograd_saves(flash, grad_checkpoint, dtype, tile, monkeypatch):
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    monkeypatch.setattr(memory, "ATTENTION_TILE", tile)
    model = tiny_model(flash=flash, grad_checkpoint=grad_checkpoint)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")  # noqa: E731
    measured = memory.measure_memory(model, random_batch(batch_size=4), autocast)
    est = memory.estimate_memory(model.config, batch_size=4, dtype=dtype, device_type="cpu")
    assert est["n_params"] == model.num_params()
    assert (est["weights"], est["gradients"], est["adamw"]) == (measured["weights"], measured["gradients"], measured["adamw"])
    assert measured["activations"] == pytest.approx(est["activations"], rel=0.1)


# --- experts -----------------------------------------------------------------------------------

EXPERT_OF_ID = torch.tensor([0, 2, 1, 3])  # routed_checkpoint's router: token id -> expert, by id % 4


def routed_checkpoint(path, everything_to: dict[int, int] | None = None, **overrides) -> Transformer:
    """A tiny model with 4 experts, 1 per token, whose routing is set by hand: attention and experts add nothing, so
    every layer's input is the token embedding, whose dimensions 0, 1, 2 carry 1, (-1)^id and (-1)^(id // 2); a
    layer's router reads those to send token id to expert EXPERT_OF_ID[id % 4], or every token to
    everything_to[layer]."""
    model = tiny_model(n_experts=4, experts_per_token=1, **overrides)
    with torch.no_grad():
        ids, embedding = torch.arange(model.config.vocab_size), model.tok_embeddings.weight
        embedding[:, 0], embedding[:, 1], embedding[:, 2] = 1.0, 1.0 - 2 * (ids % 2), 1.0 - 2 * (ids // 2 % 2)
        for i, layer in enumerate(model.layers):
            layer.attention.wo.weight.zero_()
            for expert in layer.feed_forward.experts:
                expert.w2.weight.zero_()
            gate = layer.feed_forward.gate.weight  # (n_experts, dim)
            gate.zero_()
            if i in (everything_to or {}):
                gate[everything_to[i], 0] = 1.0
            else:  # expert 0: id % 4 == 0 (+, +); 1: 2 (+, -); 2: 1 (-, +); 3: 3 (-, -)
                gate[:, 1], gate[:, 2] = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([1.0, -1.0, 1.0, -1.0])
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, path)
    return model


def hand_count(batches: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([X.flatten() for X in batches])
    return torch.bincount(EXPERT_OF_ID[ids % 4], minlength=4).double() / ids.numel()


def the_batches(cfg: diagnose.Config, model, n: int, state=None) -> list[torch.Tensor]:
    next_batch = diagnose.batches(cfg, model.config, torch.device("cpu"), state)
    return [next_batch()[0] for _ in range(n)]


def test_expert_shares_equal_a_hand_count_and_the_verdict_names_the_collapsed_layer(tmp_path, capsys):
    model = routed_checkpoint(tmp_path / "moe.pt", everything_to={1: 2})
    cfg = diagnose.Config(batch_size=3, device="cpu", dtype="float32", ckpt=str(tmp_path / "moe.pt"))
    batches = the_batches(cfg, model, 4)
    shares = diagnose.expert_shares(model, iter((X,) for X in batches).__next__, 4)
    assert shares.tolist() == [pytest.approx(hand_count(batches).tolist()), [0.0, 0.0, 1.0, 0.0]]
    assert diagnose.collapsed_experts(shares, 1) == [(1, 0, 0.0), (1, 1, 0.0), (1, 2, 1.0), (1, 3, 0.0)]
    diagnose.main(["experts", f"--ckpt={cfg.ckpt}", "--device=cpu", "--dtype=float32", "--batch_size=3",
                   "--steps=4", f"--out_dir={tmp_path}"])  # the same batches: random tokens of the same seed
    out = capsys.readouterr().out.splitlines()
    (layer0,) = [line for line in out if line.startswith("    0 ")]
    assert layer0.split()[1:] == [f"{v:.1%}" for v in hand_count(batches).tolist()] and "✗" not in layer0
    (verdict,) = [line for line in out if line.startswith(("✓", "✗"))]
    assert verdict.startswith("✗ collapsed: layer 1: expert 0 0.0% starved, expert 1 0.0% starved, "
                              "expert 2 100.0% dominant, expert 3 0.0% starved (starved: under 1/(4 n_experts) = 6.25%")
    assert "layer 0" not in verdict and "dominant: over 81.25%" in verdict


def test_a_balanced_router_has_no_collapse_verdict_on_a_data_file(tmp_path, capsys):
    model = routed_checkpoint(tmp_path / "moe.pt", vocab_size=6400)  # the tokenizer's ids
    text = "the cat sat on the mat and 我们 学习 语言 with numbers 12 plus 7"
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"{text} {i}"}, ensure_ascii=False) + "\n"
                                                 for i in range(40)), encoding="utf-8")
    flags = ["--device=cpu", "--dtype=float32", "--batch_size=2", "--steps=5", f"--data_path={tmp_path / 'text.jsonl'}"]
    diagnose.main(["experts", f"--ckpt={tmp_path / 'moe.pt'}", *flags, f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    (verdict,) = [line for line in out.splitlines() if line.startswith(("✓", "✗"))]
    assert verdict.startswith("✓ no expert collapsed: every share within 6.25% .. 81.25%")
    assert not [line for line in out.splitlines() if line.lstrip()[:1].isdigit() and "✗" in line]  # no share marked
    cfg = diagnose.Config(batch_size=2, data_path=str(tmp_path / "text.jsonl"))
    batches = the_batches(cfg, model, 5, state={})  # the checkpoint's tokenizer, the same batches
    shares = diagnose.expert_shares(model, iter((X,) for X in batches).__next__, 5)
    assert shares.tolist() == [pytest.approx(hand_count(batches).tolist())] * 2


def test_experts_of_a_dense_checkpoint_is_one_clear_error(tmp_path):
    model = tiny_model()
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, tmp_path / "dense.pt")
    with pytest.raises(CheckpointError, match=r"dense.pt is a dense model \(n_experts = 0\): it has no experts"):
        diagnose.main(["experts", f"--ckpt={tmp_path / 'dense.pt'}", "--device=cpu", f"--out_dir={tmp_path}"])


# --- the command line ---------------------------------------------------------------------------

def test_command_line_reads_a_config_file_and_flags(tmp_path, capsys):
    config = tmp_path / "tiny.py"
    config.write_text("".join(f"{k} = {v}\n" for k, v in TINY.items()))
    common = [str(config), "--device=cpu", "--dtype=float32", f"--out_dir={tmp_path}"]
    diagnose.main(["overfit", *common, "--batch_size=4", "--lr=1e-2", "--steps=60"])
    assert "✓ pass" in capsys.readouterr().out
    diagnose.main(["lr_find", *common, "--batch_size=2", "--steps=30"])
    assert "suggested lr" in capsys.readouterr().out
    assert matplotlib.image.imread(tmp_path / "lr_find.png").shape[:2] == (400, 700)


def test_a_training_config_works_as_it_is_and_its_training_keys_are_named_once(tmp_path, capsys):
    demo = os.path.join(REPO, "configs", "demo.py")  # out_dir, data_path, val_fraction, max_steps, lr, ... model keys
    diagnose.main(["overfit", demo, *TINY_MODEL, "--data_path=None", "--device=cpu", "--dtype=float32",
                   "--batch_size=2", "--steps=3", f"--out_dir={tmp_path / 'diag'}"])
    out = capsys.readouterr().out
    (ignoring,) = [line for line in out.splitlines() if line.startswith("ignoring training keys")]
    ignored = ignoring.split(": ", 1)[1].split(", ")
    assert {"val_fraction", "max_steps", "warmup_steps", "eval_interval"} <= set(ignored)
    assert not {"lr", "batch_size", "accum_steps", "optimizer", "out_dir", "data_path", "dim", "flash"} & set(ignored)
    # the flags' tiny shape over the file's, with the default vocab_size (the file sets none)
    n_params = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)).num_params()
    assert f"{n_params:,} parameters; batches of 2 x 32 random tokens" in out
    assert (tmp_path / "diag").is_dir()


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "diagnose.py", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("args", [["--help"], ["overfit", "--help"]])
def test_help_lists_the_commands_and_every_key_with_its_default(args):
    done = run_script(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python diagnose.py {overfit|lr_find|data|activations|memory|batch_size|experts}")
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  --")}
    assert {"--steps=100", "--lr=0.001", "--n_kv_heads=2"} <= listed  # diagnose's keys and the model's
    assert "val_fraction" in done.stdout.splitlines()[-1]  # the training keys it accepts and ignores
    assert "ignoring" not in done.stdout  # nothing ran


@pytest.mark.parametrize("args, named", [(["overfit", "--stpes=5"], "'stpes'"), ([], "usage: python diagnose.py {")])
def test_a_user_mistake_is_one_error_line_and_exit_status_2(args, named):
    done = run_script(*args)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ") and named in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, named", [(["overfit", "--steps=many"], "'steps'"),
                                         (["configs/demo.py"], "'configs/demo.py' is not a command"),
                                         (["experts", "--device=cpu"], "needs --ckpt")])
def test_a_wrong_value_or_a_missing_command_is_a_config_error(args, named):
    with pytest.raises(ConfigError, match=named):
        diagnose.main(args)
