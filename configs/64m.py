# minimind-3's dense model (MiniMind's Qwen3-style shape): 63,912,192 parameters with tied embeddings.
dim = 768
n_layers = 8
n_heads = 8
n_kv_heads = 4
ffn_dim = 2432  # MiniMind's rule: pi * dim rounded up to a multiple of 64
qk_norm = True
norm_eps = 1e-6
vocab_size = 6400
max_seq_len = 512
