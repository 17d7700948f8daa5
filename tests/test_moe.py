"""Mixture of experts and YaRN in model.py: the dispatch equals a plain loop over experts and runs only the chosen
ones, MiniMind's load-balancing loss, minimind-3-moe's parameter counts, and transformers' YaRN tables."""
import runpy

import pytest
import torch
import torch.nn.functional as F

import train_distill
import train_dpo
import train_grpo
import train_reward
import train_sft
from checkpoint import load_checkpoint, load_model, lora_model, model_from_checkpoint
from conftest import (REPO, TINY_CONTEXT, TINY_RUN, assert_resumes_exactly, bound, lora_sft, pretrain,
                      pretrain_ddp_matches_one_process, read_metrics, repeatable, run_script, tiny)
from engine import Engine, KVCache, Row
from errors import ConfigError
from lora import adapter_state, lora_layers
from model import ModelConfig, MoEFeedForward, Transformer, aux_loss, rope_tables
from test_engine import alone, ids, sharpen
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
def test_the_dispatch_equals_a_plain_loop_over_experts_forward_and_backward(n_experts, k, norm, device):
    layer = moe(n_experts, k, norm).to(device)
    x = torch.randn(3, 10, 32).to(device).requires_grad_()
    y = layer(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])
    y_ref = plain_loop(layer, x)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=bound(1e-6, device))
    for g, g_ref in zip(grads, grads_ref):  # index_add_ on a GPU adds in any order
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=bound(1e-6, device))


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
    assert aux_loss(model) == sum(block.feed_forward.aux_loss for block in model.layers) > 0
    dense = Transformer(ModelConfig(**config))
    dense(torch.randint(0, 64, (2, 16)))
    assert aux_loss(dense) == 0


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
        (loss + aux_loss(model)).backward()
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
    # mean is not one process's over the same global batch; every expert, used on a rank or not, is all-reduced
    pretrain_ddp_matches_one_process(demo_dir, tmp_path, *EXPERTS, "--router_aux_loss_coef=0")


@pytest.fixture(scope="module")
def tiny_moe(demo_dir, tmp_path_factory):
    """The tiny model with 4 experts, one per token, pretrained for 40 steps on the demo text."""
    out = tmp_path_factory.mktemp("moe")
    pretrain(demo_dir, out, *EXPERTS, "--batch_size=16", "--lr=1e-2", "--warmup_steps=5", "--max_steps=40",
             "--eval_interval=40", f"--max_seq_len={TINY_CONTEXT}")
    return out / "best.pt"


def test_every_stage_adds_the_aux_loss_and_logs_it(tiny_moe, demo_dir, tmp_path):
    short = [*TINY_RUN, "--batch_size=4", "--max_steps=2", "--warmup_steps=0", "--eval_interval=2"]
    pairs = ["--max_prompt_length=32", "--max_completion_length=32"]
    stages = {
        train_sft: [f"--data_path={demo_dir}/sft.jsonl", "--max_seq_len=64"],
        train_dpo: [f"--data_path={demo_dir}/dpo.jsonl", *pairs],
        train_reward: [f"--data_path={demo_dir}/dpo.jsonl", *pairs],
        train_distill: [f"--data_path={demo_dir}/sft.jsonl", "--data_kind=sft", f"--teacher={tiny_moe}"],
        train_grpo: [f"--data_path={demo_dir}/grpo.jsonl", "--group_size=2", "--max_new_tokens=4"],
    }
    for script, flags in stages.items():
        out = tmp_path / script.__name__
        script.main([f"--init_from={tiny_moe}", f"--out_dir={out}", *short, *flags])
        rows = [r for r in read_metrics(out) if "loss" in r]
        assert len(rows) == 2 and all(r["aux_loss"] >= 5e-4 * 0.99 for r in rows), (script.__name__, rows)


def test_an_moe_run_resumes_exactly(demo_dir, tmp_path, device):
    def run(out_dir, *flags):  # one expert per token: a GPU's index_add_ adds one value to each row, exactly
        pretrain(demo_dir, out_dir, *repeatable(device, *EXPERTS, "--max_steps=6", "--save_interval=3", "--dropout=0.1",
                                                *flags))

    assert_resumes_exactly(run, tmp_path / "full", tmp_path / "resumed", saved=3, last=6)


def test_lora_adapts_every_expert_and_leaves_the_router_frozen(tiny_moe, demo_dir, tmp_path):
    lora_sft(tiny_moe, demo_dir, tmp_path, "--max_steps=4", "--eval_interval=4")
    ckpt = load_checkpoint(str(tmp_path / "best.pt"))
    model = lora_model(ckpt, str(tmp_path / "best.pt"))
    adapted = {name.rsplit(".", 1)[0] for name in adapter_state(model)}
    experts = {f"layers.{i}.feed_forward.experts.{e}.{w}" for i in range(2) for e in range(4) for w in ("w1", "w2", "w3")}
    assert experts <= adapted and not any(".gate" in name for name in adapted)  # the router is not adapted
    assert len(lora_layers(model)) == 2 * (4 + 4 * 3)
    merged, _ = model_from_checkpoint(str(tmp_path / "best.pt"))
    base, _ = model_from_checkpoint(str(tiny_moe))
    X = torch.randint(0, 6400, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged.eval()(X, X)[0], model.eval()(X, X)[0], rtol=0, atol=1e-5)
    for i in range(2):  # frozen: the merged router is the base's
        assert torch.equal(merged.layers[i].feed_forward.gate.weight, base.layers[i].feed_forward.gate.weight)


def test_an_moe_model_with_yarn_decodes_with_the_kv_cache_as_in_a_full_forward_and_batched_as_alone(device):
    # positions past rope_original_max_len (8): the scaled tables are the ones the cache's rows are rotated by
    model = sharpen(tiny(n_experts=4, experts_per_token=2, rope_scaling="yarn", rope_factor=4.0,
                         rope_original_max_len=8)).to(device).eval()
    idx = ids(model, B=2, T=24).to(device)
    full = model.output(model.hidden_states(idx))
    caches = [KVCache(2, 24) for _ in model.layers]
    steps = [model(idx[:, :5], caches=caches)[0]]
    for t in range(5, 24):
        steps.append(model(idx[:, t : t + 1], caches=caches, start_pos=t)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=0, atol=bound(1e-5, device))
    # rows of a batch are routed token by token: each gets what it gets alone
    prompts = [ids(model, B=1, T=n, seed=n)[0].tolist() for n in (3, 9, 5)]
    engine, rows = Engine(model, max_batch=3), [Row(p, 12) for p in prompts]
    for row in rows:
        engine.add([row])  # prefilled alone, then decoded together
    while engine.rows:
        engine.step()
    for row, prompt in zip(rows, prompts):
        assert row.tokens == alone(model, prompt, 12)


def test_yarn_runs_a_checkpoint_past_the_context_it_was_trained_at(tiny_pretrained, demo_dir):
    model, tokenizer, _ = load_model(str(tiny_pretrained), yarn=4)
    c = model.config
    assert (c.rope_scaling, c.rope_factor, c.rope_original_max_len, c.max_seq_len) == ("yarn", 4, TINY_CONTEXT,
                                                                                     4 * TINY_CONTEXT)
    plain, _, _ = load_model(str(tiny_pretrained))
    assert not torch.allclose(model.rope_cos[:TINY_CONTEXT], plain.rope_cos)  # the trained positions are rescaled too
    with pytest.raises(ConfigError, match="must be above 1"):
        load_model(str(tiny_pretrained), yarn=1)
    # three times the trained context: too long for the model as trained, read whole with --yarn
    text = open(f"{demo_dir}/pretrain.jsonl", encoding="utf-8").read(6000)
    ids = tokenizer.encode(text)[: 3 * TINY_CONTEXT]
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        plain(torch.tensor([ids]))
    model(torch.tensor([ids]))
    prompt = tokenizer.decode(ids)
    done = run_script("sample.py", f"--ckpt={tiny_pretrained}", "--yarn=4", f"--prompt={prompt}",
                      "--max_new_tokens=8", "--temperature=0", "--device=cpu")
    assert done.returncode == 0, done.stderr[-2000:]
