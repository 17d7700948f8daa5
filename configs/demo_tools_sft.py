# SFT of the tool task's base model (configs/demo_tools.py) on conversations that call the calculator: the question,
# the call with its two numbers, the result, the answer stating it (prepare_demo.py's tools_sft.jsonl).
out_dir = "out/demo/tools_sft"
init_from = "out/demo/tools_pretrain/best.pt"
data_path = "data/demo/tools_sft.jsonl"
val_fraction = 0.05
pack = False  # padded batches, as this recipe's figures were measured
max_seq_len = 384
flash = True
batch_size = 16
# 400 steps: by then the score no longer hangs on the step where its climb came, for every seed and attention path
# measured (docs/tools.md); agent RL teaches the phrasings SFT never showed
max_steps = 400
lr = 2e-3
min_lr = 2e-4
warmup_ratio = 0.05  # 20 of the 400 steps
log_interval = 25
eval_interval = 110
eval_steps = 5
save_interval = 1000
keep_checkpoints = 1
