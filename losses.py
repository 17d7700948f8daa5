"""
What the stages and eval.py measure, defined once: the masked cross-entropy sums of a batch, bits per byte (the
loss per UTF-8 byte of text, comparable between tokenizers), a sequence's log-probability (DPO, multiple choice),
and the validation loss over a loader.
"""
import math

import torch
import torch.distributed as dist

from runtime import Run


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700))


def count_token_bytes(tokenizer) -> torch.Tensor:
    """(vocab_size,) int64: how many UTF-8 bytes of text each id stands for; 0 for special tokens (<s>, </s>,
    <pad>, [INST], <|im_end|> and other added tokens), which are markup, not text. Bits per byte divide by these."""
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    if hasattr(tokenizer, "sp"):  # SentencePiece: byte pieces are one byte, "▁" is a space
        sp = tokenizer.sp
        for i in range(sp.vocab_size()):
            if not sp.is_control(i):
                counts[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("▁", " ").encode())
        return counts
    enc = tokenizer.enc  # tiktoken runs nanomind's BPE and Hugging Face's byte-level BPE alike
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    for i in range(min(enc.n_vocab, tokenizer.vocab_size)):
        if i not in special:
            try:
                counts[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # an id no token has (Hugging Face vocabularies may have gaps)
                pass
    return counts


def lm_sums(model, X, Y, loss_mask, token_bytes: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward pass: the masked mean cross-entropy ("loss", as training computes it) and, for bits per byte,
    the summed cross-entropy of the scored targets in nats and the UTF-8 bytes those targets stand for."""
    _, ce = model(X, Y, reduction="none")  # (B, T) nats per target
    return {"loss": (ce * loss_mask).sum() / loss_mask.sum().clamp(min=1), "nats": (ce * loss_mask).sum(),
            "bytes": (token_bytes.to(Y.device)[Y] * loss_mask).sum()}


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Summed cross-entropy in bits per UTF-8 byte: comparable between tokenizers (special tokens' loss counts,
    their bytes are 0)."""
    return nats / math.log(2) / max(n_bytes, 1)


@torch.no_grad()
def evaluate(loss_fn, loader, steps: int, run: Run) -> dict[str, float]:
    """Mean of loss_fn(X, Y, loss_mask, indices) -> {name: scalar tensor} over (up to) the first `steps` evaluation
    batches of every rank, reduced over ranks once at the end (ranks may hold one batch more or less)."""
    totals, n = None, 0
    for batch in loader.batches(steps):
        metrics = loss_fn(*batch)
        values = torch.stack([v.detach().float() for v in metrics.values()])
        totals = values if totals is None else totals + values
        n += 1
    summed = torch.cat([totals, torch.tensor([float(n)], device=totals.device)])
    if run.ddp:
        dist.all_reduce(summed)
    return {k: (v / summed[-1]).item() for k, v in zip(metrics, summed[:-1])}


def validation_loss(model, loader, steps: int, run: Run, token_bytes: torch.Tensor) -> dict[str, float]:
    """{val_loss, val_ppl, val_bpb} on the first `steps` validation batches: val_loss is the language-model loss
    (masked mean cross-entropy, per batch, averaged), val_bpb the summed cross-entropy of all their scored targets
    over their bytes."""
    model.eval()
    with run.autocast():
        sums = evaluate(lambda X, Y, M, _: lm_sums(model, X, Y, M, token_bytes), loader, steps, run)
    model.train()
    # evaluate() averages every entry over the batches alike, so nats / bytes is the ratio of the totals
    return {"val_loss": sums["loss"], "val_ppl": perplexity(sums["loss"]),
            "val_bpb": bits_per_byte(sums["nats"], sums["bytes"])}


def sequence_logprobs(model, X, Y, loss_mask, length_norm: bool) -> torch.Tensor:
    """log p(answer | prompt) of every row, (n,): the per-token log-probs of the targets (log_softmax of the
    logits at the target ids = minus the per-token cross-entropy), masked to the answer, summed over the
    sequence; divided by the answer's length when length_norm. Calls model() itself, so DDP sees a forward."""
    _, ce = model(X, Y, reduction="none")  # (n, T)
    logps = (-ce * loss_mask).sum(dim=-1)
    return logps / loss_mask.sum(dim=-1) if length_norm else logps
