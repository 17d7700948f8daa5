"""
The optimizer and its step's helpers: AdamW with weight decay on matrices only, the learning-rate schedule
(linear warmup, cosine decay) as a pure function of the step, and the guard that decides whether a step with a
non-finite loss or gradient is skipped. The step itself is written out in every train_*.py.
"""
import math

import torch

from errors import NonFiniteError
from runtime import Run, print0


def configure_optimizer(model, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str):
    """AdamW over the trainable parameters (a LoRA model's adapters); weight decay on matmul weights and the
    embedding (>= 2-D), not on norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel for all parameters (on the CPU too, faster than foreach), and it can skip a whole update
    # on the device (NonFiniteGuard), with no host sync: torch has it for CUDA, the CPU and Apple's MPS
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type in ("cuda", "cpu", "mps"))


def get_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup from 0 to lr, cosine decay to min_lr at max_steps, min_lr after. step = optimizer steps taken."""
    if step < warmup_steps:
        return lr * step / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def schedule_length(cfg, loader, val_loader, run: Run) -> tuple[int, int, int]:
    """(max_steps, warmup_steps, steps_per_epoch), printed with the data's size: max_steps if set, else epochs
    of whole accumulated steps."""
    steps_per_epoch = max(1, len(loader) // cfg.accum_steps)
    max_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup_steps = round(cfg.warmup_ratio * max_steps) if cfg.warmup_ratio is not None else cfg.warmup_steps
    print0(f"{len(loader.dataset):,} {loader.name} and {len(val_loader.dataset):,} {val_loader.name}; {max_steps:,} "
           f"steps of {cfg.batch_size} x {cfg.accum_steps} accum x {run.world_size} rank(s), {steps_per_epoch:,} "
           f"per epoch, {warmup_steps:,} of warmup")
    return max_steps, warmup_steps, steps_per_epoch


class NonFiniteGuard:
    """Decides whether an optimizer step is skipped: when its loss or gradient norm is NaN/Inf. It decides on the
    device, with no host sync per step, and tells the optimizer with the flag GradScaler uses: fused AdamW then
    leaves every weight and moment as it was. The skips, and the first parameter with a non-finite gradient, are
    read at log steps (report)."""

    def __init__(self, model, max_bad_steps: int, device):
        self.model, self.max_bad_steps = model, max_bad_steps
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.in_a_row = torch.zeros((), dtype=torch.long, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)  # index into the trainable parameters
        self.reported = 0

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, optimizer):
        """Between clipping and scaler.step(optimizer): a non-finite loss or gradient norm skips this step. (With
        float16, GradScaler skips a step with inf/NaN gradients by itself, overriding the flag with its own.)"""
        bad = ~torch.isfinite(loss + grad_norm)
        self.skipped += bad
        self.in_a_row = (self.in_a_row + 1) * bad
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # = the trainable ones, in order
        first = (~torch.stack(torch._foreach_norm(grads)).isfinite()).int().argmax()
        self.first_bad = torch.where(bad & (self.first_bad < 0), first, self.first_bad)
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()  # GradScaler's signal: fused AdamW skips the whole update on 1
        elif bad.item():  # an optimizer that cannot skip on the device (one host sync): without gradients,
            optimizer.zero_grad(set_to_none=True)  # step() leaves every parameter alone

    def report(self, step: int, loss: float, grad_norm: float) -> int:
        """At a log step: print the steps skipped since the last report; stop after max_bad_steps in a row. Returns
        the steps skipped so far."""
        skipped, in_a_row, first = int(self.skipped), int(self.in_a_row), int(self.first_bad)
        if skipped > self.reported:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            where = f"; first non-finite gradient in {names[first]}" if 0 <= first < len(names) else ""
            print0(f"step {step}: {skipped - self.reported} update(s) skipped for a non-finite loss or gradient "
                   f"norm (now loss {loss}, grad norm {grad_norm}){where}; {in_a_row} in a row")
            self.reported = skipped
            self.first_bad.fill_(-1)
        if in_a_row >= self.max_bad_steps:
            raise NonFiniteError(f"{in_a_row} optimizer steps in a row had a non-finite loss or gradient: "
                                 f"lower lr, check the data, or use bfloat16 instead of float16")
        return self.reported

    def state_dict(self) -> dict:
        return {"skipped": int(self.skipped)}

    def load_state_dict(self, state: dict):
        self.skipped.fill_(state["skipped"])
        self.reported = state["skipped"]
