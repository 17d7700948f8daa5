"""LoRA: a fresh adapter is the base model exactly, training moves only the adapters, a checkpoint holds only them and
loads merged onto its (digest-checked) base with the same logits; the adapters-off DPO reference is the base model."""
import copy
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import convert
import train_dpo
from checkpoint import finetune_model, load_checkpoint, lora_model, model_from_checkpoint
from config import SFTConfig, load_config
from conftest import LORA, REPO, TINY_RUN, lora_sft, read_metrics
from data import DPOData, Loader
from errors import CheckpointError, ConfigError
from lora import adapter_state, adapters_off, add_lora, lora_layers
from model import ModelConfig, Transformer
from optim import configure_optimizer
from runtime import setup
from token_cache import tokenize_file
from tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def trained(tiny_pretrained, demo_dir, tmp_path_factory):
    """A copy of the tiny pretrained model, and LoRA adapters trained on it for 6 steps (checkpoint at step 6)."""
    tmp = tmp_path_factory.mktemp("lora")
    base = tmp / "base.pt"
    shutil.copy(tiny_pretrained, base)
    lora_sft(base, demo_dir, tmp / "run", "--max_steps=6", "--eval_interval=6")
    return base, tmp / "run" / "step_0000006.pt"


def tokens(n=2, T=24):
    return torch.randint(6400, (n, T), generator=torch.Generator().manual_seed(0))


def test_a_fresh_adapter_is_exactly_the_base_model(device):
    base = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)).to(device)
    adapted = add_lora(copy.deepcopy(base), rank=4, alpha=8.0, dropout=0.0)
    X = tokens().to(device)
    assert len(lora_layers(adapted)) == 2 * 7
    assert torch.equal(adapted(X, X)[0], base(X, X)[0])  # B = 0: not close, equal
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state(adapted)) and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)


def test_training_steps_change_the_adapters_and_nothing_else(tiny_pretrained, device):
    # weight decay on: a frozen weight that reached the optimizer would move even without a gradient
    (cfg,) = load_config([f"--init_from={tiny_pretrained}", *LORA, "--weight_decay=0.1", "--dropout=0.1"],
                         SFTConfig)
    model = finetune_model(cfg, setup(device, "float32", 0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = configure_optimizer(model, 0.1, 1e-2, (0.9, 0.95), device)  # fused AdamW on every device
    X = tokens().to(device)
    for _ in range(2):  # step 1 moves B only (A's gradient is B^T ... = 0); step 2 moves A too
        model(X, X)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == set(adapter_state(model))


def test_a_lora_checkpoint_holds_adapters_and_loads_merged_with_the_unmerged_logits(trained):
    base, ckpt = trained
    state = load_checkpoint(str(ckpt))
    assert set(state["model"]) == set(adapter_state(lora_model(state, str(ckpt))))
    assert state["lora"]["base"] == str(base) and os.path.getsize(ckpt) < os.path.getsize(base) / 4
    unmerged, (merged, _), (plain, _) = lora_model(state, str(ckpt)), model_from_checkpoint(str(ckpt)), \
        model_from_checkpoint(str(base))
    assert not lora_layers(merged) and isinstance(merged.layers[0].attention.wq, torch.nn.Linear)
    X = tokens()
    logits = unmerged.eval()(X, X)[0]
    assert torch.allclose(merged.eval()(X, X)[0], logits, atol=1e-5)
    assert (plain.eval()(X, X)[0] - logits).abs().max() > 1e-2  # the adapters did learn something
    with adapters_off(unmerged):
        assert torch.equal(unmerged(X, X)[0], plain(X, X)[0])


def test_convert_merge_writes_a_full_checkpoint_with_the_same_logits(trained, tmp_path):
    base, ckpt = trained
    out = tmp_path / "merged.pt"
    convert.main(["merge", str(ckpt), str(out)])
    state = load_checkpoint(str(out))
    assert "lora" not in state and state["stage"] == "sft"
    X = tokens()
    merged, _ = model_from_checkpoint(str(out))
    assert torch.equal(merged(X, X)[0], model_from_checkpoint(str(ckpt))[0](X, X)[0])
    with pytest.raises(ConfigError, match="merged.pt already exists"):  # nothing already written is overwritten
        convert.main(["merge", str(ckpt), str(out)])


def test_a_changed_base_checkpoint_is_a_one_line_error(trained, tmp_path):
    base, ckpt = trained
    moved = tmp_path / "lora.pt"
    state = load_checkpoint(str(ckpt))
    other = tmp_path / "other_base.pt"
    weights = load_checkpoint(str(base))
    weights["model"]["norm.weight"] += 1e-3
    torch.save(weights, other)
    state["lora"]["base"] = str(other)
    torch.save(state, moved)
    with pytest.raises(CheckpointError, match=r"lora\.pt holds LoRA adapters trained on another .*other_base\.pt"):
        model_from_checkpoint(str(moved))
    done = subprocess.run([sys.executable, "sample.py", f"--ckpt={moved}", "--prompt=hi"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert "digest" in done.stderr


def test_the_adapters_off_reference_is_the_base_model(tiny_sft, demo_dir):
    tok = load_tokenizer()
    pairs = DPOData(tokenize_file(f"{demo_dir}/dpo.jsonl", tok, "dpo", max_prompt_length=32,
                                  max_completion_length=32, verbose=False))
    batch = next(iter(Loader(pairs, 8, tok.pad_id).batches(1)))
    base, _ = model_from_checkpoint(str(tiny_sft), dropout=0.1)
    policy = add_lora(copy.deepcopy(base), rank=4, alpha=8.0, dropout=0.1)
    for layer in lora_layers(policy):  # trained-looking adapters, and the policy in train mode (dropout on)
        torch.nn.init.normal_(layer.lora_b, std=0.1)
    reference = train_dpo.Reference(policy, None, length_norm=False, adapters_off=True)
    expected = train_dpo.pair_logprobs(base.eval(), batch, length_norm=False)
    got = reference.logprobs(batch, "train")
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert policy.training and all(layer.enabled for layer in lora_layers(policy))  # switched back on


def test_lora_dpo_starts_at_ln2_with_no_second_model(tiny_sft, demo_dir, tmp_path, monkeypatch):
    """The adapters-off reference: the first loss is ln 2 exactly; and the adapters learn 16 preference pairs, so
    that the DPO loss on those very pairs ends well below ln 2."""
    monkeypatch.setattr(train_dpo, "frozen_model", None)  # a separate reference model would fail to load
    pairs, out = tmp_path / "dpo_16.jsonl", tmp_path / "run"
    with open(demo_dir / "dpo.jsonl", encoding="utf-8") as f:
        pairs.write_text("".join(f.readlines()[:16]), encoding="utf-8")
    train_dpo.main([f"--init_from={tiny_sft}", f"--data_path={pairs}", f"--val_data_path={pairs}", f"--out_dir={out}",
                    *TINY_RUN, "--batch_size=8", "--lr=1e-2", "--warmup_steps=0", "--max_prompt_length=32",
                    "--max_completion_length=32", "--max_steps=60", "--eval_interval=60",
                    "--early_stopping_patience=1000", *LORA])  # every epoch's end evaluates: no early stop
    rows = read_metrics(out)
    losses = [r for r in rows if "loss" in r]
    assert losses[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and losses[0]["reward_margin"] == 0.0
    assert len(losses) == 60 and [r for r in rows if "val_loss" in r][-1]["val_loss"] < 0.75 * math.log(2)
    assert "lora" in load_checkpoint(str(out / "step_0000060.pt"))
