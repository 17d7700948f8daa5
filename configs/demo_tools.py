# The calculator task's base model (docs/tools.md): MiniMind's tokenizer, whose ChatML template shows tools, and a
# context that holds the ~250-token tools block. Pretrained on statements of products and on questions worked through
# with the calculator in plain text after the tool's description: it learns to copy numbers from one place to another
# (the products themselves are the calculator's job). Without the worked questions SFT's held-out score jumped from
# ~0% to ~90% somewhere between its 160th and 220th step, depending on the seed; without the description before them
# SFT did not learn to copy the question's first number on one start of an AMD Zen 3 (15% right).
out_dir = "out/demo/tools_pretrain"
data_path = "data/demo/tools_pretrain.jsonl"
val_fraction = 0.01
dim = 128
n_layers = 4
n_heads = 4
n_kv_heads = 2
max_seq_len = 384
flash = True
batch_size = 8
max_steps = 600
lr = 3e-3
min_lr = 3e-4
warmup_steps = 30
weight_decay = 0.1
log_interval = 50
eval_interval = 300
eval_steps = 5
save_interval = 1000
keep_checkpoints = 1
