"""convert.py import: MiniMind2- (LLaMA) and minimind-3-shaped (Qwen3) transformers models, as *.pth state dicts and as
folders, give nanomind the same logits and greedy continuation; the imported checkpoint samples and fine-tunes."""
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import convert
import sample
import train_sft
from chat import encode_chat
from checkpoint import load_checkpoint, model_from_checkpoint
from config import load_config
from conftest import TINY_RUN, greedy_alone
from errors import CheckpointError, ConfigError
from model import ModelConfig, Transformer
from tokenizer import DEFAULT_DIR, load_tokenizer

MINIMIND_TOKENIZER = DEFAULT_DIR  # MiniMind's, the default
# MiniMind's vocabulary; small widths; head_dim 24 is not dim / n_heads (64 / 4) for the Qwen3 shape
SHAPE = dict(vocab_size=6400, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)


def reference_model(kind: str):
    """minimind2: LlamaForCausalLM as MiniMind's convert_model.py maps MiniMind2 (rms_norm_eps 1e-5);
    minimind3: Qwen3ForCausalLM as it maps minimind-3 (qk_norm, rms_norm_eps 1e-6)."""
    torch.manual_seed(0)
    if kind == "minimind2":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, rms_norm_eps=1e-5))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=24, rms_norm_eps=1e-6))
    with torch.no_grad():  # random weights large enough that every part changes the logits, norm gains too
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def save_source(model, kind: str, form: str, directory: Path) -> tuple[Path, list[str]]:
    """The model on disk as MiniMind ships it: a *.pth state dict (MiniMind's key names: transformers' own), or a
    transformers folder. Returns the source and the flags its import needs."""
    if form == "pth":
        path = directory / "full_sft_64.pth"
        torch.save(model.state_dict(), path)  # as MiniMind's trainer: lm_head.weight and embed_tokens both present
        return path, (["--n_heads=4"] if kind == "minimind2" else [])  # minimind-3's q_norm tells head_dim
    folder = directory / form
    if form == "safetensors":
        model.save_pretrained(folder)
    else:  # MiniMind's own format: MiniMindForCausalLM's config.json, pytorch_model.bin
        folder.mkdir()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        config = {"architectures": ["MiniMindForCausalLM"], "model_type": "minimind", "hidden_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 192, "vocab_size": 6400, "max_position_embeddings": 64,
                  "rms_norm_eps": model.config.rms_norm_eps, "rope_theta": 1e6, "tie_word_embeddings": True,
                  "hidden_act": "silu", "use_moe": False, "flash_attn": True, "dropout": 0.0}
        if kind == "minimind3":
            config["head_dim"] = 24
        (folder / "config.json").write_text(json.dumps(config))
    return folder, []


@pytest.fixture(scope="module", params=["minimind2", "minimind3"])
def reference(request):
    return request.param, reference_model(request.param)


@pytest.mark.parametrize("form", ["pth", "safetensors", "minimind_bin"])
def test_imported_model_gives_the_reference_logits_and_continuation(reference, form, tmp_path):
    kind, ref = reference
    src, flags = save_source(ref, kind, form, tmp_path)
    convert.main(["import", str(src), str(tmp_path / "imported.pt"), *flags, f"--tokenizer={MINIMIND_TOKENIZER}"])
    ours, state = model_from_checkpoint(str(tmp_path / "imported.pt"))
    ours.eval()
    assert state["model_config"]["qk_norm"] == (kind == "minimind3")
    assert state["model_config"]["norm_eps"] == ref.config.rms_norm_eps
    x = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x).logits
        logits, _ = ours(x, x)
    assert (logits - expected).abs().max().item() <= 1e-4
    prompt = x[:1, :8]
    with torch.no_grad():
        theirs = ref.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                              min_new_tokens=16)
    assert prompt[0].tolist() + greedy_alone(ours, prompt[0].tolist(), 16) == theirs[0].tolist()


def test_a_pth_without_qk_norm_asks_for_n_heads(tmp_path):
    src, _ = save_source(reference_model("minimind2"), "minimind2", "pth", tmp_path)
    with pytest.raises(ConfigError, match="--n_heads"):
        convert.main(["import", str(src), str(tmp_path / "imported.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    assert not (tmp_path / "imported.pt").exists()


@pytest.mark.parametrize("form", ["pth", "safetensors"])
def test_weights_without_a_tokenizer_are_refused_not_given_the_default(form, tmp_path):
    """Any tokenizer of MiniMind's vocabulary size would load with MiniMind's weights, and the wrong one would chat
    in the wrong tokens: weights carry none, so a .pth, or a folder without tokenizer.json, needs --tokenizer."""
    src, flags = save_source(reference_model("minimind3"), "minimind3", form, tmp_path)
    with pytest.raises(ConfigError, match="holds no tokenizer.json: pass --tokenizer=DIR"):
        convert.main(["import", str(src), str(tmp_path / "imported.pt"), *flags])
    assert not (tmp_path / "imported.pt").exists()


def test_every_weight_without_a_place_is_named(tmp_path):
    state = reference_model("minimind3").state_dict()
    state["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(1)  # MoE
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(1)
    torch.save(state, tmp_path / "moe.pth")
    with pytest.raises(CheckpointError) as e:
        convert.main(["import", str(tmp_path / "moe.pth"), str(tmp_path / "imported.pt"),
                      f"--tokenizer={MINIMIND_TOKENIZER}"])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in str(e.value)
    assert "model.layers.0.self_attn.q_proj.bias" in str(e.value)


def test_unsupported_config_and_existing_output_are_refused(tmp_path):
    ref = reference_model("minimind2")
    folder, _ = save_source(ref, "minimind2", "safetensors", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu", "attention_bias": True}))
    with pytest.raises(ConfigError, match="hidden_act='gelu', attention_bias=True"):
        convert.main(["import", str(folder), str(tmp_path / "out.pt"), f"--tokenizer={MINIMIND_TOKENIZER}"])
    (tmp_path / "out.pt").write_bytes(b"keep me")
    with pytest.raises(ConfigError, match="--force"):
        convert.main(["import", str(folder), str(tmp_path / "out.pt")])
    assert (tmp_path / "out.pt").read_bytes() == b"keep me"


def test_safetensors_round_trip_every_dtype(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).half(), "c": torch.randn(2, 2).bfloat16(),
               "d": torch.arange(6).reshape(2, 3), "e": torch.zeros(0, 4)}
    convert.write_safetensors(tensors, tmp_path / "x.safetensors")
    from safetensors.torch import load_file  # the reference reader (comes with transformers)
    for got in (convert.read_safetensors(tmp_path / "x.safetensors"), load_file(tmp_path / "x.safetensors")):
        assert got.keys() == tensors.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in tensors.items())
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        convert.read_safetensors(tmp_path / "bad.safetensors")


def test_imported_minimind_checkpoint_samples_and_fine_tunes(demo_dir, tmp_path, capsys):
    """With MiniMind's tokenizer recorded: sample.py chats (stage sft) and train_sft.py --init_from trains on."""
    src, flags = save_source(reference_model("minimind3"), "minimind3", "pth", tmp_path)
    convert.main(["import", str(src), str(tmp_path / "imported.pt"), f"--tokenizer={MINIMIND_TOKENIZER}",
                  "--max_seq_len=128"])
    state = load_checkpoint(str(tmp_path / "imported.pt"))
    assert state["stage"] == "sft" and state["config"]["tokenizer_path"] == str(MINIMIND_TOKENIZER)
    assert state["tokenizer"]["chat_template"] == "chatml" and state["model_config"]["max_seq_len"] == 128
    capsys.readouterr()
    sample.main([f"--ckpt={tmp_path / 'imported.pt'}", "--prompt=你好", "--temperature=0", "--max_new_tokens=12"])
    # what sample.py answered is the greedy continuation of MiniMind's ChatML prompt, in MiniMind's tokenizer
    tokenizer = load_tokenizer(MINIMIND_TOKENIZER)
    prompt, _ = encode_chat(tokenizer, [{"role": "user", "content": "你好"}])
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model, _ = model_from_checkpoint(str(tmp_path / "imported.pt"))
    answer = greedy_alone(model.eval(), prompt, 12, tokenizer.eos_id)
    answer = answer[: answer.index(tokenizer.eos_id)] if tokenizer.eos_id in answer else answer
    assert answer and capsys.readouterr().out == tokenizer.decode(answer).strip(" ") + "\n"
    # the tokenizer comes from the checkpoint: no --tokenizer_path, in sampling or fine-tuning
    train_sft.main([f"--init_from={tmp_path / 'imported.pt'}", f"--data_path={demo_dir}/sft.jsonl",
                    f"--out_dir={tmp_path / 'sft'}", *TINY_RUN,
                    "--batch_size=4", "--max_steps=2", "--eval_interval=2", "--max_seq_len=64"])
    tuned = load_checkpoint(str(tmp_path / "sft" / "step_0000002.pt"))
    assert tuned["model_config"]["qk_norm"] and tuned["model_config"]["head_dim"] == 24
    assert tuned["tokenizer"]["chat_template"] == "chatml"


def test_64m_has_exactly_minimind3_parameter_count():
    (cfg,) = load_config(["configs/64m.py"], ModelConfig)
    with torch.device("meta"):
        n = Transformer(cfg).num_params()
    # by hand: dim 768, 8 layers, 8 query heads and 4 key/value heads of 96, ffn 2432, qk_norm, vocab 6400
    dim, n_layers, head_dim, n_heads, n_kv_heads, ffn_dim, vocab = 768, 8, 96, 8, 4, 2432, 6400
    attention = 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim  # wq, wo; wk, wv
    qk_norm = 2 * head_dim  # one gain vector each for q and k, shared by the heads
    feed_forward = 3 * dim * ffn_dim
    norms = 2 * dim
    expected = vocab * dim + n_layers * (attention + qk_norm + feed_forward + norms) + dim
    assert expected == n == 63_912_192
