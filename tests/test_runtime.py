"""runtime.py: device=auto and dtype=auto pick what the machine runs well; an explicit device or dtype is kept."""
import pytest
import torch

from runtime import pick_device, pick_dtype


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
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: bf16 and (major, minor) == (14, 0))
    assert pick_dtype("auto", device) == expected
    assert pick_dtype("float32", device) == "float32"
