"""The network: exact parameter counts and FLOPs, both attention paths against a plain reference, causality, GQA,
the masked loss, gradient checkpointing, and a small model that overfits one batch."""
import copy
import math

import pytest
import torch

import model as model_py
from config import load_config
from conftest import bound, tiny
from model import ModelConfig, Transformer, apply_rope, one_query_attention, reference_attention
from optim import configure_optimizer


def batch(model, B=3, T=17, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T + 1), generator=g)


def test_26m_has_exactly_the_minimind_parameter_count():
    (cfg,) = load_config(["configs/26m.py"], ModelConfig)
    assert cfg.ffn_dim == 1408
    with torch.device("meta"):
        assert Transformer(cfg).num_params() == 25_829_888


def test_104m_has_exactly_the_minimind_parameter_count():
    (cfg,) = load_config(["configs/104m.py"], ModelConfig)
    with torch.device("meta"):
        n = Transformer(cfg).num_params()
    # by hand from the architecture: dim 768, 16 layers, 8 query heads of 96 and 2 key/value heads, vocab 6400
    dim, n_layers, head_dim, n_heads, n_kv_heads, vocab = 768, 16, 96, 8, 2, 6400
    ffn_dim = 64 * -(-8 * dim // (3 * 64))  # the SwiGLU rule, 8/3 dim rounded up to a multiple of 64: 2048
    attention = dim * n_heads * head_dim * 2 + dim * n_kv_heads * head_dim * 2  # wq, wo; wk, wv
    feed_forward = 3 * dim * ffn_dim  # w1 (gate), w3 (up), w2 (down)
    norms = 2 * dim  # attention_norm and ffn_norm gains
    expected = vocab * dim + n_layers * (attention + feed_forward + norms) + dim  # tied embedding/head, final norm
    assert ffn_dim == cfg.ffn_dim == 2048
    assert expected == n == 104_030_976


@pytest.mark.parametrize("bad, message", [
    (dict(n_heads=8, n_kv_heads=3), "n_kv_heads"),
    (dict(dim=100, n_heads=8), "divisible by n_heads"),
])
def test_bad_head_configs_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**dict(dim=64, n_heads=4, n_kv_heads=2), **bad})


def attention_inputs(start_pos, device="cpu", dtype=torch.float32):
    """q (3, 4, T, 16), k and v (3, 2, 20, 16), and where the queries start: 0 or 7 (the last T keys' positions),
    or one query per row at positions 4, 19 and 11. Drawn on the CPU (the same numbers everywhere), then moved."""
    g = torch.Generator().manual_seed(0)
    B, H, K, D, S = 3, 4, 2, 16, 20
    T, start = (1, torch.tensor([4, 19, 11], device=device)) if start_pos == "per row" else (S - start_pos, start_pos)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, K, S, D, generator=g), torch.randn(B, K, S, D, generator=g)
    return *(x.to(device, dtype) for x in (q, k, v)), start


# the math path in one tile (T <= 64 here) and in tiles of 8 and 4 rows, the last one shorter (T = 17, 12, 9)
TILES = [(True, 64), (False, 64), (False, 8), (False, 4)]


@pytest.mark.parametrize("flash, tile", TILES)
@pytest.mark.parametrize("start_pos", [0, 7, "per row"])
def test_both_attention_paths_equal_the_plain_reference(flash, tile, start_pos, device, monkeypatch):
    """A prefill (queries from position 0), a chunk continuing a cache (queries from 7) and one query per row at
    its own position (the keys after it hold values it must not see). float32: on CUDA SDPA repeats the kv heads
    (tests/test_devices.py: its flash kernel with grouped heads, in bfloat16 and float16)."""
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    attention = tiny(flash=flash).layers[0].attention
    q, k, v, start = attention_inputs(start_pos, device)
    attend = attention.sdpa_attention if flash else attention.math_attention
    assert (attend(q, k, v, start, 0.0) - reference_attention(q, k, v, start)).abs().max() <= bound(1e-5, device)


@pytest.mark.parametrize("start_pos", [0, 7, 19, "per row"])
def test_the_math_path_as_compiled_for_generation_equals_the_plain_reference(start_pos, device, monkeypatch):
    """Traced by torch.compile in eval mode, the math path takes a prompt (start 0, 7) in one tile, and one query a
    row (start 19: after every key, or each row at its own position) as multiplies and sums."""
    monkeypatch.setattr(model_py, "ATTENTION_TILE", 4)  # the prompts are longer: eagerly they would go in tiles
    calls = []
    monkeypatch.setattr(model_py, "one_query_attention", lambda *a: calls.append(1) or one_query_attention(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attention = tiny(flash=False).eval().layers[0].attention
    q, k, v, start = attention_inputs(start_pos, device)
    out = attention.math_attention(q, k, v, start, 0.0)
    assert (out - reference_attention(q, k, v, start)).abs().max() <= bound(1e-5, device)
    assert len(calls) == (q.size(2) == 1)


@pytest.mark.parametrize("start_pos", [0, 7, "per row"])
def test_sdpa_with_each_kv_head_repeated_equals_the_plain_reference(start_pos, device, monkeypatch):
    """The route CUDA takes for a mask or float32, where its fused kernels cannot read grouped kv heads."""
    monkeypatch.setattr(model_py, "kernel_takes_groups", lambda q, mask: False)
    attention = tiny(flash=True).layers[0].attention
    q, k, v, start = attention_inputs(start_pos, device)
    assert ((attention.sdpa_attention(q, k, v, start, 0.0) - reference_attention(q, k, v, start)).abs().max()
            <= bound(1e-5, device))


@pytest.mark.parametrize("tile", [64, 8])
def test_flash_and_math_attention_agree_in_logits_and_gradients(tile, device, monkeypatch):
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    flash = tiny(flash=True).to(device)
    math_ = copy.deepcopy(flash)
    math_.config.flash = False  # every layer's attention reads the model's config
    data = batch(flash).to(device)
    logits_f, loss_f = flash(data[:, :-1], data[:, 1:])
    logits_m, loss_m = math_(data[:, :-1], data[:, 1:])
    assert (logits_f - logits_m).abs().max() <= bound(1e-5, device)
    loss_f.backward()
    loss_m.backward()
    for (name, pf), pm in zip(flash.named_parameters(), math_.parameters()):
        assert torch.allclose(pf.grad, pm.grad, atol=bound(1e-6, device), rtol=1e-4), name


def test_causality_a_changed_token_changes_no_earlier_logit():
    model = tiny().eval()
    idx = batch(model, B=2, T=20)[:, :-1]
    changed = idx.clone()
    t = 11
    changed[:, t] = (changed[:, t] + 1) % model.config.vocab_size
    a = model.output(model.hidden_states(idx))
    b = model.output(model.hidden_states(changed))
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-3)


def naive_mha_block_attention(attn, x, cos, sin):
    """Ordinary multi-head attention, one head at a time (n_kv_heads == n_heads)."""
    B, T, _ = x.shape
    H, D = attn.n_heads, attn.head_dim
    q = apply_rope(attn.wq(x).view(B, T, H, D), cos, sin)
    k = apply_rope(attn.wk(x).view(B, T, H, D), cos, sin)
    v = attn.wv(x).view(B, T, H, D)
    mask = torch.ones(T, T).tril().bool()
    heads = []
    for h in range(H):
        scores = q[:, :, h] @ k[:, :, h].transpose(1, 2) / math.sqrt(D)
        heads.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, :, h])
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("flash, tile", TILES)
def test_gqa_with_as_many_kv_heads_as_heads_is_ordinary_mha(flash, tile, monkeypatch):
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = tiny(n_heads=4, n_kv_heads=4, flash=flash)
    attn = model.layers[0].attention
    x = torch.randn(2, 9, 64)
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    assert torch.allclose(attn(x, cos, sin), naive_mha_block_attention(attn, x, cos, sin), atol=1e-6)


def test_gqa_equals_mha_whose_kv_heads_are_repeated_per_group():
    gqa = tiny(n_heads=4, n_kv_heads=2)
    mha = tiny(n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    D = 64 // 4
    for key in list(state):
        if key.endswith(("wk.weight", "wv.weight")):  # (K*D, dim) -> each kv head serves n_heads/K query heads
            state[key] = state[key].view(2, D, 64).repeat_interleave(2, dim=0).reshape(4 * D, 64)
    mha.load_state_dict(state)
    data = batch(gqa)
    assert torch.allclose(gqa(data[:, :-1], data[:, 1:])[0], mha(data[:, :-1], data[:, 1:])[0], atol=1e-5)


def test_loss_is_the_hand_computed_masked_mean_of_cross_entropy():
    model = tiny()
    data = batch(model)
    x, y = data[:, :-1], data[:, 1:]
    mask = (torch.rand(y.shape, generator=torch.Generator().manual_seed(3)) > 0.4).float()
    logits, loss = model(x, y, mask)
    nll = -logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    assert torch.allclose(loss, (nll * mask).sum() / mask.sum(), atol=1e-6)
    assert torch.allclose(model(x, y)[1], nll.mean(), atol=1e-6)


def test_an_all_zero_mask_gives_a_finite_loss_and_zero_gradients():
    model = tiny()
    data = batch(model)
    _, loss = model(data[:, :-1], data[:, 1:], torch.zeros(data[:, 1:].shape))
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert all(p.grad.abs().max() == 0 for p in model.parameters())


def test_the_per_token_cross_entropy_is_the_negated_log_prob_of_each_target():
    model = tiny()
    data = batch(model)
    x, y = data[:, :-1], data[:, 1:]
    logits, _ = model(x, y)
    expected = logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    assert torch.allclose(-model(x, y, reduction="none")[1], expected, atol=1e-5)


def test_grad_checkpoint_gives_the_same_loss_and_gradients(device):
    plain = tiny(dropout=0.1).to(device)
    ckpt = copy.deepcopy(plain)
    ckpt.config.grad_checkpoint = True
    data = batch(plain).to(device)
    losses = []
    for model in (plain, ckpt):
        torch.manual_seed(7)  # same dropout masks (the device's generator too); checkpoint replays its RNG state
        _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=bound(1e-7, device)), name


def test_a_two_layer_model_overfits_one_batch(device):
    model = tiny().to(device)  # on CUDA with its fused AdamW
    data = batch(model, B=4, T=32).to(device)
    opt = configure_optimizer(model, weight_decay=0.0, lr=3e-3, betas=(0.9, 0.95), device_type=device)
    first = None
    for _ in range(300):
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = first or loss.item()
    assert loss.item() < 0.1 * first


def test_flops_per_token_of_26m_by_hand():
    (cfg,) = load_config(["configs/26m.py"], ModelConfig)
    with torch.device("meta"):
        model = Transformer(cfg)
    matmul_weights = 25_829_888 - (2 * 8 + 1) * 512  # minus the RMSNorm gains
    assert model.flops_per_token(512) == 6 * matmul_weights + 6 * 8 * 512 * 512
