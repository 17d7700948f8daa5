"""
GGUF, the one-file format of llama.cpp (and of llama-cpp-python, Ollama and LM Studio, which run it), written by hand.

    python convert.py export out/sft/best.pt model.gguf [--dtype=float16]

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

The tokenizer goes in as llama.cpp's byte-level BPE (`gpt2`): tokens spelled in GPT-2's byte alphabet, their
types, the merges, and the name of the split rule llama.cpp applies before BPE. llama.cpp implements a fixed list
of rules; a tokenizer split by another (nanomind's own) is refused rather than written to tokenize differently.
"""
import json
import math
import re
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from errors import ConfigError
from fileio import atomic_write
from model import ModelConfig
from tokenizer import PATTERN

GGUF_VERSION = 3
ALIGNMENT = 32  # llama.cpp's default: the tensor data and every tensor in it start at a multiple of it
# value types
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types, and llama.cpp's file type naming the weights' precision (1-D tensors and routers stay float32)
GGML_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}
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


def write_gguf(f: BinaryIO, metadata: dict[str, tuple[int, object]], tensors: dict[str, torch.Tensor]):
    """The GGUF file into f; metadata: key -> (value type, value), an ARRAY's value being (element type, items)."""
    infos, offset = [], 0
    for name, t in tensors.items():
        dims = list(reversed(t.shape))  # innermost first
        infos.append(pack_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML_TYPES[t.dtype], offset))
        offset += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    header = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(tensors), len(metadata))
    header += b"".join(pack_string(key) + struct.pack("<I", kind) + pack_value(kind, value)
                       for key, (kind, value) in metadata.items())
    header += b"".join(infos)
    f.write(header + b"\0" * (-len(header) % ALIGNMENT))
    for t in tensors.values():
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
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


def gguf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, t in stack_experts(state, cfg.n_experts).items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # llama.cpp uses token_embd when output is absent
        if architecture(cfg) == "llama" and name.endswith((".wq.weight", ".wk.weight")):
            t = halves_to_pairs(t, cfg.n_heads if name.endswith(".wq.weight") else cfg.n_kv_heads)
        # a rounded router could send a token to other experts; llama.cpp's converter keeps it float32 too
        full = t.dim() == 1 or name.endswith(".feed_forward.gate.weight")
        tensors[gguf_name(name)] = t.to(torch.float32 if full else dtype)
    return tensors


def model_metadata(cfg: ModelConfig, dtype: torch.dtype, name: str) -> dict:
    arch = architecture(cfg)
    return {
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
    """files: tokenizer.json and tokenizer_config.json as the Hugging Face export writes them."""
    dtype = getattr(torch, dtype)
    refuse_what_llama_cpp_computes_differently(cfg)
    metadata = model_metadata(cfg, dtype, name) | tokenizer_metadata(
        files["tokenizer.json"], files["tokenizer_config.json"], tokenizer, cfg.vocab_size, where)
    tensors = gguf_tensors(state, cfg, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)  # as a folder export makes its folder
    with atomic_write(str(out)) as f:  # an error leaves OUT as it was
        write_gguf(f, metadata, tensors)
