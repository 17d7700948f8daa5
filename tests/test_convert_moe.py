"""convert.py and mixtures of experts and YaRN: an exported MoE checkpoint is Qwen3MoeForCausalLM (MixtralForCausalLM
without q/k norms) in transformers and computes nanomind's logits and greedy tokens; transformers' Qwen3-MoE and Mixtral
folders (per-expert and fused layouts), MiniMind's MoE state dicts and folders import to the same; YaRN goes both ways
and matches transformers past the original context; what no class computes is refused, naming the key."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

import convert
from checkpoint import load_checkpoint, model_from_checkpoint
from conftest import greedy_alone
from errors import ConfigError
from test_export import MINIMIND_TOKENIZER, TINY, greedy, nanomind_logits, random_checkpoint

MOE = TINY["untied_mha_qk_norm"] | dict(n_experts=4, moe_ffn_dim=48)
# an original context of 32 run at 128; theta 100 turns the low frequencies often enough that the ramp is not empty
YARN = dict(rope_scaling="yarn", rope_theta=100.0, rope_factor=4.0, rope_original_max_len=32, max_seq_len=128)
SHAPES = {  # the class transformers loads the export as, the model
    "qwen3_moe_top1": ("Qwen3MoeForCausalLM", MOE | dict(experts_per_token=1)),
    "qwen3_moe_top2_unnormalised_tied_gqa": ("Qwen3MoeForCausalLM", MOE | dict(
        experts_per_token=2, norm_topk_prob=False, n_kv_heads=2, tie_embeddings=True)),
    "qwen3_moe_top2_yarn": ("Qwen3MoeForCausalLM", MOE | dict(experts_per_token=2) | YARN |
                            dict(rope_attention_factor=1.2)),
    "mixtral_top2": ("MixtralForCausalLM", TINY["tied_gqa"] | dict(n_experts=4, experts_per_token=2, moe_ffn_dim=48)),
    "qwen3_yarn": ("Qwen3ForCausalLM", TINY["untied_mha_qk_norm"] | YARN),
    "llama_yarn": ("LlamaForCausalLM", TINY["tied_gqa"] | YARN | dict(rope_attention_factor=1.0)),
}
HF_SHAPE = dict(vocab_size=6400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=False)
HF_MOE = dict(moe_intermediate_size=48, num_experts=4)
HF_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 32,
           "beta_fast": 32.0, "beta_slow": 1.0}


def randomise(model):
    """Weights large enough that every part changes the logits, norm gains and routers too."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def ids(vocab_size: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def assert_same_model(ours, theirs, length: int):
    """The same logits over length positions (past a YaRN model's original context) and 20 greedy tokens after a
    prompt of length - 24."""
    x = ids(ours.config.vocab_size, length)
    with torch.no_grad():
        assert (theirs(x).logits - nanomind_logits(ours, x)).abs().max().item() <= 1e-4
    prompt = x[:1, : length - 24]
    assert prompt[0].tolist() + greedy_alone(ours, prompt[0].tolist(), 20) == greedy(theirs, prompt, 20)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_computes_nanomind_s_logits_in_transformers_and_imports_back(shape, tmp_path):
    arch, model_config = SHAPES[shape]
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", model_config)
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    ours, state = model_from_checkpoint(str(ckpt))
    cfg = ours.eval().config
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == arch
    if cfg.n_experts:  # transformers routes as nanomind does: its config says so
        assert (theirs.config.num_local_experts, theirs.config.num_experts_per_tok) == (4, cfg.experts_per_token)
    if arch == "Qwen3MoeForCausalLM":
        assert (theirs.config.moe_intermediate_size, theirs.config.norm_topk_prob) == (48, cfg.norm_topk_prob)
        assert (theirs.config.decoder_sparse_step, theirs.config.mlp_only_layers) == (1, [])
    if cfg.rope_scaling:
        assert theirs.config.rope_parameters["rope_type"] == "yarn"
        assert theirs.model.rotary_emb.attention_scaling == (cfg.rope_attention_factor or 0.1 * math.log(4) + 1)
    assert_same_model(ours, theirs, cfg.max_seq_len)
    # and back: the same weights, bit for bit, and the same architecture
    convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "back.pt")])
    back = load_checkpoint(str(tmp_path / "back.pt"))
    # not part of the folder: how nanomind computes; and a Mixtral's dense width, which no layer of it has
    ignored = ("flash", "grad_checkpoint") + (("ffn_dim",) if arch == "MixtralForCausalLM" else ())
    assert {k: v for k, v in back["model_config"].items() if k not in ignored} == \
        {k: v for k, v in state["model_config"].items() if k not in ignored}
    assert back["model"].keys() == state["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_yarn_is_what_made_the_logits_agree(tmp_path):
    """Past the original context the exported YaRN model is not its plain-RoPE twin: the comparison above sees
    the scaling."""
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", SHAPES["qwen3_moe_top2_yarn"][1])
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    plain, _ = model_from_checkpoint(str(ckpt), rope_scaling=None)
    x = ids(6400, 128)
    with torch.no_grad():
        assert (theirs(x).logits - nanomind_logits(plain.eval(), x)).abs().max().item() > 0.1


def test_an_moe_without_qk_norm_or_renormalising_is_refused(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", SHAPES["mixtral_top2"][1] | dict(norm_topk_prob=False))
    with pytest.raises(ConfigError, match=r"n_experts=4 with qk_norm=False and norm_topk_prob=False"):
        convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def qwen3_moe(k: int, norm: bool, **overrides) -> Qwen3MoeForCausalLM:
    config = HF_SHAPE | HF_MOE | dict(num_experts_per_tok=k, norm_topk_prob=norm, max_position_embeddings=64)
    return randomise(Qwen3MoeForCausalLM(Qwen3MoeConfig(**config | overrides)))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch, k, norm", [("qwen3_moe", 1, True), ("qwen3_moe", 2, False), ("mixtral", 2, True)])
def test_a_transformers_moe_folder_imports_to_its_logits(layout, arch, k, norm, tmp_path):
    if arch == "qwen3_moe":
        ref, expert_key = qwen3_moe(k, norm), "model.layers.1.mlp.experts.3.up_proj.weight"
    else:  # Mixtral: no q/k norms, its experts' width is intermediate_size
        ref = randomise(MixtralForCausalLM(MixtralConfig(**HF_SHAPE | dict(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=k, max_position_embeddings=64))))
        expert_key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    # save_pretrained writes one tensor per expert; without the original format, transformers 5's 3-D ones
    ref.save_pretrained(tmp_path / "hf", save_original_format=layout == "per_expert")
    on_disk = convert.read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert ("model.layers.1.mlp.experts.gate_up_proj" in on_disk) == (layout == "fused")
    assert (expert_key in on_disk) == (layout == "per_expert")
    convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    ours, state = model_from_checkpoint(str(tmp_path / "imported.pt"))
    c = state["model_config"]
    assert (c["n_experts"], c["experts_per_token"], c["moe_ffn_dim"], c["norm_topk_prob"], c["qk_norm"]) == \
        (4, k, 48, norm, arch == "qwen3_moe")
    assert_same_model(ours.eval(), ref, 64)


def minimind_moe(x, gate: torch.Tensor, experts: list[tuple], k: int):
    """MiniMind's MOEFeedForward.forward (norm_topk_prob): softmax over the experts, the top k renormalised, each
    expert a SwiGLU (gate, up, down) over the tokens that chose it."""
    flat = x.reshape(-1, x.size(-1))
    scores = F.softmax(flat @ gate.T, dim=-1)
    weight, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
    weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    y = torch.zeros_like(flat)
    for i, (w_gate, w_up, w_down) in enumerate(experts):
        tokens = (idx == i).any(dim=-1).nonzero().flatten()
        h = F.silu(flat[tokens] @ w_gate.T) * (flat[tokens] @ w_up.T)
        y.index_add_(0, tokens, (h @ w_down.T) * weight[idx == i].view(-1, 1))
    return y.view_as(x)


@pytest.mark.parametrize("k", [1, 2])
def test_a_minimind_moe_state_dict_imports_to_minimind_s_formula(k, tmp_path):
    """A minimind-3-moe-shaped *.pth (MiniMind's keys: mlp.gate, mlp.experts.{e}.{gate,up,down}_proj): n_experts and
    the experts' width come from the tensors, routing from MiniMind's defaults (top 1, renormalised); the logits are
    those of transformers' attention with MiniMind's MoE formula in every layer."""
    ref = qwen3_moe(k, True, tie_word_embeddings=True, rope_theta=1e6)
    state = {}
    for name, t in ref.state_dict().items():  # transformers holds the experts fused; MiniMind one module each
        if name.endswith("experts.gate_up_proj"):
            for e in range(4):
                state[name.replace("gate_up_proj", f"{e}.gate_proj.weight")], \
                    state[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e].chunk(2)
        elif name.endswith("experts.down_proj"):
            state |= {name.replace("down_proj", f"{e}.down_proj.weight"): t[e] for e in range(4)}
        else:
            state[name] = t
    assert "model.layers.0.mlp.gate.weight" in state and "lm_head.weight" in state
    torch.save(state, tmp_path / "moe.pth")
    flags = [] if k == 1 else [f"--experts_per_token={k}"]
    convert.main(["import", str(tmp_path / "moe.pth"), str(tmp_path / "imported.pt"), *flags,
                  f"--tokenizer={MINIMIND_TOKENIZER}"])
    ours, saved = model_from_checkpoint(str(tmp_path / "imported.pt"))
    c = saved["model_config"]
    assert (c["n_experts"], c["experts_per_token"], c["moe_ffn_dim"], c["norm_topk_prob"], c["router_aux_loss_coef"],
            c["qk_norm"], c["head_dim"], c["tie_embeddings"]) == (4, k, 48, True, 5e-4, True, 24, True)
    assert saved["model"]["layers.1.feed_forward.experts.3.w2.weight"].shape == (64, 48)
    assert saved["model"]["layers.1.feed_forward.gate.weight"].shape == (4, 64)
    for i, layer in enumerate(ref.model.layers):
        experts = [tuple(state[f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
                   for e in range(4)]
        layer.mlp.forward = lambda x, gate=state[f"model.layers.{i}.mlp.gate.weight"], experts=experts: \
            minimind_moe(x, gate, experts, k)
    x = ids(6400, 40)
    with torch.no_grad():
        assert (ref(x).logits - nanomind_logits(ours.eval(), x)).abs().max().item() <= 1e-4


def test_a_minimind_moe_folder_with_yarn_imports_to_its_logits(tmp_path):
    """MiniMindForCausalLM's config.json, use_moe and inference_rope_scaling on: its rope_scaling dict ("type":
    "yarn", attention_factor 1.0), as transformers' Qwen3-MoE computes it, past the original context."""
    ref = qwen3_moe(1, True, max_position_embeddings=128, rope_parameters=HF_YARN | {"attention_factor": 1.0})
    ref.save_pretrained(tmp_path / "mm")
    config = {"architectures": ["MiniMindForCausalLM"], "model_type": "minimind", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
              "intermediate_size": 96, "vocab_size": 6400, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
              "rope_theta": 100.0, "tie_word_embeddings": False, "hidden_act": "silu", "flash_attn": True,
              "dropout": 0.0, "use_moe": True, "num_experts": 4, "num_experts_per_tok": 1,
              "moe_intermediate_size": 48, "norm_topk_prob": True, "router_aux_loss_coef": 5e-4,
              "inference_rope_scaling": True,
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "original_max_position_embeddings": 32,
                               "attention_factor": 1.0, "type": "yarn"}}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))
    convert.main(["import", str(tmp_path / "mm"), str(tmp_path / "imported.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    ours, state = model_from_checkpoint(str(tmp_path / "imported.pt"))
    c = state["model_config"]
    assert (c["n_experts"], c["experts_per_token"], c["rope_scaling"], c["rope_factor"], c["rope_original_max_len"],
            c["rope_attention_factor"]) == (4, 1, "yarn", 4.0, 32, 1.0)
    assert_same_model(ours.eval(), ref, 128)


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling_type"])
def test_a_transformers_yarn_folder_imports_to_its_logits_past_the_original_context(form, tmp_path):
    """As save_pretrained writes it (transformers 5: rope_parameters, rope_type), and as transformers 4 and
    MiniMind wrote it (rope_scaling, type); the reference is transformers reading that same config.json."""
    randomise(Qwen3ForCausalLM(Qwen3Config(**HF_SHAPE, max_position_embeddings=128, rope_parameters=HF_YARN))) \
        .save_pretrained(tmp_path / "hf")
    if form == "rope_scaling_type":
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"], rope["type"] = rope.pop("rope_theta"), rope.pop("rope_type")
        config["rope_scaling"] = rope
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert ref.config.rope_parameters["rope_type"] == "yarn" and ref.model.rotary_emb.attention_scaling > 1
    convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    ours, state = model_from_checkpoint(str(tmp_path / "imported.pt"))
    c = state["model_config"]
    assert (c["rope_scaling"], c["rope_factor"], c["rope_original_max_len"], c["rope_attention_factor"]) == \
        ("yarn", 4.0, 32, None)
    assert_same_model(ours.eval(), ref, 128)


@pytest.mark.parametrize("key, value, message", [
    ("decoder_sparse_step", 2, r"decoder_sparse_step=2 \(dense layers among the MoE ones\)"),
    ("mlp_only_layers", [0], r"mlp_only_layers=\[0\] \(dense layers among the MoE ones\)"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "rope scaling .*linear"),
])
def test_what_nanomind_cannot_compute_is_refused_naming_the_key(key, value, message, tmp_path):
    qwen3_moe(1, True).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(ConfigError, match=f"config.json: nanomind's model has no {message}"):
        convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "out.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    assert not (tmp_path / "out.pt").exists()
