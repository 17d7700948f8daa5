"""
LoRA (Hu et al. 2021): fine-tune a frozen model through small low-rank adapters. A target projection W (out, in)
computes

    y = W x + (alpha / r) * B A x,        A (r, in) random, B (out, r) zero,

so a fresh adapter leaves the model exactly as it was, and only A and B -- r * (in + out) numbers per matrix
instead of in * out -- train: no gradients and no AdamW state for the model itself. merge_lora folds B A into W,
which gives a plain Transformer again. Checkpoints of a LoRA run hold only the adapters (checkpoint.Checkpoints);
checkpoint.model_from_checkpoint rebuilds and merges them onto their base.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # attention and SwiGLU projections, by model.py's names


class LoRALinear(nn.Module):
    """A frozen nn.Linear (base) plus a trainable low-rank update; state dict keys base.weight, lora_a, lora_b."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        # float32 whatever the base's dtype: the adapters are what the optimizer updates
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's own init: uniform within 1/sqrt(in)
        self.scale, self.dropout = alpha / rank, dropout
        self.enabled = True  # adapters_off() clears it: the base model again

    def forward(self, x):
        y = self.base(x)
        if not self.enabled:
            return y
        if self.dropout and self.training:  # skipped at 0: F.dropout would still store a copy of x and a mask
            x = F.dropout(x, self.dropout)
        # (..., in) -> (..., r) -> (..., out), added into y in place (linear's backward needs x, not y): no two
        # more (..., out) temporaries per projection. B = 0 adds exactly 0: a fresh adapter changes no logit
        return y.add_(F.linear(F.linear(x, self.lora_a), self.lora_b), alpha=self.scale)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base Linear with W + (alpha / r) B A as its weight (summed in float32)."""
        update = (self.lora_b.float() @ self.lora_a.float()) * self.scale
        self.base.weight.copy_(self.base.weight.float() + update)
        return self.base


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets=TARGETS) -> nn.Module:
    """Freeze every parameter of model, then wrap each Linear named in targets in a LoRALinear (in place)."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha, dropout))
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain Linear back (in place): a Transformer whose
    logits equal the adapted model's to float32 rounding, with its parameters trainable again."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    return model.requires_grad_(True)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors from model.state_dict() (they share its storage): all a LoRA checkpoint saves."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_a", ".lora_b"))}


@contextmanager
def adapters_off(model: nn.Module):
    """The base model, as it was before fine-tuning: adapters off and eval mode (a reference has no dropout).
    DPO's reference is the policy inside this block: one model in memory, not two."""
    layers, training = lora_layers(model), model.training
    for layer in layers:
        layer.enabled = False
    model.eval()
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True
        model.train(training)


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
