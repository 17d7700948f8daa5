"""runtime.py: device=auto and dtype=auto pick what the machine runs well; an explicit device or dtype is kept."""
import pytest
import torch
import torch.distributed as dist

import runtime
from model import ModelConfig, Transformer
from runtime import Run, pick_device, pick_dtype, setup, wrap


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert pick_device("auto") == expected
    assert pick_device("cpu") == "cpu" and pick_device("cuda:1") == "cuda:1"  # an explicit device is kept


@pytest.mark.parametrize("device, bf16, expected", [("cuda", True, "bfloat16"), ("cuda", False, "float16"),
                                                    ("mps", True, "bfloat16"), ("mps", False, "float16"),
                                                    ("cpu", True, "float32")])
def test_auto_dtype_is_what_the_device_runs_well(monkeypatch, device, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: bf16 and (major, minor) == (14, 0))
    assert pick_dtype("auto", device) == expected
    assert pick_dtype("float32", device) == "float32"


@pytest.mark.parametrize("major, expected", [(7, "float16"), (8, "bfloat16"), (9, "bfloat16")])
def test_auto_dtype_on_cuda_asks_torch_for_native_bfloat16(monkeypatch, major, expected):
    """torch's own capability query, given a GPU of compute capability `major` that can emulate bfloat16 (a V100
    or T4 is 7.x): native bfloat16 from 8.0 on (Ampere), else float16 with its GradScaler."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"major": major}))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    assert pick_dtype("auto", "cuda") == expected


def test_a_named_gpu_is_made_current_before_any_other_cuda_call(monkeypatch):
    """Without torchrun too: else CUDA events, the dtype query and every kernel use cuda:0. Float32 matmuls may
    use TF32 there."""
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # counting creates no context on cuda:0
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(("precision", p)))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: calls.append(("bf16?",)) or True)
    run = runtime.open_device("cuda:1", "auto")
    assert calls == [("set_device", torch.device("cuda", 1)), ("precision", "high"), ("bf16?",)]
    assert (run.device, run.dtype) == (torch.device("cuda", 1), "bfloat16")


def test_the_process_group_waits_for_rank_0_to_tokenise(monkeypatch):
    """Under torchrun, rank 0 tokenises the corpus alone (minutes to hours) while the others wait at a barrier:
    the group must not give up after NCCL's default 10 minutes."""
    joined = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(kw, backend=backend))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    run = setup("cpu", "auto", 0)
    assert (run.rank, run.world_size, joined["backend"]) == (1, 2, "gloo")
    assert joined["timeout"] == runtime.PROCESS_GROUP_TIMEOUT and joined["timeout"].total_seconds() >= 3600


def test_ddp_does_not_resend_the_rope_tables_every_forward(monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/rendezvous")
    try:
        model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
        cfg = type("Cfg", (), {"compile": False})
        wrapped = wrap(model, cfg, Run(torch.device("cpu"), "float32", world_size=2))
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and wrapped.forward_sync_buffers is False
        assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}  # all derived from the config
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device, compile, compiled", [("cuda", None, True), ("cpu", None, False),
                                                       ("cpu", True, True), ("cuda", False, False)])
def test_compile_by_default_on_cuda_only(device, compile, compiled):
    """compile=None (pretraining's default) compiles on CUDA, as nanoGPT does, not on a CPU, where a compile of
    minutes is paid back only after hundreds of steps (docs/performance.md). torch.compile is lazy: nothing runs."""
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    wrapped = wrap(model, type("Cfg", (), {"compile": compile}), Run(torch.device(device), "float32"))
    assert (wrapped is not model) == compiled and (wrapped._orig_mod is model if compiled else True)


def test_fine_tuning_does_not_compile_by_default():
    from config import DPOConfig, PretrainConfig, SFTConfig

    assert PretrainConfig().compile is None and SFTConfig().compile is False and DPOConfig().compile is False


def test_a_device_opens_as_a_script_opens_it_and_autocasts_in_its_dtype(device):
    """On each device this machine has: dtype=auto is pick_dtype's choice, autocast runs a matmul in it, and on
    CUDA float32 matmuls may use TF32 afterwards (the device fixture restores the precision)."""
    run = runtime.open_device(device, "auto")
    assert run.device.type == device and run.dtype == pick_dtype("auto", device)
    x = torch.randn(4, 8, device=run.device)
    with run.autocast():
        y = x @ x.T
    assert y.dtype == getattr(torch, run.dtype)
    if device == "cuda":
        assert torch.get_float32_matmul_precision() == "high"
