# SFT of the tool task's base model (configs/demo_tools.py) on conversations that call the calculator: the question,
# the call with its two numbers, the result, the answer stating it (prepare_demo.py's tools_sft.jsonl).
out_dir = "out/demo/tools_sft"
init_from = "out/demo/tools_pretrain/best.pt"
data_path = "data/demo/tools_sft.jsonl"
val_fraction = 0.05
max_seq_len = 384
flash = True
batch_size = 16
# 220 steps: the model learns to copy the numbers into the call within a few dozen steps around the 180th (at 160 it
# still got 3% of the held-out calls right, at 200 97%); a little after that, so RL starts from a model that calls
max_steps = 220
lr = 2e-3
min_lr = 2e-4
warmup_steps = 20
log_interval = 25
eval_interval = 110
eval_steps = 5
save_interval = 1000
keep_checkpoints = 1
