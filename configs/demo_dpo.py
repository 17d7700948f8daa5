# DPO of the demo SFT model (configs/demo_sft.py) on the demo preference pairs, whose rejected answers are
# wrong or in the wrong language.
out_dir = "out/demo/dpo"
init_from = "out/demo/sft/best.pt"
data_path = "data/demo/dpo.jsonl"
val_fraction = 0.05
max_prompt_length = 64
max_completion_length = 64
flash = True  # see configs/demo.py
precompute_ref = True  # the reference's log-probs once, then one model in memory and half the forward passes
# beta 2 and lr 3e-5, not the 0.5 and 5e-6 of the 26M recipe (configs/dpo_26m.py): a 1.6M-parameter model barely
# moves at 5e-6, and higher rates buy reward accuracy with wrong answers (docs/demo.md)
beta = 2.0
# sum, not mean, of the answer's log-probs: chosen and rejected answers here share most of their tokens, and
# under the per-token mean DPO gains margin by making those shared tokens less likely
length_norm = False
freeze_embeddings = True  # as in configs/demo_sft.py
batch_size = 32
epochs = 2  # 178 steps
lr = 3e-5
min_lr = 3e-6
warmup_steps = 10
log_interval = 10
eval_interval = 50
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
