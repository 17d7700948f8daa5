"""Checkpoints that cannot be used are refused with a clear error and harm nothing: an out_dir that already holds
checkpoints, a truncated or unreadable checkpoint, weights of another shape."""
import os

import pytest

from checkpoint import load_checkpoint, load_model_state
from conftest import TINY_RUN, pretrain, run_script
from errors import CheckpointError, ConfigError, TokenizerError
from model import ModelConfig, Transformer


def test_a_fresh_run_refuses_an_out_dir_with_checkpoints(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=2")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        pretrain(demo_dir, tmp_path, "--max_steps=2")
    assert sorted(os.listdir(tmp_path)) == before


def test_an_out_dir_holding_checkpoints_is_an_error_line_and_nothing_is_touched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "step_0000005.pt").write_bytes(b"not really a checkpoint")
    (out / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    result = run_script("train_pretrain.py", f"--out_dir={out}", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {out} already holds checkpoints (step_0000005.pt): pass --resume=True")
    assert (out / "step_0000005.pt").read_bytes() == b"not really a checkpoint"
    assert (out / "metrics.jsonl").read_text() == '{"step": 5, "loss": 1.0}\n'


def test_a_truncated_checkpoint_is_a_clear_error_and_the_previous_one_survives(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path, "--max_steps=6", "--save_interval=3", "--eval_interval=100")
    latest = tmp_path / "step_0000006.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step_0000006\.pt is not a readable checkpoint.*step_0000003\.pt"):
        pretrain(demo_dir, tmp_path, "--max_steps=6", "--resume=True")
    assert load_checkpoint(str(tmp_path / "step_0000003.pt"))["step"] == 3


def test_an_unreadable_init_checkpoint_is_an_error_line(tmp_path):
    (tmp_path / "broken.pt").write_bytes(b"\x00" * 100)
    result = run_script("train_sft.py", f"--init_from={tmp_path}/broken.pt", f"--out_dir={tmp_path}/out", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {tmp_path}/broken.pt is not a readable checkpoint")


def test_weights_of_another_shape_are_an_error_naming_the_keys():
    small = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    other = Transformer(ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=64, max_seq_len=16))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attention\.wq\.weight.*layers\.0\.attention\.wk\.weight"):
        load_model_state(small, other.state_dict(), "other.pt")


@pytest.mark.parametrize("recorded", ["tokenizer/nanomind", "tokenizer/minimind", "ROOT/tokenizer/nanomind"])
def test_a_checkpoint_naming_the_old_tokenizer_folder_still_loads(recorded, tmp_path, monkeypatch):
    """The shipped tokenizers moved from tokenizer/ to vocab/: a checkpoint that recorded the old folder (relative,
    as configs wrote it, or absolute) loads with the same tokenizer from the new one."""
    import torch

    from checkpoint import load_model
    from tokenizer import DEFAULT_DIR, load_tokenizer

    root = DEFAULT_DIR.parent.parent
    recorded = recorded.replace("ROOT", str(root))
    tok = load_tokenizer(DEFAULT_DIR.parent / recorded.rsplit("/", 1)[1])
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16))
    state = {"model": model.state_dict(), "model_config": vars(model.config), "stage": "sft", "step": 0,
             "config": {"tokenizer_path": recorded},
             "tokenizer": {"path": recorded, "fingerprint": tok.fingerprint, "chat_template": tok.chat_template}}
    torch.save(state, tmp_path / "old.pt")
    monkeypatch.chdir(root)  # where the run was started
    assert not (root / "tokenizer").exists()
    _, loaded, _ = load_model(str(tmp_path / "old.pt"))
    assert loaded.fingerprint == tok.fingerprint


@pytest.mark.parametrize("recorded", ["nanomind", "none", "minimind"])
def test_a_checkpoint_without_a_tokenizer_path_gets_the_default_of_its_day(recorded, tmp_path):
    """tokenizer_path None meant the default when the run was written: nanomind's own before MiniMind's took its
    place (told apart by the recorded fingerprint; a checkpoint older than the record is of nanomind's days).
    Sampling, serving, export and fine-tuning then use that tokenizer."""
    import torch

    from checkpoint import checkpoint_tokenizer, load_model, trained_tokenizer_path
    from tokenizer import DEFAULT_DIR, NANOMIND_DIR, load_tokenizer

    directory = DEFAULT_DIR if recorded == "minimind" else NANOMIND_DIR
    tok = load_tokenizer(directory)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16))
    state = {"model": model.state_dict(), "model_config": vars(model.config), "stage": "sft", "step": 0,
             "config": {"tokenizer_path": None}}
    if recorded != "none":
        state["tokenizer"] = {"path": None, "fingerprint": tok.fingerprint, "chat_template": tok.chat_template}
    torch.save(state, tmp_path / "old.pt")
    _, loaded, _ = load_model(str(tmp_path / "old.pt"))
    assert loaded.fingerprint == tok.fingerprint and loaded.chat_template == tok.chat_template
    assert trained_tokenizer_path(state) == (None if recorded == "minimind" else str(NANOMIND_DIR))
    with pytest.raises(TokenizerError, match="not the one the checkpoint was trained with"):
        checkpoint_tokenizer({**state, "tokenizer": {"path": None, "fingerprint": "0" * 16, "chat_template": None}})
