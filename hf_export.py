"""
nanomind's model and tokenizer in Hugging Face's terms, both ways.

  import: a state dict in Hugging Face's names (LLaMA, Qwen3, Qwen3-MoE, Mixtral; MiniMind's are LLaMA's) and its
          config.json -> ModelConfig and nanomind's state dict; what nanomind's model cannot compute is refused in
          one error naming the keys
  export: ModelConfig -> the transformers class that computes the same, its config.json and weights in its names;
          the tokenizer as tokenizer.json and tokenizer_config.json (a chat template rendering chat.encode_chat's)
convert.py reads and writes the files; gguf_export.py takes the tokenizer files too.
"""
import json
import math
import re
from pathlib import Path

import torch

from errors import CheckpointError, ConfigError
from model import ModelConfig, Transformer
from tokenizer import HFTokenizer, TiktokenTokenizer, _byte_level_alphabet


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
# import: config.json and the tensor shapes -> ModelConfig, the weights -> nanomind's

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


# -----------------------------------------------------------------------------
# export: ModelConfig -> config.json, the weights in the transformers class's names

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


def hf_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, arch: str, dtype: str) -> dict[str, torch.Tensor]:
    """nanomind's weights in arch's names, cast to dtype; a tied lm_head is left out."""
    weights = {}
    for name, t in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # tied: transformers makes lm_head from the embedding
        hf_name = rename(name, NANOMIND_TO_HF)
        weights[mixtral_name(hf_name) if arch == "MixtralForCausalLM" else hf_name] = t.to(getattr(torch, dtype))
    return weights


# -----------------------------------------------------------------------------
# export: the tokenizer as tokenizer.json and tokenizer_config.json

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
