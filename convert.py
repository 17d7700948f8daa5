"""
Move weights between nanomind and the Hugging Face world.

    python convert.py import full_sft_768.pth out/minimind.pt --tokenizer=minimind/model   # minimind-3's state dict
    python convert.py import full_sft_512.pth out/minimind2.pt --tokenizer=minimind/model --n_heads=8   # MiniMind2's
    python convert.py import full_sft_768_moe.pth out/moe.pt --tokenizer=minimind/model     # minimind-3-moe's
    python convert.py import MiniMind2-Small/ out/minimind2.pt                              # a transformers folder
    python convert.py export out/sft/best.pt hf/ [--dtype=bfloat16] [--force]
    python convert.py export out/sft/best.pt model.gguf [--dtype=float16]                  # llama.cpp, Ollama
    python convert.py export out/sft/best.pt model.gguf --dtype=q4_k       # quantized: q8_0 | q4_0 | q4_k (Q4_K_M)
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
llama.cpp instead (gguf_export.py), which --dtype may also quantize as llama.cpp's quantizer does (gguf_quant.py).

merge: a LoRA checkpoint holds only its adapters and the path and digest of the checkpoint they were trained on;
the merged one is a full checkpoint (weights, configs, tokenizer, stage, step; no optimizer) that loads without
the base. (Every tool that takes a checkpoint also merges a LoRA one on load.)

The mapping between the two lives in hf_export.py; safetensors is read and written without a library
(safetensors_io.py).
"""
import dataclasses
import json
import os
import typing
from pathlib import Path

import torch

from checkpoint import (atomic_save, checkpoint_tokenizer, load_checkpoint, load_model_state, model_from_checkpoint,
                        trained_tokenizer_path)
from config import check_type, flag_setting, load_config, usage, words
from errors import CheckpointError, ConfigError, check_ranges, cli
from fileio import atomic_dir
from gguf_export import QUANTIZED, architecture, export_gguf
from hf_export import (config_from_hf, hf_architecture, hf_model_config, hf_weights, infer_config, per_expert,
                       to_nanomind, tokenizer_files)
from model import ModelConfig, Transformer
from safetensors_io import read_safetensors, write_safetensors
from tokenizer import DEFAULT_DIR, NANOMIND_DIR, load_tokenizer

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


def model_flags(args: list[str]) -> dict:
    """--key=value ModelConfig keys (a bool key alone is True, as everywhere)."""
    fields = {name: (ModelConfig, t) for name, t in typing.get_type_hints(ModelConfig).items()}
    flags = {}
    for arg in args:
        key, value = flag_setting(arg, fields)
        if key not in fields:
            raise ConfigError(f"unknown model key {key!r}; known keys: {', '.join(fields)}")
        flags[key] = check_type(key, value, fields[key][1], "command line")
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

def export(ckpt: str, out_dir: Path, dtype: str, force: bool):
    if dtype in QUANTIZED and out_dir.suffix != ".gguf":  # safetensors holds no ggml blocks
        raise ConfigError(f"dtype: {dtype} is a GGUF type: name OUT *.gguf, or export the folder in float32, "
                          "bfloat16 or float16")
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
    weights = hf_weights(model.state_dict(), cfg, arch, dtype)
    config = hf_model_config(cfg, arch, tokenizer, dtype)
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    with atomic_dir(out_dir) as tmp:  # a fresh folder that then replaces out_dir: an error leaves out_dir as it was
        write_safetensors(weights, tmp / "model.safetensors")
        for name, content in [("config.json", config), ("generation_config.json", generation), *files.items()]:
            (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
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

@dataclasses.dataclass
class Config:
    # --- the command: import (weights -> a checkpoint), export (a checkpoint -> a folder, or OUT.gguf), merge (LoRA)
    command: list[str] = words("{import|export|merge} SRC OUT")  # merge: SRC a LoRA checkpoint, OUT a new file
    # --- import (also takes ModelConfig's keys that the weights cannot tell, as --n_heads=8)
    tokenizer: str | None = None  # the tokenizer folder of the weights (MiniMind's model/); None: SRC's tokenizer.json
    stage: str = "sft"  # pretrain | sft | dpo: sft chats in sample.py; pretrain continues text
    # --- export
    dtype: str = "float32"  # float32 | bfloat16 | float16; a .gguf also q8_0 | q4_0 | q4_k (llama.cpp's Q4_K_M)
    # --- import and export
    force: bool = False  # replace OUT if it exists (an exported folder: if it is not empty)

    def __post_init__(self):
        check_ranges(self, {"stage": (lambda v: v in ("pretrain", "sft", "dpo"), "pretrain, sft or dpo"),
                            "dtype": (lambda v: v in ("float32", "bfloat16", "float16", *QUANTIZED),
                                      "float32, bfloat16, float16, or for a .gguf q8_0, q4_0 or q4_k")})


KEYS = {"import": ("tokenizer", "stage", "force"), "export": ("dtype", "force"), "merge": ()}  # import: + ModelConfig's


def parse_args(argv: list[str]) -> tuple[Config, list[str]]:
    """The command line's Config and import's ModelConfig flags (model_flags reads them); a key of another command
    is an error."""
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    model = [a for a in argv if a.startswith("--") and a[2:].partition("=")[0] in model_keys]
    (cfg,) = load_config([a for a in argv if a not in model], Config)
    if len(cfg.command) != 3 or cfg.command[0] not in KEYS:
        raise ConfigError(f"{usage([Config])}; got {' '.join(cfg.command) or 'no command'}")
    command = cfg.command[0]
    wrong = [f"--{f.name}" for f in dataclasses.fields(Config)[1:]
             if getattr(cfg, f.name) != f.default and f.name not in KEYS[command]]
    wrong += [a.partition("=")[0] for a in model if command != "import"]
    if wrong:
        raise ConfigError(f"{command} takes no {', '.join(wrong)} (convert.py --help)")
    return cfg, model


def main(argv: list[str]):
    args, model_args = parse_args(argv)
    command, src, out = args.command
    if command == "export":
        export(src, Path(out), args.dtype, args.force)
    elif command == "merge":
        merge(src, out)
    else:
        import_weights(Path(src), Path(out), args.tokenizer, args.stage, model_flags(model_args), args.force)


if __name__ == "__main__":
    cli(main)