"""convert.py export to .gguf of a mixture of experts (llama.cpp's qwen3moe, or llama with experts without qk_norm)
and of YaRN rope scaling: the gguf package reads back the keys and every tensor (the experts stacked), llama.cpp
(through llama-cpp-python, unpatched) computes nanomind's logits and greedy tokens, past the original context under
YaRN; a model llama.cpp would compute differently is refused, naming the key, before anything is written."""
import math

import gguf
import pytest
import torch

import convert
from checkpoint import model_from_checkpoint
from errors import ConfigError
from gguf_export import gguf_name, halves_to_pairs, stack_experts
from model import MoEFeedForward, yarn
from test_export import MINIMIND_TOKENIZER, MIXED, TINY, nanomind_logits, random_checkpoint
from test_gguf import assert_same_greedy_tokens, export_random, llama
from tokenizer import load_tokenizer

MOE = TINY["untied_mha_qk_norm"] | dict(vocab_size=6400, n_experts=4, moe_ffn_dim=48)
# theta 100 and an original context of 16: the ramp keeps pair 0, halves pair 1 and interpolates the rest
YARN = dict(rope_scaling="yarn", rope_theta=100.0, rope_factor=4.0, rope_original_max_len=16)
SHAPES = {
    "moe_top1": MOE | dict(experts_per_token=1),
    "moe_top2_tied_gqa": MOE | dict(experts_per_token=2, n_kv_heads=2, head_dim=None, tie_embeddings=True),
    "moe_llama_top2": MOE | dict(experts_per_token=2, qk_norm=False),  # Mixtral's layout
    # every expert chosen: the weights sum to 1 without renormalising, so llama.cpp's renormalising changes nothing
    "moe_all_unnormalised": MOE | dict(experts_per_token=4, norm_topk_prob=False),
    "yarn_llama": TINY["tied_gqa"] | dict(vocab_size=6400) | YARN,
    "yarn_moe_attention_factor": MOE | dict(experts_per_token=2) | YARN | dict(rope_attention_factor=1.3),
}
N_IDS = 40  # past rope_original_max_len


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request, tmp_path_factory):
    return export_random(SHAPES[request.param], tmp_path_factory.mktemp("gguf_moe"))


def test_the_gguf_package_reads_back_the_experts_and_yarn_keys_and_every_tensor(exported):
    model, _, path, _ = exported
    cfg = model.config
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields["general.architecture"]
    assert arch == ("qwen3moe" if cfg.n_experts and cfg.qk_norm else "llama")
    if cfg.n_experts:  # llama sizes its experts by feed_forward_length, qwen3moe by expert_feed_forward_length
        assert (fields[f"{arch}.expert_count"], fields[f"{arch}.expert_used_count"],
                fields[f"{arch}.feed_forward_length"], fields[f"{arch}.expert_feed_forward_length"]) == (
            cfg.n_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.moe_ffn_dim)
    if cfg.rope_scaling:
        assert (fields[f"{arch}.rope.scaling.type"], fields[f"{arch}.rope.scaling.factor"],
                fields[f"{arch}.rope.scaling.original_context_length"]) == ("yarn", cfg.rope_factor,
                                                                            cfg.rope_original_max_len)
        mscale = 0.1 * math.log(cfg.rope_factor) + 1  # llama.cpp multiplies cos and sin by attn_factor x mscale
        assert fields[f"{arch}.rope.scaling.attn_factor"] * mscale == pytest.approx(
            cfg.rope_attention_factor or mscale, rel=1e-6)
    else:
        assert not any(".rope.scaling." in key for key in fields)
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape(list(reversed(t.shape.tolist())))
               for t in reader.tensors}
    state = stack_experts(model.state_dict(), cfg.n_experts)
    if cfg.tie_embeddings:
        del state["output.weight"]
    assert sorted(tensors) == sorted(gguf_name(name) for name in state)
    for name, weight in state.items():  # bit for bit: experts (n_experts, out, in), llama's q and k rows in pairs
        if not cfg.qk_norm and name.endswith((".wq.weight", ".wk.weight")):
            weight = halves_to_pairs(weight, cfg.n_heads if ".wq." in name else cfg.n_kv_heads)
        assert torch.equal(tensors[gguf_name(name)], weight), name
    if cfg.n_experts:
        assert tensors["blk.1.ffn_down_exps.weight"].shape == (cfg.n_experts, cfg.dim, cfg.moe_ffn_dim)


def test_llama_cpp_computes_nanomind_s_logits_and_greedy_tokens(exported):
    model, tok, _, llm = exported
    cfg = model.config
    ids = [tok.bos_id, *tok.encode(MIXED)][:N_IDS]
    llm.reset()
    llm.eval(ids)
    theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    ours = nanomind_logits(model, torch.tensor([ids]))[0]  # every position's
    assert (theirs - ours).abs().max() <= 2e-3
    if cfg.n_experts:  # every expert ran on some token: a misplaced expert would show in the logits
        assert all((m.load > 0).all() for m in model.modules() if isinstance(m, MoEFeedForward))
    if cfg.rope_scaling:  # the positions ran past the original context, and the ramp has all three kinds of pair
        assert len(ids) > cfg.rope_original_max_len
        wavelengths = cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        kept = yarn(wavelengths, cfg)[0] * wavelengths  # 1 kept, 1 / factor interpolated, between on the ramp
        assert kept.max() == pytest.approx(1) and kept.min() == pytest.approx(1 / cfg.rope_factor)
        assert ((kept > 1 / cfg.rope_factor + 1e-3) & (kept < 1 - 1e-3)).any()
    assert_same_greedy_tokens(model, llm, ids[:8])


@pytest.mark.parametrize("model_config, key", [
    (MOE | dict(experts_per_token=2, norm_topk_prob=False), "norm_topk_prob"),
    (MOE | dict(qk_norm=False, norm_topk_prob=False), "norm_topk_prob"),  # top-1: weighted by its probability
    (TINY["tied_gqa"] | dict(vocab_size=6400) | YARN | dict(rope_beta_fast=16.0), "rope_beta_fast, rope_beta_slow"),
    (MOE | YARN | dict(rope_beta_slow=2.0), "rope_beta_fast, rope_beta_slow"),
])
def test_what_llama_cpp_would_compute_differently_is_refused_naming_the_key_and_nothing_written(model_config, key,
                                                                                                tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", model_config, MINIMIND_TOKENIZER)
    with pytest.raises(ConfigError, match=f"^{key}: llama.cpp's ") as error:
        convert.main(["export", str(ckpt), str(tmp_path / "model.gguf")])
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_half_precision_moe_gguf_computes_the_rounded_model_s_logits_with_a_float32_router(tmp_path):
    """Experts in float16, router and norms in float32: llama.cpp's logits are those of nanomind's model with every
    other matrix rounded to float16. ggml's expert matmul (mul_mat_id) rounds its input to float16 too (1.8e-3 here,
    5e-4 with nanomind's expert inputs so rounded), which its dense matmul does not: a wider bound than
    test_gguf.py's."""
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", SHAPES["moe_top2_tied_gqa"], MINIMIND_TOKENIZER)
    convert.main(["export", str(ckpt), str(tmp_path / "model.gguf"), "--dtype=float16"])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert (types["blk.0.ffn_up_exps.weight"], types["blk.0.ffn_gate_inp.weight"]) == ("F16", "F32")
    model, _ = model_from_checkpoint(str(ckpt))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith(".feed_forward.gate.weight"):
                p.copy_(p.half().float())
    tok = load_tokenizer(MINIMIND_TOKENIZER)
    ids = [tok.bos_id, *tok.encode(MIXED)][:N_IDS]
    llm = llama(tmp_path / "model.gguf")
    llm.eval(ids)
    theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    assert (theirs - nanomind_logits(model.eval(), torch.tensor([ids]))[0]).abs().max() <= 5e-3
