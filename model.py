"""
The nanomind model: MiniMind's LLaMA-style decoder in one file.

token embedding -> n_layers x [RMSNorm -> grouped-query attention with RoPE -> +residual,
                               RMSNorm -> SwiGLU feed-forward -> +residual]
                -> RMSNorm -> LM head (tied to the embedding)

Shapes: B batch, T sequence, H query heads, K key/value heads, D head_dim, V vocab.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    # --- model switches: how it computes, not what
    flash: bool | None = None  # attention: True SDPA, False the explicit math path; None: SDPA on CUDA only
    grad_checkpoint: bool = False  # recompute each block in backward: less memory, more compute

    def __post_init__(self):
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

    def uses_flash(self, device_type: str) -> bool:
        return self.flash if self.flash is not None else device_type == "cuda"


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, each (max_seq_len, D/2), in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


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


class KVCache:
    """One layer's keys and values, preallocated once: (B, K, max_len, D); a batch of b <= B rows uses rows 0..b-1.
    Rows share one position (start_pos an int, generate()), or each decodes one token at its own position
    (start_pos a (b,) tensor: a server's batch of requests that started at different times)."""

    def __init__(self, batch_size: int, max_len: int):
        self.shape = (batch_size, max_len)
        self.k = self.v = None  # allocated at the first write, in the dtype attention runs in

    def allocate(self, k, v):
        B, max_len = self.shape
        self.k = k.new_zeros(B, k.size(1), max_len, k.size(3))
        self.v = v.new_zeros(B, v.size(1), max_len, v.size(3))

    def update(self, k, v, start_pos: int | torch.Tensor):
        """Write k, v (b, K, T, D) at start_pos; return the keys and values rows 0..b-1 attend to: (b, K, start_pos
        + T, D), or with per-row positions all max_len of them (attention hides each row's keys past its own)."""
        if self.k is None:
            self.allocate(k, v)
        b = k.size(0)
        if isinstance(start_pos, int):
            end = start_pos + k.size(2)
            self.k[:b, :, start_pos:end] = k
            self.v[:b, :, start_pos:end] = v
            return self.k[:b, :, :end], self.v[:b, :, :end]
        rows = torch.arange(b, device=k.device)
        self.k[rows, :, start_pos] = k[:, :, 0]  # row r's key goes to position start_pos[r]: (b, K, D)
        self.v[rows, :, start_pos] = v[:, :, 0]
        return self.k[:b], self.v[:b]

    def prefix(self, length: int) -> "KVCache":
        """This cache's first `length` positions, sharing its storage: a batch decoding at per-row positions
        attends to the keys up to its longest row, not to all max_len."""
        view = KVCache(self.shape[0], length)
        view.k, view.v = self.k[:, :, :length], self.v[:, :, :length]
        return view

    def copy_row(self, row: int, src: "KVCache", src_row: int, length: int):
        """Row `row`'s first `length` positions <- those of src's row src_row: a request prefilled on its own joins
        a batch, or a batch's last row moves into the place of one that finished."""
        if self.k is None:
            self.allocate(src.k, src.v)
        self.k[row, :, :length] = src.k[src_row, :, :length]
        self.v[row, :, :length] = src.v[src_row, :, :length]


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

    def forward(self, x, cos, sin, cache: KVCache | None = None, start_pos: int | torch.Tensor = 0):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, K, T, D)
        if cache is not None:
            k, v = cache.update(k, v, start_pos)  # (B, K, S, D), S = start_pos + T
        dropout = self.dropout if self.training else 0.0
        if self.config.uses_flash(x.device.type):
            if isinstance(start_pos, int):
                # is_causal masks top-left aligned, right when queries start at key 0; a decode step
                # (start_pos > 0, T == 1, checked by Transformer) attends to every cached key
                mask, causal = None, start_pos == 0
            else:  # one query per row (T == 1) at its own position: it sees its row's keys 0 .. start_pos
                mask, causal = (torch.arange(k.size(2), device=x.device) <= start_pos[:, None])[:, None, None], False
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                               enable_gqa=True)
        else:
            y = self.math_attention(q, k, v, start_pos, dropout)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return F.dropout(self.wo(y), dropout, self.training)

    def math_attention(self, q, k, v, start_pos: int | torch.Tensor, dropout: float):
        """softmax(q k^T / sqrt(D) + causal mask) v, written out; the reference the flash path is tested against.
        Queries go in tiles of ATTENTION_TILE rows, each against only the keys its rows may see, so the tiles above
        the diagonal (nearly half the work when T = S) are never computed."""
        B, H, T, D = q.shape
        K, S = k.size(1), k.size(2)
        # the H // K query heads that share a kv head become rows of one matmul against it: no repeated k, v
        q = (q / math.sqrt(D)).view(B, K, H // K, T, D)
        k, v = k.reshape(B * K, S, D), v.reshape(B * K, S, D)
        if not isinstance(start_pos, int):  # one query per row (T == 1) at its own position, keys 0 .. start_pos
            hidden = torch.arange(S, device=q.device) > start_pos[:, None]  # (B, S)
            mask = torch.zeros(B, S, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
            scores = torch.baddbmm(mask.repeat_interleave(K, dim=0)[:, None], q.reshape(B * K, H // K, D),
                                   k.transpose(1, 2))  # (B * K, H // K, S)
            probs = F.dropout(scores.float().softmax(dim=-1), dropout, self.training)
            return (probs.to(v.dtype) @ v).view(B, H, T, D)
        # query t sits at absolute position start_pos + t and may see keys 0 .. start_pos + t
        hidden = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(diagonal=start_pos + 1)
        mask = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))  # added to scores
        out = []
        for t0 in range(0, T, ATTENTION_TILE):
            t1 = min(t0 + ATTENTION_TILE, T)
            seen = start_pos + t1  # keys the tile's last row sees; the rows above it see fewer (masked)
            q_tile = q[:, :, :, t0:t1].reshape(B * K, H // K * (t1 - t0), D)
            scores = torch.baddbmm(mask[t0:t1, :seen].repeat(H // K, 1), q_tile, k[:, :seen].transpose(1, 2))
            # scores: (B * K, H // K * (t1 - t0), seen), one row per (query head of the group, query)
            probs = F.dropout(scores.float().softmax(dim=-1), dropout, self.training)  # fp32: bf16 loses the tail
            out.append((probs.to(v.dtype) @ v[:, :seen]).view(B, K, H // K, t1 - t0, D))
        return torch.cat(out, dim=3).view(B, H, T, D)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)  # down
        self.dropout = config.dropout

    def forward(self, x):
        return F.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, cache: KVCache | None = None, start_pos: int | torch.Tensor = 0):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, start_pos)
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
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
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

    def hidden_states(self, idx, caches: list[KVCache] | None = None, start_pos: int | torch.Tensor = 0):
        """Token ids (B, T) -> final normalised hidden states (B, T, dim). start_pos: the position of idx[:, 0], or
        a (B,) tensor of each row's position when every row decodes one token at its own (T == 1, with caches)."""
        T = idx.size(1)
        if isinstance(start_pos, int):
            if start_pos + T > self.config.max_seq_len:
                raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len={self.config.max_seq_len}")
            if start_pos > 0 and T > 1:
                raise ValueError("with a KV cache, only the prefill (start_pos 0) may feed more than one token")
            cos, sin = self.rope_cos[start_pos : start_pos + T], self.rope_sin[start_pos : start_pos + T]
        else:
            if T != 1 or not caches:
                raise ValueError("per-row positions decode one token per row, with KV caches")
            cos, sin = self.rope_cos[start_pos, None], self.rope_sin[start_pos, None]  # (B, 1, D/2): a row's own
        x = F.dropout(self.tok_embeddings(idx), self.config.dropout, self.training)
        for i, layer in enumerate(self.layers):
            if self.config.grad_checkpoint and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, caches[i] if caches else None, start_pos)
        return self.norm(x)

    def forward(self, idx, targets=None, loss_mask=None, reduction: str = "mean",
                caches: list[KVCache] | None = None, start_pos: int | torch.Tensor = 0):
        """With targets (B, T): (logits (B, T, V) float32, loss). loss is the mean cross-entropy over positions
        where loss_mask is 1 (all positions when it is None); with reduction="sum" their sum, with
        reduction="none" the per-token cross-entropy (B, T), unmasked.
        Without targets: (logits of the last position (B, 1, V), None)."""
        h = self.hidden_states(idx, caches, start_pos)
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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, **sampling):
        """Prompt (B, T) -> prompt followed by max_new_tokens tokens (fewer if every row hit eos_id). See stream()."""
        return torch.cat([idx, *self.stream(idx, max_new_tokens, **sampling)], dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, repetition_penalty: float = 1.0, eos_id: int | None = None,
               use_cache: bool = True):
        """Yield the next token of every row, (B, 1), one step at a time; temperature 0 is greedy.
        A row that has produced eos_id keeps yielding eos_id; the stream ends when all rows have.
        use_cache=False recomputes the whole prefix every step (the reference the cache is tested against)."""
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        caches = [KVCache(B, total) for _ in self.layers] if use_cache else None
        seq = idx.new_empty(B, total)  # prompt + generated ids, for the uncached path and the repetition penalty
        seq[:, :T] = idx
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        logits, _ = self(idx, caches=caches)  # prefill
        for t in range(T, total):
            next_id = sample_next(logits[:, -1], seq[:, :t], temperature, top_k, top_p, repetition_penalty)
            if eos_id is not None:
                next_id = next_id.masked_fill(done[:, None], eos_id)
                done |= next_id[:, 0] == eos_id
            seq[:, t : t + 1] = next_id
            yield next_id
            if t + 1 == total or (eos_id is not None and done.all()):  # host sync once per token: fine when sampling
                return
            logits, _ = self(next_id, caches=caches, start_pos=t) if use_cache else self(seq[:, : t + 1])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied weight is one parameter, counted once

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), the numerator of MFU."""
        # 2 FLOPs per weight per token forward in every matmul; the embedding lookup is no matmul unless
        # its weight is also the LM head; 1-D norm gains are not matmuls
        n = sum(p.numel() for p in self.parameters() if p.dim() >= 2)
        if not self.config.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        # causal attention: a token at position t does q.k and p.v over t keys, 2 * 2 * H * D * t FLOPs per layer
        # forward; the mean of t over the sequence is seq_len / 2
        attention = 2 * self.config.n_layers * self.config.n_heads * self.config.head_dim * seq_len
        return 3 * (2 * n + attention)

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str):
        """AdamW; weight decay on matmul weights and the embedding (>= 2-D), not on norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused: one kernel for all parameters (on the CPU too, faster than foreach), and it can skip a whole
        # update on the device (train_utils.NonFiniteGuard)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type in ("cuda", "cpu"))


MIN_TEMPERATURE = 1e-5  # sampling at a lower temperature is greedy


def sample_next(logits, history, temperature: float, top_k: int | None, top_p: float | None,
                repetition_penalty: float, generator: torch.Generator | None = None):
    """Pick the next id (B, 1) from last-position logits (B, V) given the ids so far (B, T); random draws come
    from generator (default: torch's global one)."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        # CTRL's penalty on every id already in the sequence: shrink positive logits, push negative ones down
        seen = logits.gather(1, history)
        logits = logits.scatter(1, history, torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty))
    if temperature < MIN_TEMPERATURE:  # 0 means greedy; far below, logits / temperature overflows to inf - inf = nan
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # nucleus: keep the most likely ids until their mass reaches top_p (the first id always stays)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)
