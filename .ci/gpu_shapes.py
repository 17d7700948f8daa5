"""What a shape seen for the first time costs on CUDA (a step of `bash .ci/gpu`). Generation grows the key length by
one every token and padded batches change length every step, so a kernel that is set up per shape pays that set-up
on every token: the first H200 run of .ci/gpu saw ~95 ms per new length in a 26m decode step (12 ms once seen) and
~0.75 s for a forward of a new (B, T). This times, per SDPA backend, a decode step's attention (1 query, GQA 8/2
heads, head_dim 64, bfloat16) at N new key lengths and again at the same lengths, a causal training-shaped call per
new T, and a matmul per new row count; and names the kernels the default choice ran (from the profiler).
Prints one JSON line. `python .ci/gpu_shapes.py [N] [cpu]`: cpu checks the script (GPU_DRY_RUN)."""
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
DEVICE, DTYPE = sys.argv[2] if len(sys.argv) > 2 else "cuda", torch.bfloat16
CUDA = DEVICE == "cuda"
BACKENDS = {"default": None, "flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
            "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}


def sync():
    if CUDA:
        torch.cuda.synchronize()


def ms(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return 1000 * (time.perf_counter() - t0)


def attention(backend, q, k, v, causal: bool, grouped: bool):
    def call():
        if BACKENDS[backend] is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped)
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped)
    return call


def first_and_again(make_calls) -> dict:
    """Median ms of each call the first time its shape is seen, and of the same calls again."""
    calls = make_calls()
    try:
        first = [ms(c) for c in calls]
    except RuntimeError as e:  # this backend cannot run the case
        return {"error": str(e).strip().split("\n")[0][:160]}
    again = [ms(c) for c in calls]
    return {"first_ms": round(statistics.median(first), 2), "again_ms": round(statistics.median(again), 2),
            "first_max_ms": round(max(first), 2)}


def kernels(call) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
        call()
        sync()
    return sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA" or "attention" in e.name})


def decode_calls(backend: str, start: int, grouped: bool):
    q = torch.randn(1, 8, 1, 64, device=DEVICE, dtype=DTYPE)
    kv = [torch.randn(1, 2 if grouped else 8, start + i, 64, device=DEVICE, dtype=DTYPE) for i in range(N)]
    return [attention(backend, q, k, k, False, grouped) for k in kv]


def train_calls(backend: str, start: int):
    qkv = [(torch.randn(8, 8, start + 16 * i, 64, device=DEVICE, dtype=DTYPE),
            torch.randn(8, 2, start + 16 * i, 64, device=DEVICE, dtype=DTYPE)) for i in range(N)]
    return [attention(backend, q, k, k, True, True) for q, k in qkv]


def main():
    torch.zeros(1, device=DEVICE)
    w = torch.randn(512, 1408, device=DEVICE, dtype=DTYPE)
    ms(lambda: torch.randn(64, 512, device=DEVICE, dtype=DTYPE) @ w)  # CUDA, cuBLAS and the RNG set up
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if CUDA else DEVICE,
              "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset)"),
              "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), "new_shapes": N}
    # each backend its own lengths, so that none finds a shape another backend has already set up
    for i, backend in enumerate(BACKENDS):
        result[f"decode_gqa_{backend}"] = first_and_again(lambda: decode_calls(backend, 100 + 100 * i, True))
        result[f"decode_repeated_{backend}"] = first_and_again(lambda: decode_calls(backend, 700 + 100 * i, False))
        result[f"train_causal_{backend}"] = first_and_again(lambda: train_calls(backend, 64 + 256 * i))
    xs = [torch.randn(1000 + i, 512, device=DEVICE, dtype=DTYPE) for i in range(N)]
    result["matmul"] = first_and_again(lambda: [lambda x=x: x @ w for x in xs])
    result["default_kernels_decode_gqa"] = kernels(decode_calls("default", 5000, True)[0])
    result["default_kernels_train_causal"] = kernels(train_calls("default", 1500)[0])
    for key, value in result.items():
        print(f"{key}: {value}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
