"""The paths that only a GPU takes, on every device this machine has (conftest.DEVICES): attention in bfloat16 and
float16 against the float32 reference with grouped heads, CUDA's fused SDPA kernels (never its math fallback),
float16 training with its GradScaler, torch.compile against eager, and DDP over NCCL on two GPUs. The other tests
that prove a path on each device are the existing ones, taking the `device` fixture (`bash .ci/gpu` runs them all
on CUDA)."""
import json
import math
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import model as model_py
from checkpoint import load_checkpoint
from conftest import (REPO, TINY_MODEL, TINY_RUN, TOLERANCES, final_weights, on_device, pretrain_short, start_server,
                      tiny, train_losses)
from model import reference_attention
from test_model import attention_inputs

LOW_PRECISION = ["bfloat16", "float16"]


def not_on_the_cpu(device: str, why: str):
    if device == "cpu":
        pytest.skip(f"GPU only on this path ({why})")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("start_pos", [0, 7, "per row"])
def test_low_precision_attention_equals_the_float32_reference(dtype, flash, start_pos, device):
    """Both paths in autocast's dtypes, 4 query heads on 2 kv heads: on CUDA a prefill in bfloat16 or float16 is
    the flash kernel reading the grouped heads itself (enable_gqa), a masked one the memory-efficient kernel."""
    attention = tiny(flash=flash).layers[0].attention
    q, k, v, start = attention_inputs(start_pos, device, getattr(torch, dtype))
    attend = attention.sdpa_attention if flash else attention.math_attention
    out = attend(q, k, v, start, 0.0)
    assert out.dtype == q.dtype
    # the reference reads the same rounded inputs in float32: what differs is the kernels' own rounding
    assert (out.float() - reference_attention(q, k, v, start)).abs().max() <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", ["float32", *LOW_PRECISION])
@pytest.mark.parametrize("start_pos", [0, 7, "per row"])
def test_cuda_attention_runs_a_fused_kernel_never_sdpa_s_math_fallback(dtype, start_pos, device):
    """model.kernel_takes_groups' claim, checked against the kernels themselves: where it says the kernel takes the
    grouped heads, the flash kernel alone runs them; elsewhere the flash or memory-efficient kernel runs them
    repeated. Forward and backward, against the reference (float32 matmuls in IEEE float32: the device fixture)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        pytest.skip("CUDA's fused SDPA kernels only")
    attention = tiny(flash=True).layers[0].attention
    q, k, v, start = attention_inputs(start_pos, "cuda", getattr(torch, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grouped = model_py.kernel_takes_groups(q, None if start_pos == 0 else True)
    assert grouped == (start_pos == 0 and dtype != "float32"), "flash takes groups, unmasked, in 16 bits"
    fused = [SDPBackend.FLASH_ATTENTION] if grouped else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):  # raises "No available kernel" if only the math fallback could run it
        out = attention.sdpa_attention(q, k, v, start, 0.0)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = reference_attention(q, k, v, start)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    tol = TOLERANCES[dtype]
    assert (out.float() - ref).abs().max() <= tol
    for g, r in zip(grads, ref_grads):  # gradients of order 1..10: relative
        assert (g.float() - r.float()).abs().max() <= 4 * tol * max(1.0, r.float().abs().max().item())


def relative_gaps(a: dict, b: dict) -> list[float]:
    assert set(a) == set(b)
    return [abs(a[s] - b[s]) / b[s] for s in b]


def test_float16_with_its_grad_scaler_trains_like_float32(request, tmp_path, device):
    """The GradScaler on (its state saved), every step taken (no overflow left unhandled), the losses those of
    float32. On a CPU float16 is emulated: tests/test_resume.py and tests/test_muon.py run it there."""
    not_on_the_cpu(device, "float16 on a CPU: tests/test_resume.py, tests/test_muon.py")
    demo_dir = request.getfixturevalue("demo_dir")  # after the skip: a CPU run builds nothing
    flags = on_device(device, "--lr=1e-2", "--max_steps=30", "--eval_interval=30", "--save_interval=30")
    pretrain_short(demo_dir, tmp_path / "fp32", *flags)
    pretrain_short(demo_dir, tmp_path / "fp16", *flags, "--dtype=float16")
    fp32, fp16 = train_losses(tmp_path / "fp32"), train_losses(tmp_path / "fp16")
    assert set(fp16) == set(range(1, 31)) and all(math.isfinite(v) for v in fp16.values())
    assert max(relative_gaps(fp16, fp32)) < 5e-3  # as bfloat16's in tests/test_precision.py, with 3 more bits
    assert fp16[30] < 0.8 * fp16[1]
    ckpt = load_checkpoint(str(tmp_path / "fp16" / "step_0000030.pt"))
    assert ckpt["scaler"].get("scale", 0) > 0, ckpt["scaler"]  # enabled: a disabled scaler saves {}


def test_compiled_and_eager_training_give_the_same_losses(request, tmp_path, device):
    """torch.compile (the default on CUDA) against eager, in bfloat16 with SDPA: the same losses within
    bfloat16's tolerance, step by step, and the same checkpoint keys (saved from the unwrapped model)."""
    if device != "cuda":
        pytest.skip("compile is on by default on CUDA only (on a 2-core CPU it takes minutes; MPS: experimental)")
    demo_dir = request.getfixturevalue("demo_dir")
    flags = on_device(device, "--dtype=bfloat16", "--lr=1e-2", "--max_steps=6", "--eval_interval=6", "--save_interval=6")
    pretrain_short(demo_dir, tmp_path / "eager", *flags)
    pretrain_short(demo_dir, tmp_path / "compiled", *flags, "--compile=True")
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert max(relative_gaps(compiled, eager)) <= TOLERANCES["bfloat16"]
    assert eager[6] < eager[1] and compiled[6] < compiled[1]
    a, b = final_weights(tmp_path / "eager", 6), final_weights(tmp_path / "compiled", 6)
    assert a.keys() == b.keys()  # no "_orig_mod." prefix: the unwrapped model was saved


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two GPUs")
def test_two_gpus_under_nccl_match_one(demo_dir, tmp_path):
    """train_pretrain.py under torchrun on 2 GPUs (NCCL), batch 2 each, against batch 4 on one GPU, accumulation 2:
    the same losses within TF32's tolerance (the shapes differ, so the roundings do; the weights are not compared:
    Adam turns a rounding in a near-zero gradient into a step of lr either way), the two ranks' weights identical."""
    common = [f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, *TINY_RUN, "--lr=3e-3", "--warmup_steps=3",
              "--max_steps=5", "--accum_steps=2", "--device=cuda", "--compile=False", "--flash=False"]
    single = subprocess.run([sys.executable, "train_pretrain.py", *common, "--batch_size=4",
                             f"--out_dir={tmp_path / 'single'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_pretrain.py",
           *common, "--batch_size=2", f"--out_dir={tmp_path / 'ddp'}"]
    ddp = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert max(relative_gaps(b, a)) <= TOLERANCES["tf32"]
    ckpt = load_checkpoint(str(tmp_path / "ddp" / "step_0000005.pt"))
    assert ckpt["rank_weight_diff"] == 0.0  # both ranks hold identical weights
    assert ckpt["model"].keys() == final_weights(tmp_path / "single", 5).keys()


def chat(url: str, **options) -> dict:
    """One chat completion from the server (urllib: the openai client is a test-only extra a GPU machine may lack)."""
    body = {"messages": [{"role": "user", "content": "What is the capital of Kenya?"}], "max_tokens": 12, **options}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def test_the_server_samples_with_a_generator_on_its_device(request, device):
    """serve.py on the device, in the dtype it picks there: a seeded sampled request repeats its answer (its
    generator lives on the device: a CPU one failed every sampled request on a GPU), and 8 at once are answered."""
    not_on_the_cpu(device, "tests/test_serve.py serves on the CPU")
    tiny_sft = request.getfixturevalue("tiny_sft")  # after the skip: a CPU run trains nothing
    proc, url, _ = start_server(tiny_sft, f"--device={device}", "--max_batch=8")
    try:
        sampled = [chat(url, temperature=1.0, top_p=0.9, seed=7)["choices"][0] for _ in range(3)]
        with ThreadPoolExecutor(8) as pool:  # decoded together in one batch
            others = [c["choices"][0]["message"]["content"]
                      for c in pool.map(lambda seed: chat(url, temperature=1.0, seed=seed), range(8))]
    finally:
        proc.terminate()
        proc.wait()
    assert len({c["message"]["content"] for c in sampled}) == 1 and sampled[0]["finish_reason"] in ("stop", "length")
    assert len(set(others)) > 1  # other seeds, other answers: it did sample
