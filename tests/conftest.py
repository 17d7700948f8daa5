import json
import os

import pytest
import torch

import prepare_demo

# every in-process training run in the tests: a tiny model, float32 on the CPU, a fixed MFU peak
TINY_MODEL = ["--dim=32", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", "--max_seq_len=32"]
TINY_RUN = ["--device=cpu", "--dtype=float32", "--peak_flops=1e12", "--log_interval=1", "--eval_steps=2"]


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A small copy of the demo data set (the generator is seeded, so it is the same every session)."""
    out = tmp_path_factory.mktemp("demo")
    prepare_demo.main(["--out_dir", str(out), "--pretrain_docs", "2000", "--sft", "600", "--dpo", "300"])
    return out


def greedy_alone(model, prompt: list[int], max_new: int, eos_id: int | None = None) -> list[int]:
    """The model's greedy continuation of one prompt, generated alone: up to max_new ids, eos_id last if it ends
    there."""
    from engine import generate

    for (row,) in generate(model, [prompt], max_new, eos_id=eos_id):
        pass
    return row.tokens


def read_metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def final_weights(out_dir, step: int) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out_dir, f"step_{step:07d}.pt"), weights_only=False)["model"]


@pytest.fixture(scope="session")
def tiny_pretrained(demo_dir, tmp_path_factory):
    """A tiny model pretrained for a few dozen steps on the demo text: the starting point of SFT tests."""
    import train_pretrain

    out = tmp_path_factory.mktemp("pretrain")
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out}", *TINY_MODEL, *TINY_RUN,
                         "--batch_size=16", "--lr=1e-2", "--warmup_steps=5", "--max_steps=60", "--eval_interval=60",
                         "--max_seq_len=64"])
    return out / "best.pt"


@pytest.fixture(scope="session")
def tiny_sft(demo_dir, tiny_pretrained, tmp_path_factory):
    """The tiny model after a short SFT on the demo conversations: the starting point of DPO tests."""
    import train_sft

    out = tmp_path_factory.mktemp("sft")
    train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out}",
                    *TINY_RUN, "--batch_size=16", "--lr=5e-3", "--max_steps=60", "--eval_interval=60",
                    "--max_seq_len=64"])
    return out / "best.pt"
