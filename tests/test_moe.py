"""Mixture of experts and YaRN in model.py: the dispatch equals a plain loop over experts and runs only the chosen
ones, MiniMind's load-balancing loss, minimind-3-moe's parameter counts, and transformers' YaRN tables."""
import os
import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import train_pretrain
from checkpoint import load_checkpoint
from conftest import REPO, TINY_MODEL, TINY_RUN, final_weights, pretrain, read_metrics, train_losses
from model import ModelConfig, MoEFeedForward, Transformer, rope_tables
from token_cache import tokenize_file
from tokenizer import load_tokenizer

EXPERTS = ["--n_experts=4", "--experts_per_token=1", "--moe_ffn_dim=48"]


def moe(n_experts=4, k=1, norm=True, dim=32) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(ModelConfig(dim=dim, n_heads=4, n_experts=n_experts, experts_per_token=k,
                                       moe_ffn_dim=48, norm_topk_prob=norm))
    torch.nn.init.normal_(layer.gate.weight, std=0.5)  # a router with opinions: the experts' shares differ
    return layer


def plain_loop(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """MiniMind's MOEFeedForward.forward, written out: every expert over the tokens that chose it."""
    c, flat = layer.config, x.reshape(-1, x.size(-1))
    scores = F.softmax(layer.gate(flat), dim=-1)
    weight, idx = torch.topk(scores, k=c.experts_per_token, dim=-1)
    if c.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(flat)
    for i, expert in enumerate(layer.experts):
        for token, slot in (idx == i).nonzero().tolist():
            y[token] += weight[token, slot] * expert(flat[token])
    return y.view_as(x)


@pytest.mark.parametrize("n_experts, k, norm", [(4, 1, True), (4, 2, True), (8, 2, False), (3, 3, True)])
def test_the_dispatch_equals_a_plain_loop_over_experts_forward_and_backward(n_experts, k, norm):
    layer = moe(n_experts, k, norm)
    x = torch.randn(3, 10, 32, requires_grad=True)
    y = layer(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])
    y_ref = plain_loop(layer, x)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)


def test_each_expert_runs_on_exactly_the_tokens_that_chose_it():
    layer, seen = moe(n_experts=4, k=2), []
    for i, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda m, inputs, out, i=i: seen.append((i, inputs[0].size(0))))
    x = torch.randn(2, 25, 32)
    layer(x)
    chosen = layer.gate(x.reshape(-1, 32)).topk(2, dim=-1).indices
    assert seen == [(i, int((chosen == i).sum())) for i in range(4)]  # 2 x 50 rows in all, never 4 x 50
    assert layer.load.tolist() == torch.tensor([(chosen == i).sum().item() / 100 for i in range(4)]).tolist()


def test_an_expert_no_token_chose_gets_zero_gradients_not_none():
    layer = moe(n_experts=4, k=1)
    with torch.no_grad():
        layer.gate.weight[3] = -100.0 * layer.gate.weight[0].sign()  # expert 3 never wins on these inputs
    x = torch.randn(4, 8, 32).abs() * layer.gate.weight[0].sign()
    layer(x).sum().backward()
    assert layer.load[3] == 0
    for p in layer.experts[3].parameters():
        assert p.grad is not None and not p.grad.any()


def test_the_aux_loss_is_minimind_s_switch_loss_and_trains_the_router():
    layer = moe(n_experts=4, k=2)
    x = torch.randn(2, 30, 32)
    layer(x)
    scores = F.softmax(layer.gate(x.reshape(-1, 32)), dim=-1)
    load = F.one_hot(torch.topk(scores, k=2, dim=-1).indices, 4).float().mean(0)  # MiniMind's lines
    expected = (load * scores.mean(0)).sum() * 4 * 5e-4
    torch.testing.assert_close(layer.aux_loss, expected)
    layer.aux_loss.backward()
    assert layer.gate.weight.grad.abs().sum() > 0 and all(p.grad is None for p in layer.experts.parameters())


def test_a_model_sums_its_layers_aux_losses_and_a_dense_one_has_none():
    torch.manual_seed(0)
    config = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    model = Transformer(ModelConfig(**config, n_experts=4, experts_per_token=2))
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    assert model.aux_loss() == sum(block.feed_forward.aux_loss for block in model.layers) > 0
    dense = Transformer(ModelConfig(**config))
    dense(torch.randint(0, 64, (2, 16)))
    assert dense.aux_loss() == 0


def test_minimind_3_moe_shape_has_its_total_and_active_parameter_counts():
    keys = {k: v for k, v in runpy.run_path(f"{REPO}/configs/moe_198m.py").items() if not k.startswith("__")}
    model = Transformer(ModelConfig(**keys))
    dim, n_layers, head_dim, n_heads, n_kv_heads, ffn_dim, vocab, experts = 768, 8, 96, 8, 4, 2432, 6400, 4
    attention = dim * head_dim * (2 * n_heads + 2 * n_kv_heads) + 2 * head_dim  # wq, wo, wk, wv; q and k norms
    expert = 3 * dim * ffn_dim  # w1 (gate), w3 (up), w2 (down)
    block = attention + experts * expert + dim * experts + 2 * dim  # + the router, the two norms
    total = vocab * dim + n_layers * block + dim  # tied head; the final norm
    assert model.num_params() == total == 198_416_640
    assert model.num_params(active=True) == total - n_layers * (experts - 1) * expert == 63_936_768


@pytest.mark.parametrize("attention_factor", [None, 1.0])
@pytest.mark.parametrize("head_dim, theta, factor, original", [(96, 1e6, 16.0, 2048), (16, 1e4, 4.0, 32)])
def test_yarn_tables_equal_transformers(head_dim, theta, factor, original, attention_factor):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    n = 4 * original
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0}
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                                          max_position_embeddings=n, rope_parameters=rope))
    cos_hf, sin_hf = hf(torch.zeros(1), torch.arange(n)[None])
    cos, sin = rope_tables(ModelConfig(dim=head_dim * 2, n_heads=2, max_seq_len=n, rope_theta=theta,
                                       rope_scaling="yarn", rope_factor=factor, rope_original_max_len=original,
                                       rope_attention_factor=attention_factor))
    # transformers repeats the D/2 frequencies over the two halves of a head
    torch.testing.assert_close(torch.cat([cos, cos], -1), cos_hf[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([sin, sin], -1), sin_hf[0], rtol=0, atol=1e-5)
    plain, _ = rope_tables(ModelConfig(dim=head_dim * 2, n_heads=2, max_seq_len=n, rope_theta=theta))
    assert not torch.allclose(cos, plain)  # scaled: the test would see a YaRN that did nothing


def test_grad_checkpointing_gives_an_moe_model_the_same_gradients_aux_loss_included():
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                                        n_experts=4, experts_per_token=2, router_aux_loss_coef=0.1,
                                        grad_checkpoint=checkpointing))
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        _, loss = model(idx, idx)
        (loss + model.aux_loss()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def expert_shares(out_dir, demo_dir, step: int) -> torch.Tensor:
    """(n_layers, n_experts): the share of 512 demo tokens each expert of the checkpoint takes."""
    ckpt = load_checkpoint(str(out_dir / f"step_{step:07d}.pt"))
    model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    text = tokenize_file(f"{demo_dir}/pretrain.jsonl", load_tokenizer(), "pretrain", verbose=False).token_spans()[0]
    model.eval()
    with torch.no_grad():
        model(torch.tensor(text[-16 * 32 :].astype("int64")).view(16, 32))
    return torch.stack([block.feed_forward.load for block in model.layers])


def test_an_moe_model_pretrains_with_its_aux_loss_logged_and_the_aux_loss_balances_it(demo_dir, tmp_path):
    pretrain(demo_dir, tmp_path / "default", *EXPERTS, "--max_steps=40", "--eval_interval=40")
    rows = [r for r in read_metrics(tmp_path / "default") if "loss" in r]
    assert len(rows) == 40 and all(r["aux_loss"] >= 5e-4 * 0.99 for r in rows)  # balanced, it is coef x k
    assert sum(r["loss"] for r in rows[-5:]) < 0.8 * sum(r["loss"] for r in rows[:5])
    # the same run without the loss lets experts take most of the tokens (here 75% and 97%); with it, in every
    # layer the largest share is smaller
    pretrain(demo_dir, tmp_path / "none", *EXPERTS, "--max_steps=40", "--eval_interval=40", "--router_aux_loss_coef=0")
    largest = {run: expert_shares(tmp_path / run, demo_dir, 40).max(dim=1).values for run in ("default", "none")}
    assert (largest["default"] < largest["none"]).all(), largest


def test_ddp_with_experts_matches_one_process_without_unused_parameter_search(demo_dir, tmp_path):
    # without the aux loss: it is a function of each rank's own tokens (shares times mean scores), so two ranks'
    # mean is not one process's over the same global batch
    common = [f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, *TINY_RUN, *EXPERTS, "--lr=3e-3",
              "--warmup_steps=3", "--max_steps=5", "--accum_steps=2", "--router_aux_loss_coef=0"]
    train_pretrain.main(common + ["--batch_size=4", f"--out_dir={tmp_path / 'single'}"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train_pretrain.py"), *common, "--batch_size=2", f"--out_dir={tmp_path / 'ddp'}"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert set(a) == set(b) and all(abs(a[s] - b[s]) <= 1e-5 for s in a)
    ckpt = load_checkpoint(str(tmp_path / "ddp" / "step_0000005.pt"))
    assert ckpt["rank_weight_diff"] == 0.0  # every expert, used on a rank or not, was all-reduced alike
    single = final_weights(tmp_path / "single", 5)
    assert max((single[k] - ckpt["model"][k]).abs().max().item() for k in single) <= 1e-5
