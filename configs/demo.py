# A tiny model that learns the synthetic demo data (prepare_demo.py) in minutes on a CPU.
out_dir = "out/demo/pretrain"
data_path = "data/demo/pretrain.jsonl"
val_fraction = 0.05
# nanomind's own tokenizer, trained partly on this synthetic world: with the default (MiniMind's), which spells many
# of its country names in several byte pieces, this 1.6M-parameter model answered 35.8% of the held-out questions
# after SFT instead of 97.5% (docs/demo.md). SFT and DPO take it from their init_from.
tokenizer_path = "vocab/nanomind"
# model: 1.6M parameters, half of them the tied 6400 x 128 embedding
dim = 128
n_layers = 4
n_heads = 4
n_kv_heads = 2
max_seq_len = 128
# SDPA attention in all three demo stages; the math path (the CPU default, as fast here) ends as well: docs/demo.md
flash = True
# optimisation: a small model on a small corpus takes a large learning rate
batch_size = 32
# 900 steps, 1.4 epochs: after 650 it depended on the seed and the float rounding whether the model copied the
# question's country or numbers into its answer or put in ones it had seen more often (docs/demo.md)
max_steps = 900
lr = 3e-3
min_lr = 3e-4
warmup_steps = 30
weight_decay = 0.1
log_interval = 50
eval_interval = 450
eval_steps = 10
save_interval = 1000
keep_checkpoints = 1
