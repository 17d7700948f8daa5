"""
Turn checkpoints into other checkpoints.

    python convert.py merge out/sft_lora/best.pt out/sft_merged.pt   # LoRA adapters folded into their base

merge: a LoRA checkpoint holds only its adapters and the path and digest of the checkpoint they were trained on;
the merged one is a full checkpoint (weights, configs, stage, step; no optimizer) that loads without the base,
everywhere a checkpoint is taken (sample.py, eval_demo.py, --init_from).
"""
import argparse
import os

from train_utils import ConfigError, atomic_save, cli, load_checkpoint, model_from_checkpoint


def merge(lora_path: str, out_path: str):
    if os.path.exists(out_path):  # nothing already written is overwritten
        raise ConfigError(f"{out_path} already exists: name another output file")
    if "lora" not in load_checkpoint(lora_path):
        raise ConfigError(f"{lora_path} is not a LoRA checkpoint: it holds the full model already")
    model, state = model_from_checkpoint(lora_path)  # merged onto its base, whose digest is checked
    atomic_save({"model": model.state_dict(), "model_config": state["model_config"], "config": state["config"],
                 "stage": state["stage"], "step": state["step"], "merged_from": lora_path}, out_path)
    print(f"{lora_path} merged onto {state['lora']['base']}: {out_path}")


def main(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    m = commands.add_parser("merge", help="fold a LoRA checkpoint's adapters into its base: a full checkpoint")
    m.add_argument("lora", help="a checkpoint written by train_sft.py or train_dpo.py with lora_rank > 0")
    m.add_argument("out", help="the full checkpoint to write (must not exist)")
    args = p.parse_args(argv)
    merge(args.lora, args.out)


if __name__ == "__main__":
    cli(main)
