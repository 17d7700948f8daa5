#!/usr/bin/env bash
# The whole pipeline on the synthetic demo data, on a CPU: data -> pretrain -> SFT -> DPO -> RL -> evaluation, then
# tool use: a second small model that learns to call the calculator (pretrain -> SFT -> agent RL -> evaluation).
# Starts fresh in out/demo/ each time.
set -euo pipefail
cd "$(dirname "$0")"
python prepare_demo.py
rm -rf out/demo
python train_pretrain.py configs/demo.py
python train_sft.py configs/demo_sft.py
python train_dpo.py configs/demo_dpo.py
python train_grpo.py configs/demo_grpo.py
python eval_demo.py out/demo/pretrain/best.pt out/demo/sft/best.pt out/demo/dpo/best.pt \
    --dpo_pairs=data/demo/dpo_eval.jsonl --reference=out/demo/sft/best.pt
python plot.py out/demo/pretrain out/demo/sft out/demo/dpo --out=out/demo/plots
for stage in sft dpo; do  # -> out/demo/$stage/report.md
    python eval.py sft --ckpt=out/demo/$stage/best.pt --data_path=data/demo/eval_sft.jsonl --max_records=None \
        --max_new_tokens=48 --samples=5 --plots=out/demo/plots
done
for stage in sft grpo; do  # doubling, which SFT never taught: pass@1 before and after RL -> out/demo/$stage/report.md
    python eval.py pass --ckpt=out/demo/$stage/best.pt --data_path=data/demo/grpo_eval.jsonl --max_new_tokens=16
done
# tool use: MiniMind's tokenizer and template, products of two numbers answered by calling calculate_math
python train_pretrain.py configs/demo_tools.py
python train_sft.py configs/demo_tools_sft.py
python train_grpo.py configs/demo_tools_grpo.py
for stage in tools_sft tools_grpo; do  # held-out products: the answer, the calls -> out/demo/$stage/report.md
    python eval.py toolcall --ckpt=out/demo/$stage/best.pt --data_path=data/demo/tools_eval.jsonl \
        --tools=calculate_math --max_new_tokens=40
done
