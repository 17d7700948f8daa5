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


def lm_sums(model, X, Y, loss_mask, token_bytes: torch.Tensor, positions=None) -> dict[str, torch.Tensor]:
    """One forward pass: the summed cross-entropy of the scored targets in nats, their number, and the UTF-8
    bytes they stand for. positions: a packed batch's (data.Batch)."""
    _, ce = model(X, Y, reduction="none", positions=positions)  # (B, T) nats per target
    return {"nats": (ce * loss_mask).sum(), "tokens": loss_mask.sum(), "bytes": (token_bytes.to(Y.device)[Y] * loss_mask).sum()}


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Summed cross-entropy in bits per UTF-8 byte: comparable between tokenizers (special tokens' loss counts,
    their bytes are 0)."""
    return nats / math.log(2) / max(n_bytes, 1)


@torch.no_grad()
def evaluate(batch_sums, batches, run: Run) -> dict[str, float]:
    """batch_sums(batch) (a data.Batch) -> {name: scalar tensor}, summed over the batches and over the ranks
    (in float64: a long evaluation's sums stay exact); the caller divides each by the count it summed (tokens,
    pairs), so every item weighs alike however the batches split them."""
    names, totals = [], None
    for batch in batches:
        sums = batch_sums(batch)
        values = torch.stack([v.detach().float() for v in sums.values()]).tolist()  # one host sync per batch
        names, totals = list(sums), values if totals is None else [t + v for t, v in zip(totals, values)]
    if run.ddp:  # every rank holds at least one batch (Loader), perhaps one more than another
        reduced = torch.tensor(totals, dtype=torch.float64, device=run.device)
        dist.all_reduce(reduced)
        totals = reduced.tolist()
    return dict(zip(names, totals))


def lm_totals(model, batches, token_bytes: torch.Tensor, run: Run) -> dict[str, float]:
    """The language-model loss, defined once: the summed cross-entropy of every scored target over their number,
    across all batches and ranks; with its perplexity, bits per byte, tokens and bytes. Training's validation and
    eval.py both report it. The model evaluates in eval mode (no dropout) and is put back as it was."""
    was_training = model.training
    model.eval()
    with run.autocast():
        t = evaluate(lambda b: lm_sums(model, b.X, b.Y, b.loss_mask, token_bytes, b.positions), batches, run)
    model.train(was_training)
    loss = t["nats"] / max(t["tokens"], 1)
    return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte(t["nats"], t["bytes"]),
            "tokens": int(t["tokens"]), "bytes": int(t["bytes"])}


def validation_loss(model, loader, steps: int, run: Run, token_bytes: torch.Tensor) -> dict[str, float]:
    """{val_loss, val_ppl, val_bpb} over the first `steps` validation batches of every rank (lm_totals)."""
    t = lm_totals(model, loader.batches(steps), token_bytes, run)
    return {"val_loss": t["loss"], "val_ppl": t["ppl"], "val_bpb": t["bpb"]}


def sequence_logprobs(model, X, Y, loss_mask, length_norm: bool) -> torch.Tensor:
    """log p(answer | prompt) of every row, (n,): the per-token log-probs of the targets (log_softmax of the
    logits at the target ids = minus the per-token cross-entropy), masked to the answer, summed over the
    sequence; divided by the answer's length when length_norm. Calls model() itself, so DDP sees a forward."""
    _, ce = model(X, Y, reduction="none")  # (n, T)
    logps = (-ce * loss_mask).sum(dim=-1)
    return logps / loss_mask.sum(dim=-1) if length_norm else logps


def pair_logprobs(model, batch, length_norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probs, (pairs,) each, of a batch of preference pairs (data.DPOData's rows: the chosen
    rows, then the rejected; or PackedDPOData's rows: each pair's chosen piece, then its rejected, in turn)."""
    if batch.positions is None:
        return sequence_logprobs(model, batch.X, batch.Y, batch.loss_mask, length_norm).chunk(2)
    _, ce = model(batch.X, batch.Y, reduction="none", positions=batch.positions)  # (B, T)
    logps = piece_sums(-ce * batch.loss_mask, batch.ends)
    if length_norm:
        logps = logps / piece_sums(batch.loss_mask, batch.ends)
    return logps.view(-1, 2).unbind(dim=1)


def piece_sums(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(B, T) values of packed rows -> (pieces,) each piece's sum: the positions after the previous piece's end, up
    to its own (data.Batch's ends). A row's padding counts to the next piece, so its values must be 0 (masked).
    Summed piece by piece in a fixed order, not scattered: atomic adds would make CUDA's sums vary run to run."""
    mine = piece_of(ends, values).flatten() == torch.arange(len(ends), device=values.device)[:, None]  # (pieces, B*T)
    return torch.where(mine, values.flatten(), 0).sum(dim=1)


def piece_of(ends: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: which packed piece each position of a (B, T) batch belongs to (data.Batch's ends); a row's
    padding gets the next piece's number, or len(ends) after the last."""
    return torch.searchsorted(ends, torch.arange(like.numel(), device=like.device)).view(like.shape)
