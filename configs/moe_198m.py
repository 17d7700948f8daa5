# minimind-3-moe's shape: the 64m model with 4 experts per block, one per token (198,416,640 parameters,
# 63,936,768 active per token).
dim = 768
n_layers = 8
n_heads = 8
n_kv_heads = 4
ffn_dim = 2432  # MiniMind's rule: pi * dim rounded up to a multiple of 64
qk_norm = True
norm_eps = 1e-6
vocab_size = 6400
max_seq_len = 512
n_experts = 4
experts_per_token = 1
moe_ffn_dim = 2432
norm_topk_prob = True
router_aux_loss_coef = 5e-4
