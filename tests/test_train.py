"""The pretraining loop: the loss falls and the schedule steps once per optimizer step, two DDP processes equal one
with the same global batch, non-finite steps are skipped, named, and stop the run."""
import pytest
import torch

import train_pretrain
from conftest import final_weights, pretrain, pretrain_ddp_matches_one_process, read_metrics
from errors import NonFiniteError
from model import Transformer
from optim import get_lr


def test_loss_falls_and_the_schedule_steps_once_per_optimizer_step(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=40", "--accum_steps=2", "--batch_size=4", "--warmup_steps=0",
             "--warmup_ratio=0.25", "--eval_interval=20")
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for r in rows:  # the row of step s reports the lr its update used: get_lr(s - 1), warmup 10 = 0.25 * 40
        assert r["lr"] == pytest.approx(get_lr(r["step"] - 1, lr=3e-3, min_lr=1e-5, warmup_steps=10, max_steps=40))
    val = [r["val_loss"] for r in read_metrics(tmp_path) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    assert sum(r["loss"] for r in rows[-5:]) < 0.8 * sum(r["loss"] for r in rows[:5])


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(demo_dir, tmp_path):
    ckpt = pretrain_ddp_matches_one_process(demo_dir, tmp_path)
    assert len(ckpt["rng"]) == 2


def poisoned_model(bad_steps: set[int]):
    """The real model, whose tok_embeddings gradient is NaN in the backward passes of bad_steps (1-based; one
    backward per step here): a non-finite step by construction, not by one CPU's rounding of a diverging run."""

    class Poisoned(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.backwards = 0
            self.tok_embeddings.weight.register_hook(self.poison)

        def poison(self, grad):
            self.backwards += 1
            return grad * float("nan") if self.backwards in bad_steps else grad

    return Poisoned


@pytest.mark.parametrize("flash, optimizer", [(True, "adamw"), (False, "adamw"), (False, "muon")])
def test_non_finite_steps_are_skipped_named_and_then_stop_the_run(demo_dir, tmp_path, capsys, monkeypatch, flash,
                                                                  optimizer):
    monkeypatch.setattr(train_pretrain, "Transformer", poisoned_model({3, 5, 6, 7}))
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row"):
        pretrain(demo_dir, tmp_path, "--max_steps=20", "--max_bad_steps=3", "--save_interval=1", "--keep_checkpoints=100",
                 f"--flash={flash}", f"--optimizer={optimizer}")
    out = capsys.readouterr().out
    assert "step 3: 1 update(s) skipped" in out and "step 5: 1 update(s) skipped" in out
    assert "first non-finite gradient in tok_embeddings.weight" in out
    # step 4 was good again: the count in a row starts over, and the run stops at step 7, the third in a row
    assert [r["skipped_steps"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 0, 1, 1, 2, 3]
    weights = {step: final_weights(tmp_path, step) for step in range(1, 7)}
    for before, after, changed in ((2, 3, False), (3, 4, True), (4, 5, False), (5, 6, False)):
        assert all(torch.equal(weights[before][k], weights[after][k]) for k in weights[before]) != changed
    moments = [torch.load(tmp_path / f"step_000000{step}.pt", weights_only=False)["optimizer"]["state"]
               for step in (2, 3)]  # a skipped step leaves AdamW's moments and Muon's momentum as they were
    assert all(torch.equal(a, moments[1][i][key]) for i, s in moments[0].items() for key, a in s.items()
               if torch.is_tensor(a))
