# SFT of the demo model (configs/demo.py) on the demo conversations.
out_dir = "out/demo/sft"
init_from = "out/demo/pretrain/best.pt"
data_path = "data/demo/sft.jsonl"
val_fraction = 0.05
pack = False  # padded batches, as the demo's figures were measured (packed SFT does as well: docs/demo.md)
max_seq_len = 128
flash = True  # see configs/demo.py
batch_size = 32
max_steps = 150  # 0.65 epoch: enough for the template; more only wears away what pretraining taught
# 3e-4, not the 2e-5 of the 26M recipe: a 1.6M-parameter model moves little at 2e-5, and 1e-3 wears away the
# capitals pretraining taught (docs/demo.md: how these settings were chosen)
lr = 3e-4
min_lr = 3e-5
# The held-out questions name countries no conversation mentions. Trained, the tied embedding learns to make
# the 83 names SFT sees likelier than the 20 it does not, and the model answers about the wrong country.
freeze_embeddings = True
warmup_ratio = 0.05
log_interval = 20
eval_interval = 50
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
