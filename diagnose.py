"""
One-shot checks to run before a long job: each finds in minutes a bug that would otherwise show hours into training.

    python diagnose.py overfit configs/26m.py --batch_size=4     # can the model memorise one batch?
    python diagnose.py lr_find configs/26m.py --data_path=data/pretrain_hq.jsonl   # loss vs lr sweep
    python diagnose.py data --data_path=data/sft_mini_512.jsonl --kind=sft        # lengths, duplicates, loss mask
    python diagnose.py activations configs/26m.py                # NaN/Inf, dead or huge activations, odd weights
    python diagnose.py memory configs/26m.py --batch_size=32      # estimated vs measured training memory
    python diagnose.py batch_size configs/26m.py                 # the largest micro-batch that fits the device
    python diagnose.py experts --ckpt=out/pretrain/best.pt --data_path=data/pretrain_hq.jsonl --steps=20  # routing

Keys: Config below and the model's (ModelConfig in model.py), from a config file and --key=value flags; a training
config works as it is (its keys that mean nothing here are named once and dropped); experts takes the model (and the
tokenizer) from --ckpt instead. Without data_path, batches are random tokens. PNGs go to out_dir.
`python diagnose.py --help` lists every key.
"""
import dataclasses
import hashlib
import json
import math
import os
from contextlib import nullcontext

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from chat import encode_chat, show_mask  # noqa: E402
from checkpoint import checkpoint_tokenizer, model_from_checkpoint  # noqa: E402
from config import DPOConfig, PretrainConfig, SFTConfig, help_text, load_config  # noqa: E402
from data import Loader, PretrainData, SFTData  # noqa: E402
from errors import BadRecord, CheckpointError, ConfigError, cli  # noqa: E402
from minhash import SHINGLE, DuplicateFinder, record_text, snippets  # noqa: E402
from memory import MARGIN, GiB, capacity, estimate_memory, find_batch_size, measure_memory, split_global_batch  # noqa: E402
from model import ModelConfig, MoEFeedForward, Transformer  # noqa: E402
from optim import set_lr  # noqa: E402
from runtime import setup  # noqa: E402
from token_cache import encode_pretrain, encode_sft, parse_line, tokenize_file  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclasses.dataclass
class Config:
    # --- I/O
    # a training config's out_dir applies too: the PNGs go beside that run's metrics.jsonl, where they belong; no
    # training script writes these names, and a fresh run refuses only a directory that holds checkpoints
    out_dir: str = "out/diagnose"  # lr_find.png, lengths.png
    ckpt: str | None = None  # experts: the checkpoint whose routing to count (its model; the model keys go unused)
    # --- data
    data_path: str | None = None  # None: random tokens (the data command needs a file)
    kind: str = "pretrain"  # pretrain | sft: how data_path is read
    tokenizer_path: str | None = None  # None: the default, MiniMind's (vocab/minimind/)
    max_records: int | None = None  # data: read only the first this many records
    near_dup_threshold: float = 0.8  # data: estimated Jaccard similarity of character 5-grams of a near duplicate
    # --- the checks (model keys: see ModelConfig)
    batch_size: int = 8  # batch_size: with accum_steps, the global batch per rank to keep
    accum_steps: int = 1  # batch_size: micro-batches per optimizer step
    optimizer: str = "adamw"  # batch_size: adamw | muon, as training's (their state takes memory)
    max_memory_gb: float | None = None  # batch_size: a step's budget; None: the GPU's memory, or the CPU's RAM
    steps: int = 100  # overfit: at most this many steps; lr_find: the length of the sweep; experts: batches
    lr: float = 1e-3  # overfit
    # --- system
    device: str = "auto"
    dtype: str = "auto"  # float16 runs without a loss scaler here: prefer bfloat16 or float32
    seed: int = 1337


# -----------------------------------------------------------------------------
# overfit one batch, and the learning-rate sweep

def train_step(model, optimizer, X, Y, loss_mask, autocast=nullcontext) -> float:
    with autocast():
        _, loss = model(X, Y, loss_mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def overfit(model, batch, steps: int = 100, lr: float = 1e-3, shuffle_labels: bool = False,
            autocast=nullcontext) -> tuple[list[float], bool]:
    """Train on one fixed batch (X, Y, loss_mask) with AdamW; pass once the loss is below 10% of its first value.
    A model that cannot memorise one batch has a bug. shuffle_labels permutes the targets afresh every step:
    a deliberately broken setup, which must fail. Returns (losses, passed); changes the model's weights."""
    X, Y, loss_mask = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        if shuffle_labels:
            Y = Y.flatten()[torch.randperm(Y.numel(), device=Y.device)].view_as(Y)
        losses.append(train_step(model, optimizer, X, Y, loss_mask, autocast))
        if losses[-1] < 0.1 * losses[0]:
            return losses, True
    return losses, False


def lr_find(model, next_batch, steps: int = 100, lr_min: float = 1e-7, lr_max: float = 1.0,
            autocast=nullcontext) -> tuple[list[float], list[float], float]:
    """One AdamW step per lr, lr growing exponentially from lr_min to lr_max, each on next_batch() -> (X, Y, mask);
    stops early once the loss explodes (> 4 x the best so far). Returns (lrs, losses, suggested lr): the lr of the
    steepest descent of the smoothed loss. Changes the model's weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_min, weight_decay=0.0)
    model.train()
    lrs, losses = [], []
    for lr in np.geomspace(lr_min, lr_max, steps):
        set_lr(optimizer, float(lr))
        lrs.append(float(lr))
        losses.append(train_step(model, optimizer, *next_batch(), autocast=autocast))
        if not math.isfinite(losses[-1]) or losses[-1] > 4 * min(losses):
            break
    return lrs, losses, suggest_lr(lrs, losses)


def smooth(values, width: int = 5) -> np.ndarray:
    """Centred moving average (no lag: a lagging curve would point at too large an lr), edges padded."""
    k = min(width, len(values)) // 2 * 2 + 1
    return np.convolve(np.pad(np.asarray(values, float), k // 2, mode="edge"), np.ones(k) / k, mode="valid")


def suggest_lr(lrs: list[float], losses: list[float]) -> float:
    """The lr where the smoothed loss falls fastest per unit of log(lr), the exploded tail left out."""
    n = next((i for i in range(1, len(losses)) if not losses[i] <= 4 * min(losses[:i])), len(losses))
    if n < 3:
        return lrs[int(np.argmin(losses[:n]))]
    return lrs[int(np.argmin(np.gradient(smooth(losses[:n]), np.log(lrs[:n]))))]


def plot_lr_find(lrs, losses, suggested: float, path: str):
    finite = [v for v in losses if math.isfinite(v)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.semilogx(lrs, losses, alpha=0.3, label="loss")
    ax.semilogx(lrs, smooth(losses), label="smoothed")
    ax.axvline(suggested, color="C3", ls="--", label=f"steepest descent: {suggested:.2e}")
    if finite:
        ax.set_ylim(min(finite) * 0.95, min(max(finite), 2 * finite[0]) * 1.05)  # the explosion off the top
    ax.set(xlabel="learning rate", ylabel="loss", title="learning-rate sweep")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -----------------------------------------------------------------------------
# the data report

def data_report(path: str, tokenizer, kind: str, max_seq_len: int, max_records: int | None = None,
                near_dup_threshold: float = 0.8) -> dict:
    """Token lengths of whole records (<s> and </s> included), exact duplicates, near duplicates (the other records
    dedup.py would remove at near_dup_threshold: minhash.py), records longer than one training row (max_seq_len + 1
    tokens: inputs plus the shifted target) and, for SFT, the share of the tokens training sees (after its cut to
    max_seq_len) that carry loss. Unreadable records are counted, not fatal."""
    lengths, seen, duplicates, bad = [], set(), 0, 0
    loss_tokens = train_tokens = no_loss = 0
    sample = None
    field = "text" if kind == "pretrain" else "conversations"
    finder, texts, linenos, copies = DuplicateFinder(near_dup_threshold), [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if max_records is not None and len(lengths) + bad >= max_records:
                break
            if not line.strip():
                continue
            try:
                record = parse_line(line.encode("utf-8"))  # a JSON object, or a BadRecord (however deep or long)
                if kind == "pretrain":
                    (ids,), _ = encode_pretrain(tokenizer, record)
                    cut, mask, key = ids[: max_seq_len + 1], np.ones(min(len(ids), max_seq_len + 1)), record["text"]
                else:
                    ids, _ = encode_chat(tokenizer, record.get("conversations"), record.get("system"))
                    arrays, _ = encode_sft(tokenizer, record, max_len=max_seq_len + 1)  # what training sees
                    cut, mask = arrays if arrays is not None else ([], [])  # None: no answer token fits
                    key = json.dumps([record.get("system"), record["conversations"]], ensure_ascii=False, sort_keys=True)
                texts.append(record_text(record, field))
            except BadRecord:
                bad += 1
                continue
            digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
            copies.append(digest in seen)
            duplicates += copies[-1]
            seen.add(digest)
            lengths.append(len(ids))
            linenos.append(lineno)
            if len(texts) == 1024:  # batches: one numpy pass per thousand texts, not per text
                finder.add(texts)
                texts = []
            train_tokens += len(cut)
            loss_tokens += int(np.sum(mask))
            no_loss += len(cut) == 0
            if sample is None and len(cut):
                sample = show_mask(tokenizer, list(cut[:48]), list(mask[:48]))
    if not lengths:
        raise BadRecord(f"{path}: no usable {kind} records ({bad} unreadable)")
    finder.add(texts)
    near = near_duplicates(path, field, finder.find(), np.array(copies, dtype=bool), linenos)
    a = np.array(lengths)
    report = {"records": len(a), "bad_records": bad, "tokens": int(a.sum()), "mean": float(a.mean()),
              "std": float(a.std()), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
              "max": int(a.max()), "duplicates": duplicates, "duplicate_rate": duplicates / len(a),
              "over_max_seq_len": int((a > max_seq_len + 1).sum()), "lengths": lengths, "sample": sample,
              "near_dup_threshold": near_dup_threshold, "near_duplicates": near["count"],
              "near_duplicate_rate": near["count"] / len(a), "near_examples": near["examples"]}
    if kind == "sft":
        report |= {"loss_token_fraction": loss_tokens / max(train_tokens, 1), "no_loss_records": no_loss}
    return report


def near_duplicates(path: str, field: str, duplicates, copies: np.ndarray, linenos: list[int],
                    n_examples: int = 3) -> dict:
    """The records dedup.py would remove that are not exact copies (copies: counted apart; for SFT, a conversation
    with another system prompt is not one) and up to n_examples of them as (similarity, line, the line of the
    record it resembles, their two snippets), their texts read again from path."""
    near = np.flatnonzero((duplicates.of >= 0) & ~copies)
    pairs = [(int(i), int(duplicates.of[i])) for i in near[:n_examples]]
    wanted, texts = {linenos[k] for pair in pairs for k in pair}, {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(texts) == len(wanted):
                break
            if lineno in wanted:
                texts[lineno] = record_text(json.loads(line), field)
    examples = [(float(duplicates.similarity[i]), linenos[i], linenos[j],
                 snippets(texts[linenos[j]], texts[linenos[i]])) for i, j in pairs]
    return {"count": len(near), "examples": examples}


def print_data_report(r: dict, kind: str, max_seq_len: int):
    print(f"{r['records']:,} records ({r['bad_records']} unreadable), {r['tokens']:,} tokens; length mean "
          f"{r['mean']:.1f}, std {r['std']:.1f}, p50 {r['p50']:.0f}, p95 {r['p95']:.0f}, max {r['max']}")
    if r["std"] > r["mean"]:
        print("✗ lengths vary more than their mean: consider bucketing, or cutting the longest")
    print(f"exact duplicates: {r['duplicates']:,} ({r['duplicate_rate']:.2%})"
          + ("  ✗ over 1%: deduplicate (dedup.py)" if r["duplicate_rate"] > 0.01 else ""))
    print(f"near duplicates (estimated Jaccard >= {r['near_dup_threshold']} of character {SHINGLE}-grams): "
          f"{r['near_duplicates']:,} ({r['near_duplicate_rate']:.2%})"
          + ("  ✗ over 1%: deduplicate (dedup.py)" if r["near_duplicate_rate"] > 0.01 else ""))
    for similarity, line, first_line, (first_snippet, snippet) in r["near_examples"]:
        print(f"  line {line} ~ line {first_line}, similarity {similarity:.2f}:\n"
              f"    {first_snippet!r}\n    {snippet!r}")
    fate = "training cuts them, earliest turns first" if kind == "sft" else "they span several windows"
    print(f"longer than max_seq_len + 1 = {max_seq_len + 1} tokens: {r['over_max_seq_len']:,} ({fate})")
    if kind == "sft":
        print(f"tokens carrying loss (after the cut): {r['loss_token_fraction']:.1%}; conversations with none "
              f"(training skips them): {r['no_loss_records']:,}")
    print(f"the first record, token by token (✓ carries loss):\n{r['sample']}")


def plot_lengths(lengths: list[int], max_seq_len: int, path: str):
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.hist(lengths, bins=50)
    ax.axvline(np.mean(lengths), color="C1", ls="--", label=f"mean {np.mean(lengths):.0f}")
    ax.axvline(max_seq_len + 1, color="C3", label=f"max_seq_len + 1 = {max_seq_len + 1}")
    ax.set(xlabel="tokens per record", ylabel="records", title="length distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -----------------------------------------------------------------------------
# activations and weights

@torch.no_grad()
def check_activations(model, batch, max_abs: float = 1e4) -> list[tuple[str, str]]:
    """One forward of batch (X, Y, loss_mask) with a hook on every module: (module name, problem) for outputs with
    NaN/Inf, all zeros or |x| > max_abs, in the order the modules finished (so the first is where a NaN starts);
    then weights that are not finite or, for matrices, have a std outside [1e-5, 10] (norm gains start constant)."""
    issues = []

    def hook(name):
        def check(module, inputs, output):
            for t in output if isinstance(output, tuple) else (output,):
                if not (torch.is_tensor(t) and t.is_floating_point() and t.numel()):
                    continue
                if not torch.isfinite(t).all():
                    issues.append((name, f"output has {int(t.isnan().sum())} NaN, {int(t.isinf().sum())} Inf"))
                elif not t.any():
                    issues.append((name, "output is all zeros (dead)"))
                elif t.abs().max() > max_abs:
                    issues.append((name, f"output max |x| {t.abs().max().item():.3g} > {max_abs:g}"))
        return check

    handles = [m.register_forward_hook(hook(name or "model")) for name, m in model.named_modules()]
    was_training = model.training
    try:
        model.eval()
        model(*batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            issues.append((name, "weight is not finite"))
        elif p.dim() >= 2 and not 1e-5 <= p.float().std().item() <= 10:
            issues.append((name, f"weight std {p.float().std().item():.3g} outside [1e-5, 10]"))
    return issues


# -----------------------------------------------------------------------------
# memory (measured and estimated in memory.py)

def print_memory(est: dict, measured: dict):
    gib = lambda b: "" if b is None else f"{b / 2**30:10.3f} GiB"  # noqa: E731
    total = lambda m: None if m["peak"] is None else m["weights"] + m["adamw"] + m["peak"]  # noqa: E731
    print(f"{est['n_params']:,} parameters\n{'':40s}{'estimate':>14s}{'measured':>14s}")
    for label, key in [("weights (float32)", "weights"), ("gradients (float32)", "gradients"),
                       ("AdamW moments (2 x float32)", "adamw"), ("activations saved for backward", "activations"),
                       ("step peak above weights + moments", "peak")]:
        print(f"{label:40s}{gib(est[key]):>14s}{gib(measured[key]):>14s}")
    print(f"{'total':40s}{gib(total(est)):>14s}{gib(total(measured)):>14s}")
    print("step peak = activations + gradients + the logits' two float32 gradients (batch x seq x vocab each); "
          "measured, it also holds other temporaries and allocator slack")


# -----------------------------------------------------------------------------
# the experts' routing

@torch.no_grad()
def expert_shares(model, next_batch, n_batches: int, autocast=nullcontext) -> torch.Tensor:
    """The share of the token slots (experts_per_token per token) each expert took in each layer over n_batches
    forwards of next_batch() -> (X, ...): (n_layers, n_experts) float64, each row summing to 1. Read from the MoE
    layers' `load` after each forward, weighted by the batch's tokens (SFT batches differ in length); every position
    counts, padding too, as in training."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    counts = torch.zeros(len(layers), model.config.n_experts, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for _ in range(n_batches):
        X = next_batch()[0]
        with autocast():
            model(X)  # no targets: the logits of the last position only, but every position passes the experts
        counts += torch.stack([m.load for m in layers]).cpu().double() * X.numel()
    model.train(was_training)
    return counts / counts.sum(dim=1, keepdim=True)


def share_limits(n_experts: int, experts_per_token: int) -> tuple[float, float]:
    """(starved, dominant): below a quarter of the fair share 1/n_experts an expert trains on a quarter of a balanced
    one's tokens or fewer; above 3/4 of the way from 1/n_experts to 1/experts_per_token (every token's slot) one
    expert takes so much that, at one expert per token, the others average below the starved line."""
    fair = 1 / n_experts
    return fair / 4, fair + 0.75 * (1 / experts_per_token - fair)


def collapsed_experts(shares: torch.Tensor, experts_per_token: int) -> list[tuple[int, int, float]]:
    """(layer, expert, share) of every expert whose share is outside share_limits."""
    low, high = share_limits(shares.size(1), experts_per_token)
    return [(layer, expert, share) for layer, row in enumerate(shares.tolist())
            for expert, share in enumerate(row) if not low <= share <= high]


EXPERTS_CHECKLIST = """A collapsed router trains a few experts and wastes the others. Check:
  - router_aux_loss_coef: the load-balancing loss (aux_loss in metrics.jsonl) must be on, and weigh enough
  - lr and warmup_steps: a router that moves fast early can lock onto the experts that won the first steps"""


def report_experts(cfg: Config, run):
    if cfg.ckpt is None:
        raise ConfigError("the experts command needs --ckpt: a checkpoint of a model with experts")
    model, state = model_from_checkpoint(cfg.ckpt, run.device)
    c = model.config
    if not c.n_experts:
        raise CheckpointError(f"{cfg.ckpt} is a dense model (n_experts = 0): it has no experts to route tokens to")
    if cfg.data_path is None:
        print("note: random tokens are not what the router learnt on; pass --data_path for the shares training sees")
    print(f"{model.num_params():,} parameters ({model.num_params(active=True):,} active per token), {c.n_experts} "
          f"experts per layer, {c.experts_per_token} per token; {cfg.steps} batches of {cfg.batch_size} x "
          f"{c.max_seq_len} {'random tokens' if cfg.data_path is None else 'from ' + cfg.data_path}, "
          f"{run.dtype} on {run.device}")
    shares = expert_shares(model, batches(cfg, c, run.device, state), cfg.steps, run.autocast)
    low, high = share_limits(c.n_experts, c.experts_per_token)
    print(f"share of the token slots each expert took (fair: 1/{c.n_experts} = {1 / c.n_experts:.1%}; ✗ collapsed)")
    print("layer" + "".join(f"{f'expert {e}':>11}" for e in range(c.n_experts)))
    for layer, row in enumerate(shares.tolist()):
        print((f"{layer:5d}" + "".join(f"{v:>10.1%}{' ' if low <= v <= high else '✗'}" for v in row)).rstrip())
    rule = (f"starved: under 1/(4 n_experts) = {low:.2%}; dominant: over {high:.2%}, 3/4 of the way from "
            f"1/n_experts to 1/experts_per_token")
    bad = collapsed_experts(shares, c.experts_per_token)
    if not bad:
        print(f"✓ no expert collapsed: every share within {low:.2%} .. {high:.2%} ({rule})")
        return
    by_layer: dict[int, list[str]] = {}
    for layer, expert, share in bad:
        by_layer.setdefault(layer, []).append(f"expert {expert} {share:.1%} {'starved' if share < low else 'dominant'}")
    print("✗ collapsed: " + "; ".join(f"layer {layer}: {', '.join(named)}" for layer, named in by_layer.items())
          + f" ({rule})\n" + EXPERTS_CHECKLIST)


# -----------------------------------------------------------------------------

def batches(cfg: Config, model_cfg: ModelConfig, device, state: dict | None = None):
    """next_batch() -> (X, Y, loss_mask) of batch_size x max_seq_len: from data_path, or random tokens. With a
    checkpoint's state, its tokenizer (or tokenizer_path, checked to be the same): other ids would route otherwise."""
    T = model_cfg.max_seq_len
    if cfg.data_path is None:
        g = torch.Generator().manual_seed(cfg.seed)

        def random_batch():
            ids = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, T + 1), generator=g).to(device)
            return ids[:, :-1], ids[:, 1:], torch.ones(cfg.batch_size, T, device=device)
        return random_batch
    tokenizer = checkpoint_tokenizer(state, cfg.tokenizer_path) if state else load_tokenizer(cfg.tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but vocab_size is {model_cfg.vocab_size}")
    if cfg.kind == "pretrain":
        dataset = PretrainData(tokenize_file(cfg.data_path, tokenizer, "pretrain"), T)
    else:  # train_sft.py's options, so both share one token cache
        dataset = SFTData(tokenize_file(cfg.data_path, tokenizer, "sft", skip_bad=False, max_len=T + 1))
    loader = Loader(dataset, cfg.batch_size, tokenizer.pad_id, device=device, seed=cfg.seed)
    return lambda: loader.next_batch()[:3]


OVERFIT_CHECKLIST = """A model that cannot memorise one batch has a bug. Check:
  - the loss function: masked mean cross-entropy over the positions that carry loss
  - the labels: Y is X shifted left by one; the loss mask is not all zero
  - the forward pass: causal attention mask, residual connections, norms
  - the learning rate: try --lr=1e-3 .. 1e-2 and more --steps"""

COMMANDS = {"overfit": "can the model memorise one batch? (one that cannot has a bug)",
            "lr_find": "loss against an exponentially growing lr: lr_find.png and a suggested lr",
            "data": "lengths, exact and near duplicates and (kind=sft) the loss mask of data_path: lengths.png",
            "activations": "NaN/Inf, dead or huge activations in one forward pass, and odd weights",
            "memory": "estimated against measured training memory",
            "batch_size": "the largest micro-batch that fits: the batch_size and accum_steps that keep the global batch",
            "experts": "the share of the tokens each expert of --ckpt takes, per layer, and collapsed experts"}
USAGE = f"usage: python diagnose.py {{{'|'.join(COMMANDS)}}} [config_file.py] [--key=value ...]"
SCHEMAS = (Config, ModelConfig)
TRAINING = (PretrainConfig, SFTConfig, DPOConfig)  # their config files work here as they are


def print_help():
    """The commands, then every key with its default and comment: load_config's list under diagnose's usage line
    (load_config's own names no command)."""
    ignored = {f.name for schema in TRAINING for f in dataclasses.fields(schema)}
    ignored -= {f.name for schema in SCHEMAS for f in dataclasses.fields(schema)}
    keys = help_text(SCHEMAS, ignored).split("\n", 1)[1]
    print("\n".join([USAGE, *(f"  {name:<12} {what}" for name, what in COMMANDS.items()), keys]))


def report_overfit(model, batch, cfg: Config, run):
    losses, passed = overfit(model, batch, cfg.steps, cfg.lr, autocast=run.autocast)
    print("loss: " + " ".join(f"{v:.3f}" for v in losses[:: max(1, len(losses) // 20)]) + f" ... {losses[-1]:.3f}")
    if passed:
        print(f"✓ pass: the loss fell below 10% of its start ({losses[0]:.3f} -> {losses[-1]:.3f}) in {len(losses)} steps")
    else:
        print(f"✗ fail: after {len(losses)} steps the loss is {losses[-1]:.3f}, not below 10% of {losses[0]:.3f}.\n"
              + OVERFIT_CHECKLIST)


def report_lr_find(model, next_batch, cfg: Config, run):
    if cfg.data_path is None:
        print("note: random tokens have nothing to learn; pass --data_path for a meaningful sweep")
    lrs, losses, suggested = lr_find(model, next_batch, cfg.steps, autocast=run.autocast)
    stop = f"stopped early at lr {lrs[-1]:.2e}: the loss exploded" if len(losses) < cfg.steps else "the full sweep"
    print(f"{len(losses)} steps, {stop}\nsuggested lr {suggested:.2e} (steepest descent of the smoothed loss); "
          f"try {suggested / 10:.2e} .. {suggested * 2:.2e}")
    plot_lr_find(lrs, losses, suggested, path := os.path.join(cfg.out_dir, "lr_find.png"))
    print(f"wrote {path}")


def report_data(cfg: Config, model_cfg: ModelConfig):
    if cfg.data_path is None:
        raise ConfigError("the data command needs --data_path")
    report = data_report(cfg.data_path, load_tokenizer(cfg.tokenizer_path), cfg.kind, model_cfg.max_seq_len,
                         cfg.max_records, cfg.near_dup_threshold)
    print_data_report(report, cfg.kind, model_cfg.max_seq_len)
    plot_lengths(report["lengths"], model_cfg.max_seq_len, path := os.path.join(cfg.out_dir, "lengths.png"))
    print(f"wrote {path}")


def report_batch_size(model_cfg: ModelConfig, cfg: Config, run):
    budget = int(cfg.max_memory_gb * GiB) if cfg.max_memory_gb else capacity(run.device)
    if budget is None:
        raise ConfigError("this system does not tell its memory: pass --max_memory_gb")
    global_batch = cfg.batch_size * cfg.accum_steps
    print(f"micro-batches of max_seq_len={model_cfg.max_seq_len} random tokens, {cfg.optimizer}, {run.dtype} on "
          f"{run.device}, up to {global_batch} rows (batch_size x accum_steps); a step may take {MARGIN:.0%} of "
          f"{budget / GiB:.2f} GiB ({'peak allocated' if run.device.type == 'cuda' else 'peak resident memory'})")
    fits = find_batch_size(model_cfg, cfg, run, budget)
    batch_size, accum_steps = split_global_batch(fits, global_batch)
    print(f"largest that fits: {fits}; keeping the global batch of {global_batch} per rank:\n"
          f"--batch_size={batch_size} --accum_steps={accum_steps}")


def main(argv: list[str]):
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        raise ConfigError(USAGE + (f"; {argv[0]!r} is not a command" if argv else ""))
    command = argv[0]
    cfg, model_cfg = load_config(argv[1:], *SCHEMAS, ignored=TRAINING)
    if cfg.kind not in ("pretrain", "sft"):
        raise ConfigError(f"config key 'kind' must be pretrain or sft, got {cfg.kind!r}")
    if cfg.optimizer not in ("adamw", "muon") or not (cfg.max_memory_gb or 1) > 0:
        raise ConfigError(f"config keys 'optimizer' (adamw or muon) and 'max_memory_gb' (above 0): got "
                          f"{cfg.optimizer!r}, {cfg.max_memory_gb!r}")
    if not 0 < cfg.near_dup_threshold <= 1:
        raise ConfigError(f"config key 'near_dup_threshold' must be in (0, 1], got {cfg.near_dup_threshold}")
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if command == "data":
        return report_data(cfg, model_cfg)
    if command == "experts":
        return report_experts(cfg, run)
    if command == "batch_size":
        return report_batch_size(model_cfg, cfg, run)
    next_batch = batches(cfg, model_cfg, run.device)
    model = Transformer(model_cfg).to(run.device)
    print(f"{model.num_params():,} parameters; batches of {cfg.batch_size} x {model_cfg.max_seq_len} "
          f"{'random tokens' if cfg.data_path is None else 'from ' + cfg.data_path}, {run.dtype} on {run.device}")
    if command == "overfit":
        report_overfit(model, next_batch(), cfg, run)
    elif command == "lr_find":
        report_lr_find(model, next_batch, cfg, run)
    elif command == "activations":
        issues = check_activations(model, next_batch())
        for name, problem in issues:
            print(f"✗ {name}: {problem}")
        print(f"{len(issues)} problems; the first activation listed is where it starts" if issues
              else "✓ activations and weights look fine")
    elif command == "memory":
        measured = measure_memory(model, next_batch(), run.autocast)
        print_memory(estimate_memory(model_cfg, cfg.batch_size, run.dtype, run.device.type), measured)


if __name__ == "__main__":
    cli(main)
