"""convert.py export --dtype=q8_0|q4_0|q4_k: gguf_quant.py's blocks are byte for byte those of the gguf package and
of ggml's own C code (called in llama.cpp's library), awkward rows included; every tensor of an exported file is in
the type of the mix gguf_export.py states, and reads back through the gguf package as nanomind dequantizes it;
llama.cpp's own quantizer (llama_model_quantize) turns the float32 export into the same type and the same bytes for
every tensor; llama.cpp runs each file within a measured distance of the float32 model, a distance a broken
quantizer exceeds; a bad dtype is one line naming the key."""
import contextlib
import ctypes
import os
import random

import gguf
import llama_cpp
import numpy as np
import pytest
import torch

import convert
import gguf_quant
from checkpoint import atomic_save, model_from_checkpoint
from conftest import corpus_lines
from errors import ConfigError
from gguf_export import quant_type
from gguf_quant import BLOCKS, NAMES, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, dequantize, quantize
from model import ModelConfig
from test_export import MINIMIND_TOKENIZER, MIXED, TINY, nanomind_logits, random_checkpoint
from test_gguf import llama
from tokenizer import load_tokenizer

DTYPES = ["q8_0", "q4_0", "q4_k"]
LLAMA_FTYPES = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
WIDE = dict(dim=256, n_layers=4, vocab_size=6400, max_seq_len=64)  # rows of 256: the K types' super-block
SHAPES = {
    "llama_tied_gqa": WIDE | dict(n_heads=4, n_kv_heads=2, ffn_dim=384),  # ffn_down rows of 384: K types fall back
    "qwen3_untied": WIDE | dict(n_heads=4, n_kv_heads=4, head_dim=64, qk_norm=True, tie_embeddings=False,
                                norm_eps=1e-6, ffn_dim=256),
    "qwen3moe": WIDE | dict(n_heads=4, n_kv_heads=2, qk_norm=True, n_experts=4, experts_per_token=2, moe_ffn_dim=256),
    "llama_8_experts": WIDE | dict(n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, experts_per_token=2,
                                   moe_ffn_dim=256),  # Mixtral's count: attn_k / attn_v Q8_0, attn_output Q5_K
    "narrow": dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=6400, max_seq_len=64),
}
# The mix each file holds, as gguf_export.py states it, per tensor role: a type, or (type, type on the
# use_more_bits layers: 2 and 3 of 4 layers, 1 of 2); "*" every other 2-D weight. Norms and routers are F32.
MIX = {
    "llama_tied_gqa": {"q8_0": {"*": "Q8_0"}, "q4_0": {"token_embd": "Q6_K", "*": "Q4_0"},
                       "q4_k": {"token_embd": "Q6_K", "attn_v": ("Q4_K", "Q6_K"), "ffn_down": ("Q5_0", "Q8_0"),
                                "*": "Q4_K"}},
    "qwen3_untied": {"q8_0": {"*": "Q8_0"}, "q4_0": {"output": "Q6_K", "*": "Q4_0"},
                     "q4_k": {"output": "Q6_K", "attn_v": ("Q4_K", "Q6_K"), "ffn_down": ("Q4_K", "Q6_K"),
                              "*": "Q4_K"}},
    "qwen3moe": {"q8_0": {"*": "Q8_0"}, "q4_0": {"token_embd": "Q6_K", "*": "Q4_0"},
                 "q4_k": {"token_embd": "Q6_K", "attn_v": ("Q4_K", "Q6_K"), "ffn_down_exps": ("Q4_K", "Q6_K"),
                          "*": "Q4_K"}},
    "llama_8_experts": {"q8_0": {"*": "Q8_0"},
                        "q4_0": {"token_embd": "Q6_K", "attn_k": "Q8_0", "attn_v": "Q8_0", "*": "Q4_0"},
                        "q4_k": {"token_embd": "Q6_K", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q5_K",
                                 "ffn_down_exps": ("Q4_K", "Q6_K"), "*": "Q4_K"}},
    "narrow": {"q8_0": {"ffn_down": "Q8_0", "*": "F16"}, "q4_0": {"ffn_down": "Q4_0", "*": "F16"},
               "q4_k": {"ffn_down": ("Q5_0", "Q8_0"), "*": "F16"}},  # rows of 48: no block divides them
}
MORE_BITS = {4: {2, 3}, 2: {1}}  # llama.cpp's use_more_bits layers of a model of 4, 2 layers
# llama.cpp's logits against the float32 model over 64 tokens (measured over the shapes above: see
# test_llama_cpp_runs_each_quantized_file_near_the_float32_model): the mean |d log-probability| over the vocabulary
# relative to the spread of the float32 model's log-probabilities, and the share of positions whose greedy token agrees
DRIFT = {"q8_0": 0.15, "q4_0": 0.45, "q4_k": 0.45}  # measured at most 0.052, 0.288, 0.261; nibbles swapped: 1.10
AGREE = {"q8_0": 0.6, "q4_0": 0.2, "q4_k": 0.25}  # measured at least 0.906, 0.328, 0.453; nibbles swapped: 0


# -----------------------------------------------------------------------------
# the blocks

def awkward_rows(n: int = 512) -> np.ndarray:
    """Rows of 512 (two super-blocks), most of them one kind of trouble for a quantizer."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, n)) * 0.05
    x[0] = 0  # all-zero blocks
    x[1, 7] = 1e4  # one huge value
    x[2] = -np.abs(x[2])  # the largest |w| negative, no positive weight: the min is the whole range
    x[3] = np.abs(x[3])  # no negative weight: the K types pin the min at 0
    x[4, :256], x[4, 256:] = 0.25, -0.25  # constant blocks
    x[5] *= 1e-20  # below ggml's all-zero threshold for a Q6_K group
    x[6] = np.round(x[6] * 40) / 40  # on a rounding grid: ties
    x[7] *= rng.random(n) < 0.1  # mostly zeros, some of them -0.0
    x[8] = rng.standard_cauchy(n) * 0.01  # heavy tails
    x[9] *= np.repeat(np.exp(rng.uniform(-6, 3, n // 32)), 32)  # every block its own scale
    return x.astype(np.float32)


GGML = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
GGML.ggml_quantize_chunk.restype = ctypes.c_size_t
GGML.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def ggml_quantize(x: np.ndarray, kind: int) -> np.ndarray:
    """ggml's own quantizer, as llama-quantize calls it without an importance matrix."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((len(x), x.shape[1] // BLOCKS[kind][0] * BLOCKS[kind][1]), dtype=np.uint8)
    GGML.ggml_quantize_chunk(kind, x.ctypes.data, out.ctypes.data, 0, len(x), x.shape[1], None)
    return out


def ggml_dequantize(data: np.ndarray, kind: int) -> np.ndarray:
    data = np.ascontiguousarray(data)
    out = np.zeros(data.size // BLOCKS[kind][1] * BLOCKS[kind][0], dtype=np.float32)
    getattr(GGML, f"dequantize_row_{NAMES[kind].lower().replace('_k', '_K')}")(
        ctypes.c_void_p(data.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(out.size))
    return out.reshape(len(data), -1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kind", [Q8_0, Q4_0, Q5_0, Q5_1], ids=lambda k: NAMES[k])
def test_blocks_are_the_gguf_package_s_bytes(kind):
    """The gguf package keeps the sign of a -0.0 that C's `if (amax < |v|)` never picks: rows without one."""
    x = np.delete(awkward_rows(), 7, axis=0)
    ours = quantize(x, kind)
    assert ours.dtype == np.uint8 and ours.shape == (len(x), 512 // 32 * BLOCKS[kind][1])
    assert np.array_equal(ours, gguf.quants.quantize(x, gguf.GGMLQuantizationType(kind)))


@pytest.mark.parametrize("kind", [Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K], ids=lambda k: NAMES[k])
def test_blocks_are_ggml_s_own_bytes_and_dequantize_as_ggml_and_the_gguf_package_do(kind):
    """ggml-quants.c compiled in llama.cpp's library: the K types' least-squares searches too, every float32 sum
    taken in the C loop's order."""
    x = awkward_rows()
    ours = quantize(x, kind)
    assert np.array_equal(ours, ggml_quantize(x, kind))
    assert same_bits(dequantize(ours, kind), ggml_dequantize(ours, kind))
    assert same_bits(dequantize(ours, kind), gguf.quants.dequantize(ours, gguf.GGMLQuantizationType(kind)))
    error = np.abs(dequantize(ours, kind) - x)[10:].max() / np.abs(x[10:]).max()  # the plain rows
    assert 0 < error < {Q8_0: 0.01, Q5_0: 0.05, Q5_1: 0.05, Q5_K: 0.05, Q6_K: 0.05}.get(kind, 0.1)


# -----------------------------------------------------------------------------
# exported files

def quiet_checkpoint(path, shape: dict):
    """random_checkpoint's model with its matrices halved (std 0.05): random weights of std 0.1 at width 256 drive a
    model so far that 8-bit rounding alone flips 14% of its greedy tokens."""
    random_checkpoint(path, shape, MINIMIND_TOKENIZER)
    state = torch.load(path, weights_only=False)
    state["model"] = {k: v * 0.5 if v.dim() > 1 else v for k, v in state["model"].items()}
    atomic_save(state, str(path))
    return path


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request, tmp_path_factory):
    """(shape name, its folder): the checkpoint, its float32 export and its three quantized ones."""
    tmp = tmp_path_factory.mktemp("gguf_quant")
    ckpt = quiet_checkpoint(tmp / "ckpt.pt", SHAPES[request.param])
    for dtype in ["float32", *DTYPES]:
        convert.main(["export", str(ckpt), str(tmp / f"{dtype}.gguf"), f"--dtype={dtype}"])
    return request.param, tmp


def role(name: str) -> str:
    return name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]


def stated_type(shape: str, dtype: str, name: str) -> str:
    mix = MIX[shape][dtype]
    kind = mix.get(role(name), mix["*"])
    if isinstance(kind, tuple):
        kind = kind[int(name.split(".")[1]) in MORE_BITS[SHAPES[shape]["n_layers"]]]
    return kind


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tensor_is_in_the_stated_mix_and_dequantizes_as_the_gguf_package_reads_it(exported, dtype):
    shape, tmp = exported
    reader = gguf.GGUFReader(tmp / f"{dtype}.gguf")
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert (fields["general.file_type"], fields["general.quantization_version"]) == (LLAMA_FTYPES[dtype], 2)
    floats = {t.name: t for t in gguf.GGUFReader(tmp / "float32.gguf").tensors}
    kinds = set()
    for t in reader.tensors:
        kinds.add(t.tensor_type.name)
        if len(t.shape) == 1 or ".ffn_gate_inp." in t.name:  # norms and the router
            assert t.tensor_type.name == "F32" and np.array_equal(t.data, floats[t.name].data), t.name
            continue
        assert t.tensor_type.name == stated_type(shape, dtype, t.name), t.name
        if t.tensor_type.name == "F16":
            assert np.array_equal(t.data, floats[t.name].data.astype(np.float16)), t.name
            continue
        ours = dequantize(t.data, t.tensor_type.value)
        assert same_bits(ours, gguf.quants.dequantize(t.data, t.tensor_type)), t.name
        assert ours.shape == floats[t.name].data.shape, t.name
    assert shape != "llama_8_experts" or dtype != "q4_k" or "Q5_K" in kinds


def llama_quantize(src, out, dtype: str):
    """llama.cpp's own quantizer (llama-quantize) on a float32 GGUF."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPES[dtype], 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_cpp_s_own_quantizer_gives_every_tensor_the_same_type_and_bytes(exported, dtype):
    """llama.cpp writes its tensors in another order (by layer, then name) and no other difference: each tensor
    the same type and the same bytes, to the last block (the K types' float32 searches included)."""
    shape, tmp = exported
    llama_quantize(tmp / "float32.gguf", tmp / f"llama_cpp_{dtype}.gguf", dtype)
    theirs = gguf.GGUFReader(tmp / f"llama_cpp_{dtype}.gguf")
    ours = gguf.GGUFReader(tmp / f"{dtype}.gguf")
    assert {t.name: t.tensor_type.name for t in ours.tensors} == {t.name: t.tensor_type.name for t in theirs.tensors}
    by_name = {t.name: t for t in theirs.tensors}
    for t in ours.tensors:
        assert t.data.tobytes() == by_name[t.name].data.tobytes(), t.name
    assert ({k: f.contents() for k, f in ours.fields.items()} ==
            {k: f.contents() for k, f in theirs.fields.items()})


@contextlib.contextmanager
def without_extra_buffers():
    """llama.cpp with its weights where the file puts them: this build's AMX kernels crash on any quantized model on
    an AMX CPU (llama.cpp issue 20824, its own files too), and a repacked layout tests nothing of the file."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


def drift_and_agreement(model, path) -> tuple[float, float]:
    """llama.cpp on the file against nanomind's float32 model, over 64 tokens of text: (mean |d log-probability|
    relative to the spread of the float32 log-probabilities, the share of positions with the same greedy token)."""
    tok = load_tokenizer(MINIMIND_TOKENIZER)
    ids = [tok.bos_id, *tok.encode(MIXED + " ".join(corpus_lines(random.Random(3), 20)))][:64]
    with without_extra_buffers():
        llm = llama(path)
    assert llm.tokenize(MIXED.encode(), add_bos=False, special=False) == tok.encode(MIXED)
    llm.eval(ids)
    theirs = torch.log_softmax(torch.from_numpy(llm.scores[: len(ids)].copy()), -1)
    ours = torch.log_softmax(nanomind_logits(model, torch.tensor([ids]))[0], -1)
    drift = ((theirs - ours).abs().mean() / ours.std()).item()
    return drift, (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_cpp_runs_each_quantized_file_near_the_float32_model(exported, dtype):
    """Measured drift (agreement) q8_0 / q4_0 / q4_k: llama_tied_gqa 0.024 (0.95) / 0.22 (0.47) / 0.17 (0.48),
    qwen3_untied 0.023 (0.94) / 0.27 (0.42) / 0.26 (0.45), qwen3moe 0.052 (0.91) / 0.29 (0.33) / 0.26 (0.47),
    llama_8_experts 0.023 (0.94) / 0.24 (0.47) / 0.13 (0.70), narrow 0.004 (1) / 0.035 (0.94) / 0.015 (1). The
    drift is the weights' rounding (nanomind run on the dequantized weights drifts as far); a random model's nearly
    flat next-token distribution turns it into other greedy tokens more often than a trained model's would."""
    shape, tmp = exported
    model, _ = model_from_checkpoint(str(tmp / "ckpt.pt"))
    drift, agree = drift_and_agreement(model.eval(), tmp / f"{dtype}.gguf")
    print(f"{shape} {dtype}: drift {drift:.3f}, greedy agreement {agree:.3f}")
    assert drift <= DRIFT[dtype] and agree >= AGREE[dtype]


def test_the_bounds_fail_a_quantizer_that_swaps_nibble_halves(tmp_path, monkeypatch):
    """Q4_K blocks with each byte's two nibbles swapped (weight l read as weight l + 32): the Q6_K and Q5_0
    tensors right, the drift and the agreement both out of bounds."""
    right = gguf_quant.QUANTIZERS[Q4_K]

    def swapped(x):
        blocks = right(x)
        blocks[:, 16:] = (blocks[:, 16:] << 4) | (blocks[:, 16:] >> 4)
        return blocks

    monkeypatch.setitem(gguf_quant.QUANTIZERS, Q4_K, swapped)
    ckpt = quiet_checkpoint(tmp_path / "ckpt.pt", SHAPES["llama_tied_gqa"])
    convert.main(["export", str(ckpt), str(tmp_path / "q4_k.gguf"), "--dtype=q4_k"])
    model, _ = model_from_checkpoint(str(ckpt))
    drift, agree = drift_and_agreement(model.eval(), tmp_path / "q4_k.gguf")
    print(f"nibbles swapped: drift {drift:.3f}, greedy agreement {agree:.3f}")
    assert drift > 1.3 * DRIFT["q4_k"] and agree < AGREE["q4_k"] / 2


# -----------------------------------------------------------------------------
# the mix of nanomind's own configs, and mistakes

@pytest.mark.parametrize("config, expected", [
    # the 26m config: dim 512, ffn_dim 1408 (not a multiple of 256), 8 layers, use_more_bits layers 0, 3, 6, 7
    (dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=2),
     {"token_embd.weight": "Q6_K", "blk.1.attn_q.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
      "blk.1.attn_v.weight": "Q4_K", "blk.0.ffn_down.weight": "Q8_0", "blk.1.ffn_down.weight": "Q5_0",
      "blk.6.ffn_down.weight": "Q8_0", "blk.7.ffn_up.weight": "Q4_K"}),
    # the demo's shape: dim 128, no K block fits a row
    (dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2),
     {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q5_0", "blk.3.attn_v.weight": "Q8_0",
      "blk.0.attn_v.weight": "Q5_0", "blk.2.ffn_down.weight": "Q8_0", "blk.1.ffn_down.weight": "Q5_0"}),
])
def test_the_q4_k_mix_of_nanomind_s_configs(config, expected):
    cfg = ModelConfig(**config)
    widths = {"ffn_down": cfg.ffn_dim}
    got = {name: NAMES[quant_type(name, widths.get(role(name), cfg.dim), cfg, "q4_k")] for name in expected}
    assert got == expected


def test_a_bad_dtype_is_one_line_naming_the_key_and_the_existing_file_stays(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["tied_gqa"] | dict(vocab_size=6400), MINIMIND_TOKENIZER)
    out = tmp_path / "model.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(ConfigError, match="^config key 'dtype' must be float32, bfloat16, float16, or for a "
                                          r"\.gguf q8_0, q4_0 or q4_k, got 'q3_k'$") as error:
        convert.main(["export", str(ckpt), str(out), "--dtype=q3_k", "--force"])
    assert "\n" not in str(error.value) and out.read_bytes() == b"keep"
    with pytest.raises(ConfigError, match="^dtype: q4_k is a GGUF type: name OUT") as error:  # a folder export
        convert.main(["export", str(ckpt), str(tmp_path / "hf"), "--dtype=q4_k"])
    assert "\n" not in str(error.value) and not (tmp_path / "hf").exists()
