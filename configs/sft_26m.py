# SFT of the 26M model (configs/26m.py) on MiniMind-format conversations: a small lr teaches the chat template
# without wearing away what pretraining taught.
out_dir = "out/sft"
init_from = "out/pretrain/best.pt"
data_path = "data/sft_mini_512.jsonl"
max_seq_len = 512
batch_size = 32  # rows of 512 tokens, each packed with whole conversations
epochs = 10  # an upper bound: early stopping usually ends it sooner
lr = 2e-5
min_lr = 2e-6
weight_decay = 0.01
warmup_ratio = 0.05
max_grad_norm = 1.0
eval_interval = 500
save_interval = 1000
early_stopping_patience = 3
