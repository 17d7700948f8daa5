"""
The nanomind model: MiniMind's LLaMA-style decoder, the network alone (engine.py generates with it).

token embedding -> n_layers x [RMSNorm -> grouped-query attention with RoPE -> +residual,
                               RMSNorm -> SwiGLU feed-forward (or a mixture of SwiGLU experts) -> +residual]
                -> RMSNorm -> LM head (tied to the embedding)

Shapes: B batch, T sequence, H query heads, K key/value heads, D head_dim, V vocab.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from errors import ABOVE_0, AT_LEAST_1, FRACTION, NOT_NEGATIVE, check_ranges


@dataclass
class ModelConfig:
    # --- model: the architecture (saved in every checkpoint; SFT and DPO take it from init_from)
    dim: int = 512  # width of the residual stream
    n_layers: int = 8
    n_heads: int = 8  # query heads
    n_kv_heads: int = 2  # key/value heads, shared by n_heads / n_kv_heads query heads each (GQA)
    vocab_size: int = 6400  # at least the tokenizer's
    max_seq_len: int = 512  # the context: training windows and generation never exceed it
    ffn_dim: int | None = None  # None -> SwiGLU rule: 8/3 * dim rounded up to a multiple of 64
    rope_theta: float = 1e6  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    dropout: float = 0.0
    tie_embeddings: bool = True  # the LM head is the token embedding
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (minimind-3, Qwen3)
    head_dim: int | None = None  # None -> dim / n_heads
    # --- mixture of experts (MiniMind's MOEFeedForward, Qwen3-MoE): each token's feed-forward is its top
    # experts_per_token of n_experts SwiGLUs, weighted by the router's softmax
    n_experts: int = 0  # 0: dense, one feed-forward per block
    experts_per_token: int = 1
    moe_ffn_dim: int | None = None  # each expert's hidden width; None -> ffn_dim
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    router_aux_loss_coef: float = 5e-4  # the load-balancing loss added to the training loss (switch-style)
    # --- RoPE scaling: YaRN (as transformers computes it) for a model run past the length it was trained at
    rope_scaling: str | None = None  # None or "yarn"
    rope_factor: float = 16.0  # how many times longer than rope_original_max_len
    rope_original_max_len: int = 2048
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None  # cos/sin scale; None -> 0.1 ln(rope_factor) + 1
    # --- model switches: how it computes, not what
    flash: bool | None = None  # attention: True SDPA, False the explicit math path; None: SDPA on CUDA only
    grad_checkpoint: bool = False  # recompute each block in backward: less memory, more compute

    def __post_init__(self):
        check_ranges(self, MODEL_RANGES)  # None passes: an Optional key's default, worked out below
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or set head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.ffn_dim is None:
            self.ffn_dim = 64 * math.ceil(8 * self.dim / 3 / 64)
        if self.n_experts:
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise ValueError(f"experts_per_token ({self.experts_per_token}) must be 1..n_experts ({self.n_experts})")
            self.moe_ffn_dim = self.moe_ffn_dim or self.ffn_dim

    def uses_flash(self, device_type: str) -> bool:
        return self.flash if self.flash is not None else device_type == "cuda"


# ModelConfig's keys: key -> (test of its value, the rule as an error says it); None passes (the Optional keys).
# The checks between keys (heads dividing dim, experts_per_token <= n_experts) follow in __post_init__.
MODEL_RANGES = {
    "dim": AT_LEAST_1, "n_layers": AT_LEAST_1, "n_heads": AT_LEAST_1, "n_kv_heads": AT_LEAST_1,
    "vocab_size": AT_LEAST_1, "max_seq_len": AT_LEAST_1, "ffn_dim": AT_LEAST_1,
    "rope_theta": (lambda v: v > 1, "above 1"),  # the base of the wavelengths: 1 gives every pair one frequency
    "norm_eps": ABOVE_0,
    "dropout": FRACTION,
    "head_dim": AT_LEAST_1,  # and even: checked below, also when it comes from dim / n_heads
    "n_experts": (lambda v: v >= 0, "0 (dense) or more"), "experts_per_token": AT_LEAST_1, "moe_ffn_dim": AT_LEAST_1,
    "router_aux_loss_coef": NOT_NEGATIVE,
    "rope_scaling": (lambda v: v == "yarn", "None or 'yarn'"),
    "rope_factor": (lambda v: v >= 1, "at least 1"),  # YaRN stretches the context: below 1 would shrink it
    "rope_original_max_len": AT_LEAST_1,
    "rope_beta_fast": ABOVE_0, "rope_beta_slow": ABOVE_0,  # turns over the original length: their log is taken
    "rope_attention_factor": ABOVE_0,
}


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, each (max_seq_len, D/2), in float32."""
    D = config.head_dim
    wavelengths = config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # theta^(2i/D): each pair's wavelength / 2 pi
    inv_freq, scale = yarn(wavelengths, config) if config.rope_scaling == "yarn" else (1.0 / wavelengths, 1.0)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos() * scale, angles.sin() * scale


def yarn(wavelengths: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than beta_slow times over the original length are divided by the
    factor (interpolated), those that turn more than beta_fast times are kept, a linear ramp between; and the
    attention factor that cos and sin are multiplied by."""
    D, factor, original = config.head_dim, config.rope_factor, config.rope_original_max_len

    def dim_of(turns):  # the dimension whose frequency turns `turns` times over the original length
        return D * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low, high = max(math.floor(dim_of(config.rope_beta_fast)), 0), min(math.ceil(dim_of(config.rope_beta_slow)), D - 1)
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    scale = config.rope_attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    kept = 1 - ramp  # written as transformers writes it, so that the float32 tables are the same
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept, scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, D) by position: cos, sin (T, D/2), or (B, T, D/2) when each row has its own positions.
    Pairs are (x[i], x[i + D/2]) ("rotate half" layout)."""
    cos, sin = cos[..., None, :].to(x.dtype), sin[..., None, :].to(x.dtype)  # (T, 1, D/2); cast: no fp32 round trip
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x is the float32 residual stream even under autocast, so the statistics are float32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# query rows per tile of the math path: 64 was the fastest of 32/64/128/256 for 26m (T = 512) on this CPU
ATTENTION_TILE = 64


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        if config.qk_norm:  # one gain vector per head_dim, shared by all heads
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, config.norm_eps), RMSNorm(self.head_dim, config.norm_eps)
        self.dropout = config.dropout
        self.config = config

    def forward(self, x, cos, sin, cache=None, start_pos: int | torch.Tensor = 0, packed: torch.Tensor | None = None):
        """packed: None (causal), or (B, T, T) bool, the keys each query of a packed row sees (packed_visible)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, K, T, D)
        if cache is not None:  # engine.KVCache: keys and values of every position so far
            k, v = cache.update(k, v, start_pos)  # (B, K, S, D)
        dropout = self.dropout if self.training else 0.0
        attend = self.sdpa_attention if self.config.uses_flash(x.device.type) else self.math_attention
        y = attend(q, k, v, start_pos, dropout, packed)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return F.dropout(self.wo(y), dropout, self.training)

    def sdpa_attention(self, q, k, v, start_pos: int | torch.Tensor, dropout: float, packed=None):
        """PyTorch's fused attention (flash or memory-efficient kernels where the device has them)."""
        T = q.size(2)
        if packed is not None:  # packed conversations: each row its own block-diagonal causal mask
            mask, causal = packed[:, None], False  # (B, 1, T, T)
        elif isinstance(start_pos, int) and (start_pos == 0 or T == 1):
            # is_causal masks top-left aligned, right when queries start at key 0; one query at the end of the
            # cache (a decode step) sees every key
            mask, causal = None, start_pos == 0
        else:  # queries continuing a cache, or rows at their own positions: spelled out
            mask, causal = visible_keys(start_pos, T, k.size(2), q.device)[:, None], False
        grouped = kernel_takes_groups(q, mask)
        if not grouped:  # each query head gets its own copy of its kv head, as enable_gqa pairs them
            k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              enable_gqa=grouped)

    def math_attention(self, q, k, v, start_pos: int | torch.Tensor, dropout: float, packed=None):
        """softmax(q k^T / sqrt(D) + causal mask) v in plain matmuls: fast on a CPU (no fused kernel there beats it
        for training) and the same on every device. Queries go in tiles of ATTENTION_TILE rows, each against only
        the keys its rows may see, so the tiles above the diagonal (nearly half the work when T = S) are never
        computed."""
        B, H, T, D = q.shape
        K, S = k.size(1), k.size(2)
        # the H // K query heads that share a kv head become rows of one matmul against it: no repeated k, v
        q = (q / math.sqrt(D)).view(B, K, H // K, T, D)
        if T == 1 and packed is None and torch.compiler.is_compiling():
            # a compiled decode step: one pass over the cache, where a batched matmul per head group would have
            # MKL pack its one query row and the keys first (a tenth of a 26m step at 8 rows on a CPU)
            return one_query_attention(q, k, v, start_pos, dropout, self.training).view(B, H, T, D)
        k, v = k.reshape(B * K, S, D), v.reshape(B * K, S, D)
        if not isinstance(start_pos, int):  # one query per row (T == 1) at its own position
            visible = visible_keys(start_pos, T, S, q.device)  # (B, 1, S)
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
            scores = torch.baddbmm(mask.repeat_interleave(K, dim=0), q.reshape(B * K, H // K, D),
                                   k.transpose(1, 2))  # (B * K, H // K, S)
            probs = F.dropout(scores.float().softmax(dim=-1), dropout, self.training)
            return (probs.to(v.dtype) @ v).view(B, H, T, D)
        if packed is None:
            # query t sits at position start_pos + t and may see keys 0 .. start_pos + t (visible_keys, in fewer ops:
            # this runs in every layer of every decode step)
            hidden = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(diagonal=start_pos + 1)
            mask = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))  # added to scores
        else:  # packed conversations: each row its own mask, (B, 1, 1, T, S) to broadcast over the heads
            mask = torch.zeros(packed.shape, dtype=q.dtype, device=q.device).masked_fill(~packed, float("-inf"))
            mask = mask[:, None, None]
        out = []
        # compiled for generation, one tile: a loop over T's tiles would make each prompt length a graph of its own
        whole = torch.compiler.is_compiling() and not self.training
        for t0 in [0] if whole else range(0, T, ATTENTION_TILE):
            t1 = T if whole else min(t0 + ATTENTION_TILE, T)
            seen = start_pos + t1  # keys the tile's last row sees; the rows above it see fewer (masked)
            q_tile = q[:, :, :, t0:t1].reshape(B * K, H // K * (t1 - t0), D)
            if packed is None:
                tile_mask = mask[t0:t1, :seen].repeat(H // K, 1)
            else:  # (B * K, H // K * (t1 - t0), seen): the rows of q_tile, each with its batch row's mask
                tile_mask = mask[..., t0:t1, :seen].expand(B, K, H // K, t1 - t0, seen).reshape(B * K, -1, seen)
            scores = torch.baddbmm(tile_mask, q_tile, k[:, :seen].transpose(1, 2))
            # scores: (B * K, H // K * (t1 - t0), seen), one row per (query head of the group, query)
            probs = F.dropout(scores.float().softmax(dim=-1), dropout, self.training)  # fp32: bf16 loses the tail
            out.append((probs.to(v.dtype) @ v[:, :seen]).view(B, K, H // K, t1 - t0, D))
        return torch.cat(out, dim=3).view(B, H, T, D)


def one_query_attention(q, k, v, start_pos: int | torch.Tensor, dropout: float = 0.0, training: bool = False):
    """Attention of one query a row as multiplies and sums, which inductor fuses into one loop over the keys (eagerly
    it would hold (B, K, H // K, S, D) products): q (B, K, H // K, 1, D) already scaled, k and v (B, K, S, D);
    start_pos an int (every key visible) or each row's own position (B,). -> (B, K, H // K, D)."""
    scores = (q * k[:, :, None]).sum(-1)  # (B, K, H // K, S)
    if not isinstance(start_pos, int):
        visible = visible_keys(start_pos, 1, k.size(2), q.device)  # (B, 1, S)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = F.dropout(scores.float().softmax(dim=-1), dropout, training)
    return (probs.to(v.dtype)[..., None] * v[:, :, None]).sum(-2)


def kernel_takes_groups(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA's fused kernel can read grouped kv heads itself (enable_gqa). On CUDA (PyTorch 2.13) only the
    flash kernel can, and it takes neither a mask nor float32 nor a GPU older than Ampere; the memory-efficient
    kernel takes all three but not groups, so for those the kv heads are repeated: otherwise SDPA falls to its math
    kernel and its full (B, H, T, S) scores. A CPU's flash kernel takes groups with masks and float32."""
    return q.device.type != "cuda" or (mask is None and q.dtype in (torch.float16, torch.bfloat16)
                                       and torch.cuda.get_device_capability(q.device)[0] >= 8)


def visible_keys(start_pos: int | torch.Tensor, T: int, S: int, device) -> torch.Tensor:
    """(B or 1, T, S) bool: query t of a row, at position start_pos + t (start_pos an int, or a (B,) tensor of each
    row's own), may see the keys at positions 0 .. its own."""
    positions = torch.as_tensor(start_pos, device=device).view(-1, 1) + torch.arange(T, device=device)  # (B or 1, T)
    return torch.arange(S, device=device) <= positions[..., None]


def packed_visible(positions: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool: query i of a packed row sees key j iff j <= i and j is in i's conversation; positions (B, T)
    are each token's position in its conversation, and a conversation starts where its position is 0."""
    index = torch.arange(positions.size(1), device=positions.device)
    start = torch.cummax(torch.where(positions == 0, index, 0), dim=1).values  # (B, T): where i's conversation starts
    return (index <= index[:, None]) & (index >= start[..., None])


def reference_attention(q, k, v, start_pos: int | torch.Tensor = 0, positions: torch.Tensor | None = None):
    """Causal grouped-query attention in five plain lines, in float32: the oracle both paths are tested against.
    q (B, H, T, D); k, v (B, K, S, D); query t of a row sits at position start_pos + t. positions (B, T), T == S:
    packed conversations, each starting at a 0, that see only themselves."""
    H, T, S = q.size(1), q.size(2), k.size(2)
    k, v = (x.float().repeat_interleave(H // x.size(1), dim=1) for x in (k, v))  # each query head's kv head
    scores = q.float() @ k.transpose(2, 3) / math.sqrt(q.size(3))  # (B, H, T, S)
    visible = visible_keys(start_pos, T, S, q.device)
    if positions is not None:  # counted, not cummax'ed as packed_visible does: the oracle takes another route
        conversation = (positions == 0).cumsum(dim=1)  # (B, T): each token's conversation number
        visible = visible & (conversation[:, :, None] == conversation[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return scores.softmax(dim=-1) @ v


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or config.ffn_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, config.dim, bias=False)  # down
        self.dropout = config.dropout

    def forward(self, x):
        return F.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.dropout, self.training)


class MoEFeedForward(nn.Module):
    """n_experts SwiGLUs and a router: each token goes to its experts_per_token experts of highest softmax score
    and gets their outputs weighted by those scores. Only the chosen experts run, each on its own tokens."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(FeedForward(config, config.moe_ffn_dim) for _ in range(config.n_experts))
        self.aux_loss = torch.zeros(())  # the load-balancing loss of the last forward
        self.load = torch.zeros(config.n_experts)  # the share of token slots each expert took, last forward

    def forward(self, x):
        c, shape = self.config, x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim): the tokens
        scores = self.gate(x).float().softmax(dim=-1)  # (N, E)
        weights, chosen = scores.topk(c.experts_per_token, dim=-1)  # (N, k)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # the (token, slot) pairs sorted by expert: each expert's tokens are one contiguous run
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=c.n_experts)
        rows, slot_weights = order // c.experts_per_token, weights.flatten()[order, None]
        y, start = torch.zeros_like(x), 0
        for expert, n in zip(self.experts, counts.tolist()):
            # an expert no token chose runs on no rows: its gradients are zeros, never missing (DDP needs them)
            run = rows[start : start + n]
            y.index_add_(0, run, (expert(x[run]) * slot_weights[start : start + n]).to(y.dtype))
            start += n
        self.load = counts.float() / counts.sum()
        # switch-style: n_experts x the sum over experts of (share of slots taken) x (mean router score)
        self.aux_loss = c.router_aux_loss_coef * c.n_experts * (counts.float() / x.size(0) * scores.mean(0)).sum()
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MoEFeedForward(config) if config.n_experts else FeedForward(config)

    def forward(self, x, cos, sin, cache=None, start_pos: int | torch.Tensor = 0, packed: torch.Tensor | None = None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, start_pos, packed)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # RoPE tables are derived from the config, so they stay out of the state dict
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        self.apply(self._init_weights)
        # residual output projections: each block adds two, so shrink them to keep the stream's variance flat
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx, caches: list | None = None, start_pos: int | torch.Tensor = 0,
                      positions: torch.Tensor | None = None):
        """Token ids (B, T) -> final normalised hidden states (B, T, dim). caches: one engine.KVCache per layer,
        holding the positions before start_pos. start_pos: the position of idx[:, 0], or a (B,) tensor of each
        row's position when every row decodes one token at its own (T == 1). positions (B, T): rows packed with
        whole conversations, each token's position in its own (0 starts one, each is under max_seq_len: a row may
        be longer, DPO's hold two); each token sees only its own."""
        T, packed = idx.size(1), None
        if positions is not None:
            cos, sin, packed = self.packed_inputs(idx, positions, caches, start_pos)
        elif isinstance(start_pos, int):
            if start_pos + T > self.config.max_seq_len:
                raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len={self.config.max_seq_len}")
            if start_pos > 0 and not caches:
                raise ValueError("start_pos > 0 continues the positions held in KV caches")
            cos, sin = self.rope_cos[start_pos : start_pos + T], self.rope_sin[start_pos : start_pos + T]
        else:
            if T != 1 or not caches:
                raise ValueError("per-row positions decode one token per row, with KV caches")
            cos, sin = self.rope_cos[start_pos, None], self.rope_sin[start_pos, None]  # (B, 1, D/2): a row's own
        x = F.dropout(self.tok_embeddings(idx), self.config.dropout, self.training)
        for i, layer in enumerate(self.layers):
            if self.config.grad_checkpoint and self.training:
                x = checkpoint(layer, x, cos, sin, None, 0, packed, use_reentrant=False)
            else:
                x = layer(x, cos, sin, caches[i] if caches else None, start_pos, packed)
        return self.norm(x)

    def packed_inputs(self, idx, positions, caches, start_pos):
        """RoPE cos, sin (B, T, D/2) at each token's position in its conversation, and packed_visible(positions)."""
        if caches is not None or not isinstance(start_pos, int) or start_pos != 0:
            raise ValueError("positions (packed conversations) are for training and evaluation: no caches, start_pos 0")
        if positions.shape != idx.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must have the shape of idx {tuple(idx.shape)}")
        # the mask is built here, once per forward: every layer reads the same one
        return self.rope_cos[positions], self.rope_sin[positions], packed_visible(positions)

    def forward(self, idx, targets=None, loss_mask=None, reduction: str = "mean", caches: list | None = None,
                start_pos: int | torch.Tensor = 0, positions: torch.Tensor | None = None):
        """With targets (B, T): (logits (B, T, V) float32, loss). loss is the mean cross-entropy over positions
        where loss_mask is 1 (all positions when it is None); with reduction="sum" their sum, with
        reduction="none" the per-token cross-entropy (B, T), unmasked.
        Without targets: (logits of the last position (B, 1, V), None). positions: see hidden_states."""
        h = self.hidden_states(idx, caches, start_pos, positions)
        if targets is None:
            return self.output(h[:, -1:]), None
        logits = self.output(h).float()  # fp32 for the loss: bf16 log-softmax over 6400 classes is too coarse
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        if reduction == "none":
            return logits, ce
        if reduction == "sum":
            return logits, ce.sum() if loss_mask is None else (ce * loss_mask).sum()
        if loss_mask is None:
            return logits, ce.mean()
        # clamp: a batch with nothing to learn gives loss 0 (and zero gradients), never 0/0 = NaN
        return logits, (ce * loss_mask).sum() / loss_mask.sum().clamp(min=1)

    def num_params(self, active: bool = False) -> int:
        """All parameters (a tied weight counted once), or those one token uses: experts_per_token of n_experts."""
        n = sum(p.numel() for p in self.parameters())
        return n - (self.idle_expert_params() if active else 0)

    def idle_expert_params(self) -> int:
        """The parameters of the experts a token does not use, over all layers."""
        c = self.config
        return c.n_layers * (c.n_experts - c.experts_per_token) * 3 * c.dim * c.moe_ffn_dim if c.n_experts else 0

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), the numerator of MFU."""
        # 2 FLOPs per weight per token forward in every matmul; the embedding lookup is no matmul unless
        # its weight is also the LM head; 1-D norm gains are not matmuls
        n = sum(p.numel() for p in self.parameters() if p.dim() >= 2)
        if not self.config.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        n -= self.idle_expert_params()  # a token runs only its chosen experts
        # causal attention: a token at position t does q.k and p.v over t keys, 2 * 2 * H * D * t FLOPs per layer
        # forward; the mean of t over the sequence is seq_len / 2
        attention = 2 * self.config.n_layers * self.config.n_heads * self.config.head_dim * seq_len
        return 3 * (2 * n + attention)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The experts' load-balancing loss of model's last forward, summed over its layers (0 for a dense model):
    the training stages add it to their loss. model may be wrapped (DDP, torch.compile, a reward head)."""
    return sum((m.aux_loss for m in model.modules() if isinstance(m, MoEFeedForward)), torch.zeros(()))
