"""
GGUF, the one-file format of llama.cpp (and of llama-cpp-python, Ollama and LM Studio, which run it), written by hand.

    python convert.py export out/sft/best.pt model.gguf [--dtype=float16|bfloat16|q8_0|q4_0|q4_k]

A GGUF v3 file, little-endian: the magic "GGUF", version 3, the number of tensors and of key-values (u64 each);
the key-values (a string key, a u32 value type, the value); for each tensor its name, its dimensions (innermost
first, as ggml counts them: a torch (out, in) weight is [in, out]), its type and its offset in the data; padding to
general.alignment; then the tensors' bytes, each aligned. A string is its u64 byte length, then UTF-8 bytes; an
array is its element type (u32), its length (u64), then the elements.

The model is llama.cpp's `llama` architecture, or `qwen3` with qk_norm; a mixture of experts is `llama` with
experts (as Mixtral) or `qwen3moe` with qk_norm. llama.cpp's `llama` rotates adjacent pairs (Meta's layout),
nanomind the two halves of each head (transformers' layout): the q and k rows of every head are permuted to match,
as llama.cpp's convert_hf_to_gguf.py does. `qwen3` and `qwen3moe` rotate halves, as nanomind does. A model llama.cpp
would compute differently (a choice its graph hard-codes) is refused with the key that differs, rather than written.

--dtype q8_0, q4_0 or q4_k is what llama.cpp's llama-quantize makes of the float32 file, tensor for tensor and byte
for byte (its llama_tensor_get_type picks the types; gguf_quant.py writes the blocks). Norms and the MoE router stay
float32. q8_0 (file type 7): Q8_0. q4_0 (2): Q4_0, the output matrix (token_embd when tied) Q6_K. q4_k, llama.cpp's
Q4_K_M (15): Q4_K; the output matrix Q6_K; attn_v and ffn_down (an MoE's stacked experts too) Q6_K on the
"use_more_bits" layers: the first and last eighth, and every third between. With 8 experts attn_k and attn_v are Q8_0
(in q4_0 too) and attn_output Q5_K; an 80-layer llama with GQA (llama.cpp's "70B") has attn_v Q5_K where Q4_K. Rows
that the block does not divide fall back as in llama.cpp: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (the output matrix
straight to Q8_0), and rows not a multiple of 32 -> float16. The 26m config (dim 512, ffn_dim 1408) is thus Q4_K with
ffn_down Q5_0, Q8_0 on the use_more_bits layers; a model of the demo's dim 128 fits no K block: Q5_0, Q8_0.

The tokenizer goes in as llama.cpp's byte-level BPE (`gpt2`): tokens spelled in GPT-2's byte alphabet, their
types, the merges, and the name of the split rule llama.cpp applies before BPE. llama.cpp implements a fixed list
of rules; a tokenizer split by another (nanomind's own) is refused rather than written to tokenize differently.
"""
import json
import math
import re
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import torch

from errors import ConfigError
from fileio import atomic_write
from gguf_quant import F16, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, block_size, quantize
from model import ModelConfig
from tokenizer import PATTERN

GGUF_VERSION = 3
ALIGNMENT = 32  # llama.cpp's default: the tensor data and every tensor in it start at a multiple of it
# value types
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types, and llama.cpp's file type naming the weights' precision (1-D tensors and routers stay float32)
GGML_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0 7, _Q4_0 2, _Q4_K_M 15 (src/llama.h)
FILE_TYPES = {"float32": 0, "float16": 1, "bfloat16": 32, "q8_0": 7, "q4_0": 2, "q4_k": 15}
QUANTIZED = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_k": Q4_K}  # each mix's default type
FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}  # llama.cpp's type for a row not a multiple of 256
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION: the block layouts above
# llama.cpp's token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# nanomind's parameter names -> llama.cpp's; {} is a layer index
NANOMIND_TO_GGUF = {
    "tok_embeddings.weight": "token_embd.weight",
    "layers.{}.attention_norm.weight": "blk.{}.attn_norm.weight",
    "layers.{}.attention.wq.weight": "blk.{}.attn_q.weight",
    "layers.{}.attention.wk.weight": "blk.{}.attn_k.weight",
    "layers.{}.attention.wv.weight": "blk.{}.attn_v.weight",
    "layers.{}.attention.wo.weight": "blk.{}.attn_output.weight",
    "layers.{}.attention.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "layers.{}.attention.k_norm.weight": "blk.{}.attn_k_norm.weight",
    "layers.{}.ffn_norm.weight": "blk.{}.ffn_norm.weight",
    "layers.{}.feed_forward.w1.weight": "blk.{}.ffn_gate.weight",
    "layers.{}.feed_forward.w3.weight": "blk.{}.ffn_up.weight",
    "layers.{}.feed_forward.w2.weight": "blk.{}.ffn_down.weight",
    "layers.{}.feed_forward.gate.weight": "blk.{}.ffn_gate_inp.weight",  # the router, (n_experts, dim)
    # a layer's experts, stacked by stack_experts: (n_experts, out, in)
    "layers.{}.feed_forward.experts.w1.weight": "blk.{}.ffn_gate_exps.weight",
    "layers.{}.feed_forward.experts.w3.weight": "blk.{}.ffn_up_exps.weight",
    "layers.{}.feed_forward.experts.w2.weight": "blk.{}.ffn_down_exps.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}
EXPERT = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight")
# llama.cpp's YaRN ramp bounds: no GGUF key sets them for llama, qwen3 or qwen3moe (only grok and mistral3 read one)
LLAMA_CPP_YARN_BETAS = (32.0, 1.0)


# -----------------------------------------------------------------------------
# the binary layout

def pack_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


SCALARS = {U32: "<I", I32: "<i", F32: "<f", BOOL: "<?"}


def pack_value(kind: int, value) -> bytes:
    if kind == STRING:
        return pack_string(value)
    if kind == ARRAY:
        element_kind, items = value
        return struct.pack("<IQ", element_kind, len(items)) + b"".join(pack_value(element_kind, v) for v in items)
    return struct.pack(SCALARS[kind], value)


class Quantized(NamedTuple):
    """A tensor as ggml blocks: its ggml type, its shape (torch's order) and its rows' bytes (gguf_quant.py)."""
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray


def layout(t: torch.Tensor | Quantized) -> tuple[tuple[int, ...], int, int]:
    """(shape, ggml type, size in bytes) of a tensor to write."""
    if isinstance(t, Quantized):
        return t.shape, t.ggml_type, t.data.nbytes
    return tuple(t.shape), GGML_TYPES[t.dtype], t.numel() * t.element_size()


def tensor_bytes(t: torch.Tensor | Quantized) -> bytes:
    if isinstance(t, Quantized):
        return t.data.tobytes()
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def write_gguf(f: BinaryIO, metadata: dict[str, tuple[int, object]], tensors: dict[str, torch.Tensor | Quantized]):
    """The GGUF file into f; metadata: key -> (value type, value), an ARRAY's value being (element type, items)."""
    infos, offset = [], 0
    for name, t in tensors.items():
        shape, ggml_type, size = layout(t)
        dims = list(reversed(shape))  # innermost first
        infos.append(pack_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset))
        offset += -(-size // ALIGNMENT) * ALIGNMENT
    header = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(tensors), len(metadata))
    header += b"".join(pack_string(key) + struct.pack("<I", kind) + pack_value(kind, value)
                       for key, (kind, value) in metadata.items())
    header += b"".join(infos)
    f.write(header + b"\0" * (-len(header) % ALIGNMENT))
    for t in tensors.values():
        data = tensor_bytes(t)
        f.write(data + b"\0" * (-len(data) % ALIGNMENT))


# -----------------------------------------------------------------------------
# the model

def architecture(cfg: ModelConfig) -> str:
    return ("qwen3moe" if cfg.n_experts else "qwen3") if cfg.qk_norm else "llama"  # llama takes experts too


def refuse_what_llama_cpp_computes_differently(cfg: ModelConfig):
    """What llama.cpp computes whatever the file says (src/models/llama.cpp and qwen3moe.cpp; llama-hparams.h for
    the betas)."""
    if cfg.n_experts and not cfg.norm_topk_prob and cfg.experts_per_token < cfg.n_experts:
        raise ConfigError(f"norm_topk_prob: llama.cpp's {architecture(cfg)} always renormalises the chosen experts' "
                          "weights to sum to 1; this model has norm_topk_prob False")
    if cfg.rope_scaling == "yarn" and (cfg.rope_beta_fast, cfg.rope_beta_slow) != LLAMA_CPP_YARN_BETAS:
        raise ConfigError(f"rope_beta_fast, rope_beta_slow: llama.cpp's {architecture(cfg)} ramps YaRN between "
                          f"{LLAMA_CPP_YARN_BETAS[0]:g} and {LLAMA_CPP_YARN_BETAS[1]:g} whatever a GGUF says; this "
                          f"model has {cfg.rope_beta_fast:g} and {cfg.rope_beta_slow:g}")


def halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The rows of each head reordered from (x[i], x[i + D/2]) pairs to adjacent (x[2i], x[2i + 1]) pairs: what
    llama.cpp's `llama` rotates."""
    return w.reshape(n_heads, 2, w.size(0) // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return NANOMIND_TO_GGUF[f"layers.{{}}.{layer[2]}"].format(layer[1]) if layer else NANOMIND_TO_GGUF[name]


def stack_experts(state: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Each layer's experts as llama.cpp holds them: one (n_experts, out, in) tensor per projection (w1, w3, w2),
    named layers.{i}.feed_forward.experts.{w}.weight, in place of the experts' own."""
    stacked = {}
    for name, t in state.items():
        expert = EXPERT.fullmatch(name)
        if not expert:
            stacked[name] = t
        elif expert[2] == "0":
            layer, w = expert[1], expert[3]
            stacked[f"layers.{layer}.feed_forward.experts.{w}.weight"] = torch.stack(
                [state[f"layers.{layer}.feed_forward.experts.{e}.{w}.weight"] for e in range(n_experts)])
    return stacked


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that Q4_K_M gives Q6_K: the first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def quant_type(name: str, width: int, cfg: ModelConfig, dtype: str) -> int:
    """The ggml type llama.cpp's quantizer gives the weight `name` (llama.cpp's name; 2-D or 3-D, rows of width)
    in the mix dtype: llama_tensor_get_type for these architectures, then its fallback for a width the block does
    not divide."""
    kind, layer = QUANTIZED[dtype], int(name.split(".")[1]) if name.startswith("blk.") else -1
    k_mix = dtype == "q4_k"
    if name == "output.weight" or (cfg.tie_embeddings and name == "token_embd.weight"):
        kind = Q8_0 if width % block_size(kind) or kind == Q8_0 else Q6_K
    elif ".attn_v." in name:
        if k_mix and use_more_bits(layer, cfg.n_layers):
            kind = Q6_K
        elif (architecture(cfg) == "llama" and cfg.n_layers == 80 and cfg.n_heads != cfg.n_kv_heads
              and cfg.n_experts != 8 and kind == Q4_K):  # llama.cpp's LLM_TYPE_70B
            kind = Q5_K
        kind = Q8_0 if cfg.n_experts == 8 else kind
    elif ".attn_k." in name and cfg.n_experts == 8:
        kind = Q8_0
    elif ".ffn_down" in name and k_mix and use_more_bits(layer, cfg.n_layers):
        kind = Q6_K
    elif ".attn_output." in name and k_mix and cfg.n_experts == 8:
        kind = Q5_K
    if width % block_size(kind):
        kind = FALLBACK.get(kind, F16)
    return F16 if width % block_size(kind) else kind


def stored(name: str, t: torch.Tensor, cfg: ModelConfig, dtype: str) -> torch.Tensor | Quantized:
    """A weight matrix (or an MoE's stacked experts) as the file holds it: in dtype, or quantized in the mix."""
    if dtype not in QUANTIZED:
        return t.to(getattr(torch, dtype))
    kind = quant_type(name, t.shape[-1], cfg, dtype)
    if kind == F16:
        return t.to(torch.float16)
    return Quantized(kind, tuple(t.shape), quantize(t.detach().cpu().float().numpy(), kind))


def gguf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str) -> dict[str, torch.Tensor | Quantized]:
    """dtype: float32, float16, bfloat16, or a quantized mix (q8_0, q4_0, q4_k)."""
    tensors = {}
    for name, t in stack_experts(state, cfg.n_experts).items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # llama.cpp uses token_embd when output is absent
        if architecture(cfg) == "llama" and name.endswith((".wq.weight", ".wk.weight")):
            t = halves_to_pairs(t, cfg.n_heads if name.endswith(".wq.weight") else cfg.n_kv_heads)
        # a rounded router could send a token to other experts; llama.cpp's converter keeps it float32 too
        full = t.dim() == 1 or name.endswith(".feed_forward.gate.weight")
        tensors[gguf_name(name)] = t.to(torch.float32) if full else stored(gguf_name(name), t, cfg, dtype)
    return tensors


def model_metadata(cfg: ModelConfig, dtype: str, name: str) -> dict:
    arch = architecture(cfg)
    quantized = {"general.quantization_version": (U32, QUANTIZATION_VERSION)} if dtype in QUANTIZED else {}
    return quantized | {
        "general.architecture": (STRING, arch), "general.name": (STRING, name),
        "general.file_type": (U32, FILE_TYPES[dtype]), "general.alignment": (U32, ALIGNMENT),
        f"{arch}.vocab_size": (U32, cfg.vocab_size), f"{arch}.context_length": (U32, cfg.max_seq_len),
        f"{arch}.embedding_length": (U32, cfg.dim), f"{arch}.block_count": (U32, cfg.n_layers),
        # every feed-forward of a mixture is an expert: llama sizes its experts by this, qwen3moe by its own key
        f"{arch}.feed_forward_length": (U32, cfg.moe_ffn_dim if cfg.n_experts else cfg.ffn_dim),
        f"{arch}.attention.head_count": (U32, cfg.n_heads),
        f"{arch}.attention.head_count_kv": (U32, cfg.n_kv_heads),
        f"{arch}.attention.key_length": (U32, cfg.head_dim), f"{arch}.attention.value_length": (U32, cfg.head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": (F32, cfg.norm_eps),
        f"{arch}.rope.dimension_count": (U32, cfg.head_dim), f"{arch}.rope.freq_base": (F32, cfg.rope_theta),
    } | (moe_metadata(cfg, arch) if cfg.n_experts else {}) | (yarn_metadata(cfg, arch) if cfg.rope_scaling else {})


def moe_metadata(cfg: ModelConfig, arch: str) -> dict:
    return {f"{arch}.expert_count": (U32, cfg.n_experts), f"{arch}.expert_used_count": (U32, cfg.experts_per_token),
            f"{arch}.expert_feed_forward_length": (U32, cfg.moe_ffn_dim)}


def yarn_metadata(cfg: ModelConfig, arch: str) -> dict:
    """llama.cpp's YaRN ramps the frequencies as nanomind's does, and multiplies cos and sin by attn_factor x
    (0.1 ln(factor) + 1, or 1 for factor <= 1): nanomind's default scale is that product with attn_factor 1, another
    rope_attention_factor goes in divided by it. (llama.cpp reads no yarn_attn_factor key for these architectures.)"""
    mscale = 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0
    attn_factor = 1.0 if cfg.rope_attention_factor is None else cfg.rope_attention_factor / mscale
    return {f"{arch}.rope.scaling.type": (STRING, "yarn"), f"{arch}.rope.scaling.factor": (F32, cfg.rope_factor),
            f"{arch}.rope.scaling.original_context_length": (U32, cfg.rope_original_max_len),
            f"{arch}.rope.scaling.attn_factor": (F32, attn_factor)}


# -----------------------------------------------------------------------------
# the tokenizer

def split_rule(tokenizer_json: dict, tokenizer, where: str) -> str:
    """llama.cpp's name for the rule that cuts text into pieces before BPE (tokenizer.ggml.pre)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):  # GPT-2's split (tokenizer.GPT2_PATTERN)
        return "gpt-2"
    pattern = getattr(tokenizer, "pattern", None)  # a tiktoken tokenizer's
    rule = ("nanomind's own rule (one digit per token, Chinese runs apart from other letters)"
            if pattern == PATTERN else f"the pattern {pattern[:50]!r}..." if pattern
            else f"the pre_tokenizer {json.dumps(pre)[:80]}")
    raise ConfigError(f"{where}: the tokenizer splits text by {rule}, which llama.cpp does not implement, so a GGUF "
                      "would tokenize differently: export a Hugging Face folder instead, or train with a tokenizer "
                      "split by GPT-2's rule, such as MiniMind's (the default)")


def tokenizer_metadata(tokenizer_json: dict, tokenizer_config: dict, tokenizer, vocab_size: int, where: str) -> dict:
    """tokenizer_json / tokenizer_config: the tokenizer as Hugging Face files (hf_export.tokenizer_files)."""
    pre = split_rule(tokenizer_json, tokenizer, where)
    added = {t["id"]: t for t in tokenizer_json.get("added_tokens") or []}
    spelled = {i: t for t, i in tokenizer_json["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if max(spelled) >= vocab_size:
        raise ConfigError(f"{where}: token id {max(spelled)} is beyond the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):  # ids the tokenizer leaves unused (the embedding's padding) get a placeholder
        tokens.append(spelled.get(i, f"[PAD{i}]"))
        types.append(UNUSED if i not in spelled else NORMAL if i not in added
                     else CONTROL if added[i].get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return {
        "tokenizer.ggml.model": (STRING, "gpt2"), "tokenizer.ggml.pre": (STRING, pre),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, tokens)), "tokenizer.ggml.token_type": (ARRAY, (I32, types)),
        "tokenizer.ggml.merges": (ARRAY, (STRING, merges)),
        "tokenizer.ggml.bos_token_id": (U32, tokenizer.bos_id), "tokenizer.ggml.eos_token_id": (U32, tokenizer.eos_id),
        "tokenizer.ggml.padding_token_id": (U32, tokenizer.pad_id),
        # nanomind's pretraining puts bos before every document: plain text is scored with it
        "tokenizer.ggml.add_bos_token": (BOOL, True), "tokenizer.ggml.add_eos_token": (BOOL, False),
        "tokenizer.chat_template": (STRING, tokenizer_config["chat_template"]),
    }


def export_gguf(state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer, files: dict[str, dict], dtype: str,
                out: Path, name: str, where: str):
    """files: tokenizer.json and tokenizer_config.json as the Hugging Face export writes them; dtype: a key of
    FILE_TYPES."""
    refuse_what_llama_cpp_computes_differently(cfg)
    metadata = model_metadata(cfg, dtype, name) | tokenizer_metadata(
        files["tokenizer.json"], files["tokenizer_config.json"], tokenizer, cfg.vocab_size, where)
    tensors = gguf_tensors(state, cfg, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)  # as a folder export makes its folder
    with atomic_write(str(out)) as f:  # an error leaves OUT as it was
        write_gguf(f, metadata, tensors)
