# Distillation of the demo model (configs/demo.py, the teacher) into a student of half its width, on the demo's
# pretraining text. `--alpha=0` trains the same student on cross-entropy alone, for comparison.
out_dir = "out/demo/distill"
teacher = "out/demo/pretrain/best.pt"
data_path = "data/demo/pretrain.jsonl"
val_fraction = 0.05
data_kind = "pretrain"
alpha = 0.5
temperature = 2.0
# the student: dim 64 (the teacher's 128), 4 layers, GQA 4/2 heads
dim = 64
n_layers = 4
n_heads = 4
n_kv_heads = 2
max_seq_len = 128
flash = True  # see configs/demo.py
batch_size = 32
max_steps = 300
lr = 3e-3
min_lr = 3e-4
warmup_steps = 30
weight_decay = 0.1
log_interval = 50
eval_interval = 100
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
