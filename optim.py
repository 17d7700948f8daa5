"""
The optimizers and their step's helpers: AdamW with weight decay on matrices only, or Muon for the blocks' matrices
beside AdamW for the rest (MuonAdamW); the learning-rate schedule (linear warmup, cosine decay) as a pure function of
the step, and the guard that decides whether a step with a non-finite loss or gradient is skipped. The step itself
is written out in every train_*.py.
"""
import math
import re

import torch

from errors import NonFiniteError
from runtime import Run, print0

OPTIMIZERS = ("adamw", "muon")


def configure_optimizer(model, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str,
                        optimizer: str = "adamw", muon_lr: float = 0.02, muon_momentum: float = 0.95):
    """The optimizer over the trainable parameters (a LoRA model's adapters). adamw: AdamW, weight decay on matmul
    weights and the embedding (>= 2-D), not on norm gains. muon: MuonAdamW, Muon (no weight decay) for every 2-D
    tensor in a block (uses_muon), AdamW as above for the rest: the embedding, the output head, norms."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrices = [p for name, p in params if optimizer == "muon" and uses_muon(name, p)]
    rest = [p for name, p in params if not (optimizer == "muon" and uses_muon(name, p))]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    if optimizer == "muon":
        # set_lr scales every group by lr_ratio: Muon's lr follows the same schedule, muon_lr at its peak
        muon = {"params": matrices, "kind": "muon", "momentum": muon_momentum, "lr_ratio": muon_lr / lr}
        groups = [muon] + [g | {"kind": "adamw"} for g in groups]
        return MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    # fused: one kernel for all parameters (on the CPU too, faster than foreach), and it can skip a whole update
    # on the device (NonFiniteGuard), with no host sync: torch has it for CUDA, the CPU and Apple's MPS
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type in ("cuda", "cpu", "mps"))


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """Which tensors Muon trains: the 2-D ones in a transformer block (layers.N.): attention's wq, wk, wv, wo, the
    feed-forward's w1, w2, w3 (each expert's, and the router's gate), LoRA's adapters on them. Not the embedding,
    the output head (tied or not), a reward model's score head or any norm gain."""
    return p.dim() == 2 and re.search(r"(^|\.)layers\.\d+\.", name) is not None


# nanochat's (Keller Jordan's) quintic: the slope at 0 as steep as it can be while 5 steps still map the singular
# values within ~100x of the largest into roughly [0.7, 1.2]; exact 1s would take more steps and train no better
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """G's orthogonalisation, approximately: U S' V^T for G = U S V^T, every S' near 1 (float32)."""
    a, b, c = NS_COEFFICIENTS
    X = G.float()
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix X X^T
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius >= spectral norm: every singular value <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X  # a X + b (X X^T) X + c (X X^T)^2 X: odd polynomial in X's singular values
    return X.mT if tall else X


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum, then the update orthogonalised by Newton-Schulz) for the groups of kind "muon", AdamW for
    those of kind "adamw", as nanochat trains. Muon: Nesterov momentum on the gradient, newton_schulz, a step of
    lr x sqrt(max(1, rows / cols)) (a tall matrix's orthogonal update has smaller entries). Under DDP the gradient
    is already averaged across ranks, so every rank orthogonalises the same matrix and takes the same step."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "momentum": 0.95, "ns_steps": 5}
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # None: frozen, or the step was skipped (NonFiniteGuard)
                    (self.muon if group["kind"] == "muon" else self.adamw)(p, p.grad, self.state[p], group)

    @staticmethod
    def muon(p, grad, state: dict, group: dict):
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = newton_schulz(grad.lerp(buf, momentum), group["ns_steps"])  # Nesterov: look one step ahead
        p.add_(update.to(p.dtype), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)

    @staticmethod
    def adamw(p, grad, state: dict, group: dict):
        """torch.optim.AdamW's update, written out."""
        if not state:
            state |= {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        state["step"] += 1
        (beta1, beta2), lr, t = group["betas"], group["lr"], state["step"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))


def get_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup from 0 to lr, cosine decay to min_lr at max_steps, min_lr after. step = optimizer steps taken."""
    if step < warmup_steps:
        return lr * step / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float):
    """Every group's lr for this step: lr, or lr x its lr_ratio (MuonAdamW's Muon group: muon_lr / the peak lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


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
