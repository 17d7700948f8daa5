# MiniMind's small dense model: 25,829,888 parameters with tied embeddings.
dim = 512
n_layers = 8
n_heads = 8
n_kv_heads = 2
vocab_size = 6400
max_seq_len = 512
