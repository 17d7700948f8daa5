# DPO of the SFT 26M model (configs/sft_26m.py) on MiniMind-format preference pairs. A small lr and beta 0.5
# (larger = closer to the reference) keep the policy near the SFT model it starts from.
out_dir = "out/dpo"
init_from = "out/sft/best.pt"
data_path = "data/dpo.jsonl"
beta = 0.5
length_norm = True
batch_size = 16
epochs = 2
lr = 5e-6
min_lr = 5e-7
warmup_steps = 100
max_grad_norm = 1.0
max_prompt_length = 256
max_completion_length = 256
