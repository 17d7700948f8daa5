"""batch_size x accum_steps x ranks is one big batch: the same losses, gradient norms and weights whichever way
the global batch is split. max_grad_norm=0 (no clipping), so a gradient off by any factor shows in the weights."""
import os
import subprocess
import sys

import pytest
import torch

import train_pretrain
import train_sft
from conftest import REPO, TINY_MODEL, TINY_RUN, final_weights, read_metrics

STEPS = 4


def stage_args(stage, demo_dir, tiny_pretrained):
    common = [*TINY_RUN, "--max_grad_norm=0", f"--max_steps={STEPS}", "--eval_interval=100", "--save_interval=100"]
    if stage == "pretrain":
        return [f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, "--lr=3e-3", "--warmup_steps=2", *common]
    # SFT: rows packed with conversations of different lengths, so micro-batches hold different numbers of answer
    # tokens; padded: a conversation per row
    return [f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", "--max_seq_len=64", "--lr=3e-3",
            "--warmup_ratio=0.5", *common, *(["--pack=False"] if stage == "sft_padded" else [])]


def run_split(stage, args, out_dir, batch_size, accum_steps, ranks):
    args = [*args, f"--batch_size={batch_size}", f"--accum_steps={accum_steps}", f"--out_dir={out_dir}"]
    script = {"pretrain": train_pretrain, "sft": train_sft, "sft_padded": train_sft}[stage]
    if ranks == 1:
        script.main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.join(REPO, script.__file__), *args]
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("stage", ["pretrain", "sft", "sft_padded"])
def test_batch_4_equals_2_x_accum_2_equals_2_ranks_x_1_x_accum_2(stage, demo_dir, tiny_pretrained, tmp_path):
    args = stage_args(stage, demo_dir, tiny_pretrained)
    splits = {"4x1": (4, 1, 1), "2x2": (2, 2, 1), "2 ranks x 1x2": (1, 2, 2)}
    rows, weights = {}, {}
    for name, (batch_size, accum_steps, ranks) in splits.items():
        run_split(stage, args, tmp_path / name, batch_size, accum_steps, ranks)
        rows[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        weights[name] = final_weights(tmp_path / name, STEPS)
    one = rows["4x1"]
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    for name in ("2x2", "2 ranks x 1x2"):
        for a, b in zip(one, rows[name], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (name, a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (name, a["step"])
        diff = max((weights["4x1"][k] - weights[name][k]).abs().max().item() for k in weights["4x1"])
        assert diff <= 1e-5, (name, diff)
    assert all(r["grad_norm"] > 0 for r in one)  # every step updates: the runs agree on training, not on nothing


def test_sft_micro_batches_hold_different_numbers_of_answer_tokens(demo_dir, tiny_pretrained, tmp_path):
    """The premise of the SFT case above: a mean of micro-batch means would differ from the one big batch."""
    from data import Loader, PackedSFTData
    from token_cache import load_split
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    records, _ = load_split(f"{demo_dir}/sft.jsonl", None, 0.05, tokenizer, "sft", max_len=65, verbose=False)
    loader = Loader(PackedSFTData(records, 64), 2, tokenizer.pad_id, seed=1337)  # rows of 64, as the run's
    counts = [loader.next_batch()[2].sum().item() for _ in range(2 * STEPS)]
    assert len(set(counts)) > 1


def test_logged_sft_loss_is_the_token_weighted_mean(tiny_pretrained, demo_dir, tmp_path):
    """With accumulation, the logged step loss is sum(cross-entropy over answer tokens) / their number, as
    computed here from the checkpoint the run started from and the batches its loader gives."""
    from checkpoint import model_from_checkpoint
    from data import Loader, PackedSFTData
    from token_cache import load_split
    from tokenizer import load_tokenizer

    args = stage_args("sft", demo_dir, tiny_pretrained)
    run_split("sft", [a for a in args if not a.startswith("--max_steps")] + ["--max_steps=1"], tmp_path / "run",
              2, 3, 1)
    (row,) = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    tokenizer = load_tokenizer()
    records, _ = load_split(f"{demo_dir}/sft.jsonl", None, 0.05, tokenizer, "sft", max_len=65, verbose=False)
    loader = Loader(PackedSFTData(records, 64), 2, tokenizer.pad_id, seed=1337)  # rows of 64, as the run's
    model, _ = model_from_checkpoint(str(tiny_pretrained))
    total, n = 0.0, 0.0
    with torch.no_grad():
        for _ in range(3):
            X, Y, M, _, positions, *_ = loader.next_batch()
            total += model(X, Y, M, reduction="sum", positions=positions)[1].item()
            n += M.sum().item()
    assert row["loss"] == pytest.approx(total / n, rel=1e-5)
