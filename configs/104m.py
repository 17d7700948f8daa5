# MiniMind's larger dense model: 104,030,976 parameters with tied embeddings.
dim = 768
n_layers = 16
n_heads = 8
n_kv_heads = 2
vocab_size = 6400
max_seq_len = 512
