"""Rows packed with whole conversations (the positions argument): each token attends only to the earlier tokens of
its own conversation and RoPE restarts at each, so a packed row gives every conversation the logits, loss and
gradients it gets alone, on both attention paths, in any tiling of the math path."""
import pytest
import torch

import model as model_py
from conftest import bound, tiny
from engine import KVCache
from model import apply_rope, packed_visible, reference_attention

LENGTHS = {"A": 7, "B": 12, "C": 5, "D": 13}  # input tokens of each conversation (one more token is its last target)


def conversations(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each conversation's tokens: LENGTHS[name] inputs and the target after the last."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(1, vocab_size, (n + 1,), generator=g) for name, n in LENGTHS.items()}


def pack(convs: dict[str, torch.Tensor], layout: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One packed row: the inputs of the conversations named in layout, "pad" a pad token (id 0, position 0).
    -> idx (T,), positions (T,), and where each conversation lies: name -> slice."""
    idx, positions, where = [], [], {}
    for name in layout:
        n = 1 if name == "pad" else LENGTHS[name]
        if name != "pad":
            where[name] = slice(len(idx), len(idx) + n)
        idx += [0] if name == "pad" else convs[name][:-1].tolist()
        positions += list(range(n))
    return torch.tensor(idx), torch.tensor(positions), where


def logits_of(model, idx, positions=None) -> torch.Tensor:
    """(B, T, V) float32 logits of every position (the targets are a placeholder)."""
    return model(idx, idx, positions=positions)[0]


# two rows, the conversations in different orders and pads at the end and between them: each row its own mask
ROWS = [["A", "B", "C", "pad", "pad"], ["C", "pad", "A", "pad", "B"]]

# (flash, ATTENTION_TILE, model overrides): both paths, grouped heads (tiny's 4 query heads on 2 kv heads) and the
# model variants; the math path also in tiles of 8 rows, which the conversation boundaries (7, 19, 24) fall inside
MOE = {"n_experts": 4, "experts_per_token": 2}
VARIANTS = [(flash, 64, overrides) for flash in (True, False)
            for overrides in ({}, {"qk_norm": True}, {"grad_checkpoint": True}, MOE)]
VARIANTS += [(False, 8, {}), (False, 8, MOE)]


def variant_id(v) -> str:
    return "-".join(str(x) if not isinstance(x, dict) else "_".join(x) or "plain" for x in v)


@pytest.mark.parametrize("flash, tile, overrides", VARIANTS, ids=map(variant_id, VARIANTS))
def test_each_packed_conversation_gets_the_logits_it_gets_alone(flash, tile, overrides, device, monkeypatch):
    """float32 within 1e-5; train mode, so that grad_checkpoint's blocks run checkpointed (dropout is 0). A pad token
    (position 0) is a conversation of its own: the logits of that token alone."""
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = tiny(flash=flash, **overrides).to(device).train()
    convs = conversations(model.config.vocab_size)
    rows = [pack(convs, layout) for layout in ROWS]
    idx, positions = (torch.stack([r[i] for r in rows]).to(device) for i in (0, 1))
    packed = logits_of(model, idx, positions)
    for row, (_, _, where) in enumerate(rows):
        for name, span in where.items():
            alone = logits_of(model, convs[name][None, :-1].to(device))[0]  # today's path: one row, no positions
            assert (packed[row, span] - alone).abs().max() <= bound(1e-5, device), (row, name)
    pad_alone = logits_of(model, torch.zeros(1, 1, dtype=torch.long, device=device))[0, 0]
    assert (packed[idx == 0] - pad_alone).abs().max() <= bound(1e-5, device)  # 4 pads, each seeing itself: no NaN


def test_rope_restarts_at_each_conversation(device, monkeypatch):
    """Each token's queries and keys are rotated as they are when its conversation runs alone (from position 0).
    The logits cannot show this: q.k under RoPE depends only on the distance between two positions."""
    rotated = []

    def recorded(x, cos, sin):  # apply_rope, keeping what it returns: the model's q and k of each call
        rotated.append(apply_rope(x, cos, sin))
        return rotated[-1]

    monkeypatch.setattr(model_py, "apply_rope", recorded)
    model = tiny(n_layers=1).to(device).eval()
    convs = conversations(model.config.vocab_size)
    idx, positions, where = pack(convs, ROWS[1])
    logits_of(model, idx[None].to(device), positions[None].to(device))
    packed_q, packed_k = rotated
    for name, span in where.items():
        rotated.clear()
        logits_of(model, convs[name][None, :-1].to(device))
        for packed, alone in zip((packed_q, packed_k), rotated):  # (1, T, heads, D)
            assert (packed[0, span] - alone[0]).abs().max() <= bound(1e-6, device), name


def changed(idx: torch.Tensor, at: int, vocab_size: int) -> torch.Tensor:
    out = idx.clone()
    out[at] = out[at] % (vocab_size - 1) + 1  # another non-pad token
    return out


@pytest.mark.parametrize("flash", [True, False])
def test_a_changed_token_changes_no_other_conversation(flash, device):
    """Change a token of A, then of B, then of C in the row A B C pad pad: that conversation's logits from the token
    on change, no other conversation's (nor a pad's) does, neither a later nor an earlier one. Exactly: a key hidden
    from a query gets -inf, so weight exactly 0 and adds exactly 0, whatever its value; the other rows of every
    matmul are unchanged. CPU SDPA is exact too; a GPU's fused kernel is held to the device's float32 bound."""
    model = tiny(flash=flash).to(device).eval()
    convs = conversations(model.config.vocab_size)
    idx, positions, where = pack(convs, ROWS[0])
    idx, positions = idx.to(device), positions.to(device)
    before = logits_of(model, idx[None], positions[None])[0]
    exact = device == "cpu" or not flash
    for name, span in where.items():
        at = span.start + 3
        after = logits_of(model, changed(idx, at, model.config.vocab_size)[None], positions[None])[0]
        assert not torch.allclose(after[at:span.stop], before[at:span.stop], atol=1e-3)  # the change shows
        others = torch.ones(len(idx), dtype=torch.bool, device=device)
        others[span] = False
        if exact:
            assert torch.equal(after[others], before[others]), name
        else:
            assert (after[others] - before[others]).abs().max() <= bound(0.0, device), name
    # the control: unpacked, A's change reaches B and C, so the test above would see a leak
    at = where["A"].start + 3
    plain_before = logits_of(model, idx[None])[0]
    plain_after = logits_of(model, changed(idx, at, model.config.vocab_size)[None])[0]
    assert not torch.allclose(plain_after[where["B"]], plain_before[where["B"]], atol=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"grad_checkpoint": True}], ids=["plain", "grad_checkpoint"])
@pytest.mark.parametrize("flash", [True, False])
def test_packed_loss_and_gradients_equal_the_padded_batch(flash, overrides, device):
    """Conversations A, B, C, D packed two to a row (A B pad, C D pad pad) against one padded row each (today's path,
    pads masked out): the same summed loss over the loss_mask (the first two targets of each conversation masked,
    as a prompt) and the same parameter gradients, within 1e-5 of each one's largest in float32."""
    model = tiny(flash=flash, **overrides).to(device).train()
    convs = conversations(model.config.vocab_size, seed=1)
    T = max(LENGTHS.values())
    pad_x, pad_y, pad_mask = (torch.zeros(len(convs), T, dtype=dt) for dt in (torch.long, torch.long, torch.float))
    for i, (name, tokens) in enumerate(convs.items()):
        n = LENGTHS[name]
        pad_x[i, :n], pad_y[i, :n], pad_mask[i, 2:n] = tokens[:-1], tokens[1:], 1.0
    rows = []
    for layout in (["A", "B", "pad"], ["C", "D", "pad", "pad"]):  # 20 tokens each
        x, pos, where = pack(convs, layout)
        y, mask = torch.zeros_like(x), torch.zeros(len(x))
        for name, span in where.items():
            y[span], mask[span.start + 2 : span.stop] = convs[name][1:], 1.0
        rows.append((x, y, mask, pos))
    packed = [torch.stack(column) for column in zip(*rows)]  # x, y, loss_mask, positions: (2, 20) each
    losses, grads = [], []
    for batch in ((pad_x, pad_y, pad_mask, None), packed):
        x, y, mask, pos = (t.to(device) if t is not None else None for t in batch)
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y, mask, reduction="sum", positions=pos)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    tol = bound(1e-5, device)
    assert (losses[1] - losses[0]).abs() <= tol * losses[0].abs()
    for name, g in grads[0].items():
        assert (grads[1][name] - g).abs().max() <= tol * g.abs().max(), name


# boundaries inside tiles, on a tile edge (8, 16) and conversations across several tiles; a row that ends in a pad
TILE_ROWS = [[5, 3, 11, 9, 4], [1, 16, 2, 12, 1]]


def tile_inputs(device):
    """q (2, 4, 32, 16), k and v (2, 2, 32, 16), and TILE_ROWS as positions (2, 32). Drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 16, generator=g)
    k, v = torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in TILE_ROWS])
    return *(t.to(device) for t in (q, k, v, positions)),


@pytest.mark.parametrize("flash, tile", [(True, 64), (False, 64), (False, 8), (False, 6), (False, 4)])
def test_both_attention_paths_with_packed_rows_equal_the_plain_reference(flash, tile, device, monkeypatch):
    """The math path in one tile and in tiles of 8, 6 (the last one shorter) and 4 rows, SDPA, against
    reference_attention, which finds the conversations its own way (counting starts, not cummax)."""
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    attention = tiny(flash=flash).layers[0].attention
    q, k, v, positions = tile_inputs(device)
    attend = attention.sdpa_attention if flash else attention.math_attention
    out = attend(q, k, v, 0, 0.0, packed_visible(positions))
    assert (out - reference_attention(q, k, v, 0, positions)).abs().max() <= bound(1e-5, device)


def test_sdpa_with_packed_rows_and_each_kv_head_repeated_equals_the_plain_reference(device, monkeypatch):
    """The route CUDA takes with a mask: its fused kernels cannot read grouped kv heads."""
    monkeypatch.setattr(model_py, "kernel_takes_groups", lambda q, mask: False)
    attention = tiny(flash=True).layers[0].attention
    q, k, v, positions = tile_inputs(device)
    out = attention.sdpa_attention(q, k, v, 0, 0.0, packed_visible(positions))
    assert (out - reference_attention(q, k, v, 0, positions)).abs().max() <= bound(1e-5, device)


def test_positions_are_refused_with_caches_or_a_start_position():
    """Packing is for training and evaluation; the engine's cached decoding keeps its own positions."""
    model = tiny().eval()
    idx = torch.randint(1, model.config.vocab_size, (2, 6))
    positions = torch.arange(6).repeat(2, 1)
    with pytest.raises(ValueError, match="positions"):
        model(idx, caches=[KVCache(2, 16) for _ in model.layers], positions=positions)
    with pytest.raises(ValueError, match="positions"):
        model(idx, start_pos=3, positions=positions)
    with pytest.raises(ValueError, match="positions"):
        model(idx[:, :1], caches=[KVCache(2, 16) for _ in model.layers], start_pos=torch.tensor([3, 5]),
              positions=positions[:, :1])
    with pytest.raises(ValueError, match="shape"):
        model(idx, positions=positions[:, :5])
