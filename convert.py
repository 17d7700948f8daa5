"""
Move weights between nanomind and the Hugging Face world.

    python convert.py import full_sft_768.pth out/minimind.pt --tokenizer=minimind/model   # minimind-3's state dict
    python convert.py import full_sft_512.pth out/minimind2.pt --tokenizer=minimind/model --n_heads=8   # MiniMind2's
    python convert.py import full_sft_768_moe.pth out/moe.pt --tokenizer=minimind/model     # minimind-3-moe's
    python convert.py import MiniMind2-Small/ out/minimind2.pt                              # a transformers folder
    python convert.py export out/sft/best.pt hf/ [--dtype=bfloat16] [--force]
    python convert.py export out/sft/best.pt model.gguf [--dtype=float16]                  # llama.cpp, Ollama
    python convert.py merge out/sft_lora/best.pt out/sft_merged.pt                        # LoRA folded into its base

import reads a MiniMind *.pth state dict (MiniMind2; minimind-3 adds q_norm / k_norm; its MoE a router and
experts) or a transformers folder (config.json + model.safetensors or pytorch_model.bin) of LlamaForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM or MiniMind's own MiniMindForCausalLM, and writes a
nanomind checkpoint that train_sft.py --init_from and sample.py --ckpt take. The architecture comes from
config.json and the tensor shapes; --key=value sets any ModelConfig key they cannot tell (n_heads of a model
without qk_norm; experts_per_token of a MoE *.pth, MiniMind's 1 by default). Experts are read one tensor each or
fused (transformers 5's 3-D gate_up_proj / down_proj); YaRN comes from rope_parameters or rope_scaling. --tokenizer
DIR records the tokenizer the weights go with (a folder holding a tokenizer.json records itself); weights alone
carry none, and import never guesses one.

export writes a folder that transformers' AutoModelForCausalLM and AutoTokenizer load without remote code:
config.json (LlamaForCausalLM, or Qwen3ForCausalLM with qk_norm; with experts Qwen3MoeForCausalLM, or
MixtralForCausalLM without qk_norm; YaRN in rope_parameters), model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json (with a chat template rendering what chat.encode_chat does). Plain text
gets the bos nanomind's pretraining puts before every document. An OUT ending in .gguf is one GGUF file for
llama.cpp instead (gguf_export.py).

merge: a LoRA checkpoint holds only its adapters and the path and digest of the checkpoint they were trained on;
the merged one is a full checkpoint (weights, configs, tokenizer, stage, step; no optimizer) that loads without
the base. (Every tool that takes a checkpoint also merges a LoRA one on load.)

Safetensors is read and written here, no library: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensors.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import struct
from pathlib import Path

import torch

from checkpoint import (atomic_save, checkpoint_tokenizer, load_checkpoint, load_model_state, model_from_checkpoint,
                        trained_tokenizer_path)
from config import check_type, parse_flag_value
from errors import CheckpointError, ConfigError, cli
from gguf_export import architecture, export_gguf
from model import ModelConfig, Transformer
from tokenizer import DEFAULT_DIR, NANOMIND_DIR, HFTokenizer, TiktokenTokenizer, _byte_level_alphabet, load_tokenizer

# -----------------------------------------------------------------------------
# safetensors

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    raw = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        tensors = {}
        for name, info in header.items():
            dtype, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["data_offsets"]
            numel = 1
            for d in info["shape"]:
                numel *= d
            if not 0 <= begin <= end <= len(raw) - 8 - n or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {begin}..{end} do not fit its shape or the file")
            data = bytearray(raw[8 + n + begin : 8 + n + end])  # a copy: the tensor owns its memory
            tensors[name] = torch.frombuffer(data, dtype=dtype).reshape(info["shape"]) if numel else \
                torch.empty(info["shape"], dtype=dtype)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        detail = f"unknown dtype {e}" if isinstance(e, KeyError) else e
        raise CheckpointError(f"{path} is not a readable safetensors file: {detail}") from None
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path):
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # transformers reads "pt" as PyTorch's layout
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


# -----------------------------------------------------------------------------
# parameter names: Hugging Face's LLaMA / Qwen3 / Qwen3-MoE (and MiniMind's, the same) <-> nanomind's; each {} is
# an index, of a layer, then of an expert

HF_TO_NANOMIND = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.gate.weight": "layers.{}.feed_forward.gate.weight",  # the router
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.feed_forward.experts.{}.w1.weight",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.feed_forward.experts.{}.w3.weight",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.feed_forward.experts.{}.w2.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
NANOMIND_TO_HF = {v: k for k, v in HF_TO_NANOMIND.items()}


def rename(name: str, table: dict[str, str]) -> str | None:
    """The name in the other convention, or None when the table has no place for it."""
    target = table.get(re.sub(r"\.\d+\.", ".{}.", name))
    return target.format(*re.findall(r"\.(\d+)\.", name)) if target else None


# Mixtral's names for the experts on disk: block_sparse_moe, w1 gate, w3 up, w2 down
MIXTRAL_NAMES = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def mixtral_name(name: str) -> str:
    """A Qwen3-MoE name (HF_TO_NANOMIND's) as Mixtral's checkpoints spell it."""
    for qwen, mixtral in MIXTRAL_NAMES.items():
        name = name.replace(qwen, mixtral)
    return name


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts in HF_TO_NANOMIND's names, one tensor per expert: Mixtral's names, and the 3-D tensors
    transformers 5 holds them in (what save_pretrained(save_original_format=False) writes), are split up."""
    out = {}
    for name, t in state.items():
        if ".block_sparse_moe." in name:
            for qwen, mixtral in MIXTRAL_NAMES.items():
                name = name.replace(mixtral, qwen)
        fused = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if not fused or t.dim() != 3:
            out[name] = t
            continue
        for e, w in enumerate(t):  # gate_up_proj (E, 2 I, dim): gate's rows, then up's; down_proj (E, dim, I)
            parts = zip(("gate_proj", "up_proj"), w.chunk(2)) if fused[2] == "gate_up_proj" else [("down_proj", w)]
            out |= {f"{fused[1]}.{e}.{part}.weight": p for part, p in parts}
    return out


# -----------------------------------------------------------------------------
# import

def read_source(src: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(state dict in Hugging Face names, config.json or None) from a *.pth file or a transformers folder."""
    if src.is_file():
        state = torch_load(src)
        if isinstance(state.get("model"), dict):  # MiniMind's *_resume.pth: the weights sit under "model"
            state = state["model"]
        return state, None
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{src}: expected a *.pth file or a transformers folder with config.json")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if (src / "model.safetensors").is_file():
        return read_safetensors(src / "model.safetensors"), config
    if (src / "model.safetensors.index.json").is_file():  # sharded: the index names each tensor's file
        index = json.loads((src / "model.safetensors.index.json").read_text(encoding="utf-8"))
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state |= read_safetensors(src / shard)
        return state, config
    if (src / "pytorch_model.bin").is_file():
        return torch_load(src / "pytorch_model.bin"), config
    raise FileNotFoundError(f"{src}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def torch_load(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no code runs
    except Exception as e:  # torch raises several kinds for a garbled or foreign file
        raise CheckpointError(f"{path} is not a readable PyTorch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


# MiniMind's own config.json (model_type "minimind") has LLaMA's keys; what nanomind cannot run is refused
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "MiniMindForCausalLM": "minimind",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
# the routing keys' values where config.json leaves them out: transformers' defaults (MiniMind's config class's for
# minimind); Mixtral always renormalises the top-k weights and has no key for it
MOE_DEFAULTS = {"qwen3_moe": {"experts_per_token": 8, "norm_topk_prob": False, "router_aux_loss_coef": 1e-3},
                "mixtral": {"experts_per_token": 2, "norm_topk_prob": True, "router_aux_loss_coef": 1e-3},
                "minimind": {"experts_per_token": 1, "norm_topk_prob": True, "router_aux_loss_coef": 5e-4}}


def config_from_hf(config: dict, path: Path) -> dict:
    """ModelConfig keys from a config.json; everything nanomind's model does not compute is refused in one error."""
    arch = (config.get("architectures") or [None])[0]
    kind = ARCHITECTURES.get(arch, config.get("model_type"))
    if kind not in ARCHITECTURES.values():
        raise ConfigError(f"{path}: architecture {arch} (model_type {config.get('model_type')}) is not supported: "
                          f"only {', '.join(ARCHITECTURES)}")
    moe = kind in ("qwen3_moe", "mixtral") or (kind == "minimind" and config.get("use_moe", False))
    unsupported = [f"{key}={config[key]!r}" for key, fine in [
        ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False)]
        if config.get(key, fine) != fine]
    if kind == "mixtral" and config.get("sliding_window") is not None:  # Qwen3's applies only with use_sliding_window
        unsupported.append(f"sliding_window={config['sliding_window']!r}")
    # Qwen3-MoE's dense layers among the MoE ones: nanomind's layers are all MoE or all dense
    unsupported += [f"{key}={config[key]!r} (dense layers among the MoE ones)" for key, fine in [
        ("decoder_sparse_step", 1), ("mlp_only_layers", [])] if config.get(key) not in (fine, None)]
    found, rope_errors = rope_from_hf(config)
    unsupported += rope_errors
    if unsupported:
        raise ConfigError(f"{path}: nanomind's model has no {', '.join(unsupported)}")
    keys = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
            "norm_eps": "rms_norm_eps", "head_dim": "head_dim", "max_seq_len": "max_position_embeddings",
            "tie_embeddings": "tie_word_embeddings"}
    if moe:
        keys |= {"n_experts": "num_local_experts" if "num_local_experts" in config else "num_experts",
                 "experts_per_token": "num_experts_per_tok", "moe_ffn_dim": "moe_intermediate_size",
                 "norm_topk_prob": "norm_topk_prob", "router_aux_loss_coef": "router_aux_loss_coef"}
    found |= (MOE_DEFAULTS[kind] if moe else {"n_experts": 0})  # config.json, not the tensors, says dense
    found |= {ours: config[theirs] for ours, theirs in keys.items() if config.get(theirs) is not None}
    if "n_heads" in found and "n_kv_heads" not in found:
        found["n_kv_heads"] = found["n_heads"]  # LLaMA's rule: no num_key_value_heads means one per query head
    return found


def rope_from_hf(config: dict) -> tuple[dict, list[str]]:
    """(rope_theta and YaRN's ModelConfig keys, what nanomind cannot compute) from config.json, read as transformers
    5 reads it: rope_scaling (transformers 4, MiniMind: "type" or "rope_type") over rope_parameters."""
    rope = config.get("rope_parameters") or {}
    params = config.get("rope_scaling") or rope
    found, unsupported = {}, []
    theta = config.get("rope_theta", rope.get("rope_theta"))
    if theta is not None:
        found["rope_theta"] = float(theta)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # nanomind rotates every dimension of a head
        unsupported.append(f"partial_rotary_factor={partial!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return found, unsupported
    if kind != "yarn" or params.get("truncate", True) is not True:
        return found, unsupported + [f"rope scaling {params}"]
    # transformers: a top-level original_max_position_embeddings first, then the dict's, then the context itself;
    # no factor: the context over the original
    context = config.get("max_position_embeddings")
    original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or context
    factor = params.get("factor") or (context / original if context and original else None)
    if not factor:
        return found, unsupported + [f"rope scaling {params} without a factor or a context length"]
    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim") and factor > 1:
        # DeepSeek's form of the attention factor, worked out as transformers does
        scale = lambda m: 0.1 * m * math.log(factor) + 1.0  # noqa: E731
        attention = scale(params["mscale"]) / scale(params["mscale_all_dim"])
    found |= {"rope_scaling": "yarn", "rope_factor": float(factor), "rope_original_max_len": int(original),
              "rope_beta_fast": float(params.get("beta_fast") or 32),  # transformers' `or`: 0 means the default
              "rope_beta_slow": float(params.get("beta_slow") or 1),
              "rope_attention_factor": None if attention is None else float(attention)}
    return found, unsupported


def infer_config(state: dict[str, torch.Tensor], hf_config: dict, flags: dict, src: Path) -> ModelConfig:
    """The architecture: flags over config.json over the tensor shapes over MiniMind's defaults."""
    if "model.embed_tokens.weight" not in state:
        raise CheckpointError(f"{src}: no model.embed_tokens.weight; keys: {sorted(state)[:8]} ...")
    vocab_size, dim = state["model.embed_tokens.weight"].shape
    layers = {int(m[1]) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in state
    shapes = {"vocab_size": vocab_size, "dim": dim, "n_layers": max(layers, default=-1) + 1, "qk_norm": qk_norm}
    if "model.layers.0.mlp.gate_proj.weight" in state:
        shapes["ffn_dim"] = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    if qk_norm:
        shapes["head_dim"] = state["model.layers.0.self_attn.q_norm.weight"].shape[0]
    # MiniMind's *.pth carries no config: its defaults, minimind-3's (qk_norm) or MiniMind2's
    defaults = {"norm_eps": 1e-6 if qk_norm else 1e-5, "rope_theta": 1e6, "max_seq_len": 32768}
    if "model.layers.0.mlp.gate.weight" in state:  # a router: a mixture of experts, routed as MiniMind routes
        shapes["n_experts"] = state["model.layers.0.mlp.gate.weight"].shape[0]
        expert = state.get("model.layers.0.mlp.experts.0.gate_proj.weight")
        if expert is not None:  # without it the strict load names what is missing
            shapes["moe_ffn_dim"] = defaults["ffn_dim"] = expert.shape[0]  # MiniMind: moe width = intermediate_size
        defaults |= MOE_DEFAULTS["minimind"]
    if "lm_head.weight" in state:
        defaults["tie_embeddings"] = torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    else:
        defaults["tie_embeddings"] = True
    values = defaults | shapes | hf_config | flags
    q_rows = state["model.layers.0.self_attn.q_proj.weight"].shape[0] if layers else dim
    kv_rows = state["model.layers.0.self_attn.k_proj.weight"].shape[0] if layers else dim
    if "n_heads" not in values:
        if "head_dim" not in values:
            raise ConfigError(f"{src}: the weights do not tell the number of heads (no q_norm, no config.json): "
                              f"pass --n_heads=N (MiniMind2: --n_heads=8)")
        values["n_heads"] = q_rows // values["head_dim"]
    values.setdefault("head_dim", q_rows // values["n_heads"])
    values.setdefault("n_kv_heads", kv_rows // values["head_dim"])
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{src}: {e}") from None


def to_nanomind(state: dict[str, torch.Tensor], model: Transformer, src: Path) -> dict[str, torch.Tensor]:
    """Hugging Face names -> nanomind's, float32; every key without a place in model is listed in one error."""
    cfg, own = model.config, model.state_dict()
    unplaced = sorted(k for k in state if rename(k, HF_TO_NANOMIND) not in own)  # experts in a dense model too
    if unplaced:
        raise CheckpointError(f"{src}: {len(unplaced)} weights have no place in nanomind's model: {unplaced}")
    ours = {rename(k, HF_TO_NANOMIND): v.float() for k, v in state.items()}
    if cfg.tie_embeddings:
        head = ours.get("output.weight")
        if head is not None and not torch.equal(head, ours["tok_embeddings.weight"]):
            raise CheckpointError(f"{src}: lm_head.weight differs from model.embed_tokens.weight, yet the "
                                  "embeddings are tied: pass --tie_embeddings=False")
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def model_flags(args: list[str]) -> dict:
    """--key=value ModelConfig keys."""
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    flags = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        if key not in types:
            raise ConfigError(f"unknown model key {key!r}; known keys: {', '.join(types)}")
        flags[key] = check_type(key, parse_flag_value(text), types[key], "command line")
    return flags


def import_weights(src: Path, out: Path, tokenizer_dir: str | None, stage: str, flags: dict, force: bool):
    if out.exists() and not force:
        raise ConfigError(f"{out} exists: pass --force to overwrite it")
    if tokenizer_dir is None and src.is_dir() and (src / "tokenizer.json").is_file():
        tokenizer_dir = str(src)
    if tokenizer_dir is None:  # weights carry no tokenizer, and a wrong one of the same size fails without a word
        raise ConfigError(f"{src} holds no tokenizer.json: pass --tokenizer=DIR, the tokenizer the weights were "
                          f"trained with (MiniMind's model/ folder, or the copy in {DEFAULT_DIR}; nanomind's own: "
                          f"--tokenizer={NANOMIND_DIR})")
    state, hf_config = read_source(src)
    state = per_expert(state)
    cfg = infer_config(state, config_from_hf(hf_config, src / "config.json") if hf_config else {}, flags, src)
    model = Transformer(cfg)
    load_model_state(model, to_nanomind(state, model, src), str(src))  # strict: every key, every shape
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer ({tokenizer_dir}) has {tokenizer.vocab_size} ids, the "
                          f"model's embedding {cfg.vocab_size}: pass the tokenizer the weights were trained with")
    # the keys train_*.py write that sampling, fine-tuning and export read; stage "sft" by default: sample.py
    # chats with any stage but "pretrain", and MiniMind's released weights (full_sft_*.pth) are chat models
    atomic_save({"model": model.state_dict(), "model_config": dataclasses.asdict(cfg), "stage": stage, "step": 0,
                 "config": {"tokenizer_path": tokenizer_dir, "imported_from": str(src)},
                 "tokenizer": {"path": tokenizer_dir, "fingerprint": tokenizer.fingerprint,
                               "chat_template": tokenizer.chat_template}}, str(out))
    print(f"{src} -> {out}: {model.num_params():,} parameters, {stage} stage, tokenizer "
          f"{tokenizer_dir} ({tokenizer.chat_template} chat template)")
    print("model config: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))


# -----------------------------------------------------------------------------
# export

def hf_architecture(cfg: ModelConfig, ckpt: str) -> str:
    """The transformers class that computes what nanomind's model computes with cfg."""
    if not cfg.n_experts:
        return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    if cfg.qk_norm:
        return "Qwen3MoeForCausalLM"
    if cfg.norm_topk_prob:  # Mixtral: LLaMA's attention (no q/k norms), its top-k weights always renormalised
        return "MixtralForCausalLM"
    raise ConfigError(f"{ckpt}: no transformers class computes n_experts={cfg.n_experts} with qk_norm=False and "
                      "norm_topk_prob=False (Qwen3-MoE has q/k norms, Mixtral renormalises the top-k weights)")


def hf_yarn(cfg: ModelConfig) -> dict | None:
    """YaRN's keys as transformers reads them, or None for plain RoPE."""
    if cfg.rope_scaling != "yarn":
        return None
    yarn = {"rope_type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings":
            cfg.rope_original_max_len, "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow}
    if cfg.rope_attention_factor is not None:  # left out, transformers' 0.1 ln(factor) + 1 is nanomind's too
        yarn["attention_factor"] = float(cfg.rope_attention_factor)
    return yarn


def hf_model_config(cfg: ModelConfig, arch: str, tokenizer, dtype: str) -> dict:
    kind, yarn = ARCHITECTURES[arch], hf_yarn(cfg)
    config = {
        "architectures": [arch], "model_type": kind, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.moe_ffn_dim if kind == "mixtral" else cfg.ffn_dim,  # Mixtral's is the experts'
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "attention_bias": False, "attention_dropout": 0.0,
        # rope_theta and rope_scaling (no theta) at the top for transformers 4, vLLM and llama.cpp; rope_parameters
        # for transformers 5
        "rope_theta": cfg.rope_theta, "rope_scaling": yarn,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta} | (yarn or {}),
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
    }
    if cfg.qk_norm:
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    elif kind == "llama":
        config |= {"mlp_bias": False}
    routing = {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
               "output_router_logits": False}
    if kind == "qwen3_moe":  # every layer a mixture of experts: no dense ones between
        config |= routing | {"num_experts": cfg.n_experts, "moe_intermediate_size": cfg.moe_ffn_dim,
                             "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
    elif kind == "mixtral":
        config |= routing | {"num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0, "sliding_window": None}
    return config


# LLaMA-2's [INST] template exactly as chat.encode_chat builds it; the markers are special tokens, so the
# tokenizers library cuts the rendered text at them as encode_chat does
LLAMA2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = none -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('roles must alternate user, assistant, ... starting with user') }}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ bos_token + '[INST]' }}"
    "{%- if loop.first and system is not none -%}"
    "{{ ' <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] + ' ' }}"
    "{%- else -%}{{ ' ' + message['content'] + ' ' }}{%- endif -%}"
    "{{ '[/INST]' }}"
    "{%- else -%}{{ ' ' + message['content'] + ' ' + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order: the two parts tiktoken's own BPE leaves when
    it encodes the token's bytes with only the lower ranks."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            i = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[i] >= rank:
                raise ValueError(f"token {token!r} (rank {rank}) cannot be built from lower ranks")
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def hf_regex(pattern: str) -> str:
    """tiktoken's pattern for Oniguruma (the tokenizers library), which has no \\U and reads \\xHH above 7f as
    a byte, not a character: every \\xHH, \\uHHHH and \\UHHHHHHHH becomes the code point \\x{H...}."""
    return re.sub(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))",
                  lambda m: f"\\x{{{m[1] or m[2] or m[3]}}}", pattern)


def bos_first(bos: str, bos_id: int) -> dict:
    """A tokenizer.json post-processor putting bos before a text, as nanomind's pretraining does before every
    document: tokenizer(text) (transformers, lm-eval) then scores text as training saw it. Chat templates are
    rendered without it (apply_chat_template adds no special tokens)."""
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def tiktoken_to_hf(tokenizer: TiktokenTokenizer) -> dict:
    """nanomind's tiktoken tokenizer as a tokenizer.json: a byte-level BPE, its regex as a Split, specials as added
    tokens at their ids, <s> put before a text as nanomind's pretraining does."""
    ranks, specials = tokenizer.ranks, tokenizer.special_tokens
    char_of = {b: c for c, b in _byte_level_alphabet().items()}
    spell = lambda token: "".join(char_of[b] for b in token)  # noqa: E731
    bos = next(t for t, i in specials.items() if i == tokenizer.bos_id)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in sorted(specials.items(), key=lambda x: x[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": hf_regex(tokenizer.pattern)}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": bos_first(bos, tokenizer.bos_id),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {spell(t): i for t, i in sorted(ranks.items(), key=lambda x: x[1])},
                  "merges": [[spell(a), spell(b)] for a, b in bpe_merges(ranks)]},
    }


def tokenizer_files(tokenizer, directory: Path, max_seq_len: int) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json for the folder."""
    if isinstance(tokenizer, HFTokenizer):  # MiniMind's: its own files, with its own chat template
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if "chat_template" not in config:
            raise ConfigError(f"{directory}: a Hugging Face tokenizer without a chat_template in tokenizer_config.json "
                              "is not exported: its [INST] markers are not single tokens there")
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # what transformers 5 needs to read it without code
        config["add_bos_token"] = True  # MiniMind's file says false; nanomind's pretraining starts documents with it
        data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        bos = next(t["content"] for t in data["added_tokens"] if t["id"] == tokenizer.bos_id)
        return {"tokenizer.json": data | {"post_processor": bos_first(bos, tokenizer.bos_id)},
                "tokenizer_config.json": config}
    if not isinstance(tokenizer, TiktokenTokenizer):
        raise ConfigError(f"{directory}: a SentencePiece tokenizer is not exported (only byte-level BPE tokenizers "
                          "are); train the model with a tiktoken tokenizer, or convert the .model separately")
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[tokenizer.bos_id],
              "eos_token": names[tokenizer.eos_id], "pad_token": names[tokenizer.pad_id], "unk_token": None,
              "model_max_length": max_seq_len, "clean_up_tokenization_spaces": False, "chat_template": LLAMA2_TEMPLATE}
    return {"tokenizer.json": tiktoken_to_hf(tokenizer), "tokenizer_config.json": config}


def export(ckpt: str, out_dir: Path, dtype: str, force: bool):
    state = load_checkpoint(ckpt)
    if not isinstance(state, dict) or not {"model", "model_config", "config"} <= set(state):
        raise CheckpointError(f"{ckpt} is not a nanomind checkpoint (no model, model_config and config)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise ConfigError(f"{out_dir} exists{'' if out_dir.suffix == '.gguf' else ' and is not empty'}: "
                          "pass --force to replace it")
    cfg = ModelConfig(**state["model_config"])
    tokenizer = checkpoint_tokenizer(state)  # the one it trained with, checked against its fingerprint
    tokenizer_dir = Path(trained_tokenizer_path(state) or DEFAULT_DIR)
    files = tokenizer_files(tokenizer, tokenizer_dir, cfg.max_seq_len)
    model, _ = model_from_checkpoint(ckpt)  # a LoRA checkpoint comes merged onto its base
    if out_dir.suffix == ".gguf":
        export_gguf(model.state_dict(), cfg, tokenizer, files, dtype, out_dir, f"nanomind-{state.get('stage')}",
                    f"tokenizer {tokenizer_dir}")
        print(f"{ckpt} -> {out_dir}: GGUF, {architecture(cfg)}, {dtype}, tokenizer from {tokenizer_dir}")
        return
    arch = hf_architecture(cfg, ckpt)
    weights = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # tied: transformers makes lm_head from the embedding
        hf_name = rename(name, NANOMIND_TO_HF)
        weights[mixtral_name(hf_name) if arch == "MixtralForCausalLM" else hf_name] = t.to(getattr(torch, dtype))
    config = hf_model_config(cfg, arch, tokenizer, dtype)
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    # everything goes to a fresh folder beside out_dir, which then replaces it: an error leaves out_dir as it was
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(weights, tmp / "model.safetensors")
    for name, content in [("config.json", config), ("generation_config.json", generation), *files.items()]:
        (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if out_dir.exists():
        shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
    os.replace(tmp, out_dir)
    print(f"{ckpt} -> {out_dir}/: {config['architectures'][0]}, {dtype}, tokenizer from {tokenizer_dir}")


# -----------------------------------------------------------------------------
# merge

def merge(lora_path: str, out_path: str):
    if os.path.exists(out_path):  # nothing already written is overwritten
        raise ConfigError(f"{out_path} already exists: name another output file")
    model, state = model_from_checkpoint(lora_path)  # merged onto its base, whose digest is checked
    if "lora" not in state:
        raise ConfigError(f"{lora_path} is not a LoRA checkpoint: it holds the full model already")
    atomic_save({"model": model.state_dict(), "model_config": state["model_config"], "config": state["config"],
                 "tokenizer": state.get("tokenizer"), "stage": state["stage"], "step": state["step"],
                 "merged_from": lora_path}, out_path)
    print(f"{lora_path} merged onto {state['lora']['base']}: {out_path}")


# -----------------------------------------------------------------------------

def main(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a MiniMind *.pth or a transformers folder -> a nanomind checkpoint")
    imp.add_argument("src", type=Path)
    imp.add_argument("out", type=Path)
    imp.add_argument("--tokenizer", help="the tokenizer directory the weights go with (MiniMind's model/); "
                                         "required unless SRC is a folder holding a tokenizer.json")
    imp.add_argument("--stage", default="sft", choices=["pretrain", "sft", "dpo"],
                     help="sft (default) chats in sample.py; pretrain continues text")
    imp.add_argument("--force", action="store_true", help="overwrite OUT")
    exp = sub.add_parser("export", help="a nanomind checkpoint -> a Hugging Face folder, or a GGUF file")
    exp.add_argument("ckpt")
    exp.add_argument("out_dir", type=Path, metavar="OUT", help="a folder, or a file ending in .gguf (llama.cpp)")
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists (a folder: if it is not empty)")
    mrg = sub.add_parser("merge", help="fold a LoRA checkpoint's adapters into its base: a full checkpoint")
    mrg.add_argument("lora", help="a checkpoint written by train_sft.py or train_dpo.py with lora_rank > 0")
    mrg.add_argument("out", help="the full checkpoint to write (must not exist)")
    args, rest = p.parse_known_args(argv)
    if args.command != "import" and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "export":
        export(args.ckpt, args.out_dir, args.dtype, args.force)
    elif args.command == "merge":
        merge(args.lora, args.out)
    else:
        import_weights(args.src, args.out, args.tokenizer, args.stage, model_flags(rest), args.force)


if __name__ == "__main__":
    cli(main)
