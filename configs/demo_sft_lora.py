# LoRA SFT of the demo model: configs/demo_sft.py's run with rank-8 adapters on every projection (77,824
# parameters train, the 1.6M of the model stay frozen) instead of full fine-tuning.
out_dir = "out/demo/sft_lora"
init_from = "out/demo/pretrain/best.pt"
data_path = "data/demo/sft.jsonl"
val_fraction = 0.05
pack = False  # padded batches, as this recipe's figures were measured
max_seq_len = 128
flash = True  # see configs/demo.py
lora_rank = 8
lora_alpha = 16.0
batch_size = 32
max_steps = 150
# adapters start at zero and are few: they take a larger lr than full fine-tuning's 3e-4
lr = 3e-3
min_lr = 3e-4
warmup_ratio = 0.05
log_interval = 20
eval_interval = 50
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
