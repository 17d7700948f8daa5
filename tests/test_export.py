"""convert.py export: transformers loads the folder with its own classes (no remote code) and computes what nanomind
computes: the same logits and greedy tokens, the same token ids and chat-template ids; export -> import is lossless."""
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import convert
import sample
from chat import encode_chat
from checkpoint import atomic_save, load_checkpoint, model_from_checkpoint
from config import PretrainConfig, load_config
from conftest import bound, corpus_lines, greedy_alone, random_strings
from errors import CheckpointError, ConfigError, cli
from model import ModelConfig, Transformer
from tokenizer import DEFAULT_DIR, NANOMIND_DIR, load_tokenizer
from train_tokenizer import main as train_tokenizer

MINIMIND_TOKENIZER = DEFAULT_DIR  # MiniMind's, the default
MIXED = ("人工智能是计算机科学的一个分支。The quick brown fox isn't lazy; 3.14 ≈ π, ２０２４年!\n"
         "def f(x):\n\treturn x ** 2  # 平方\r\n\n  emoji 😀👍🏽 ❤️‍🔥 🇨🇳 👨‍👩‍👧‍👦 ✨   end ")
CONVERSATIONS = [
    [{"role": "system", "content": "你是一个乐于助人的助手。"}, {"role": "user", "content": "What is 2+3?"},
     {"role": "assistant", "content": "5"}, {"role": "user", "content": "再加 4 呢？"},
     {"role": "assistant", "content": "9 😀"}, {"role": "user", "content": "def f(x): return x"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [{"role": "user", "content": "只有一个问题"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Kenya?"}],
]
TINY = {  # tied GQA; untied MHA with qk_norm and a head_dim that is not dim / n_heads
    "tied_gqa": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
    "untied_mha_qk_norm": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=24, qk_norm=True,
                               tie_embeddings=False, norm_eps=1e-6, rope_theta=5e5, max_seq_len=64),
}


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Path:
    """A tiktoken tokenizer of 700 ids trained here on mixed Chinese / English / code lines."""
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text("\n\n".join(corpus_lines(random.Random(0), 3000)), encoding="utf-8")
    train_tokenizer([str(d / "corpus.txt"), "--vocab_size=700", f"--out={d / 'tok'}"])
    return d / "tok"


def random_checkpoint(path: Path, model_config: dict, tokenizer_path=None, seed: int = 0) -> Path:
    """A nanomind checkpoint (the keys train_*.py write that export reads) holding random weights, norm gains too."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**model_config))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 1.0 if p.dim() == 1 else torch.randn_like(p) * 0.1)
    path_ = None if tokenizer_path is None else str(tokenizer_path)
    tok = load_tokenizer(path_)
    atomic_save({"model": model.state_dict(), "model_config": vars(model.config), "stage": "sft", "step": 0,
                 "config": {"tokenizer_path": path_, "batch_size": 1, "accum_steps": 1},
                 "tokenizer": {"path": path_, "fingerprint": tok.fingerprint, "chat_template": tok.chat_template}},
                str(path))
    return path


def nanomind_logits(model, x):
    with torch.no_grad():
        return model(x, x)[0]


def greedy(hf_model, prompt: torch.Tensor, n: int) -> list[int]:
    out = hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return out[0].tolist()


def demo_config() -> dict:
    (cfg,) = load_config(["configs/demo.py"], ModelConfig, ignored=(PretrainConfig,))
    return vars(cfg)


@pytest.mark.parametrize("shape", [*TINY, "demo"])
def test_transformers_computes_what_nanomind_computes_and_import_reads_it_back(shape, tmp_path, device):
    model_config = demo_config() if shape == "demo" else TINY[shape]
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", model_config)
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    ours, state = model_from_checkpoint(str(ckpt), device)
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").to(device).eval()  # both on the device
    assert type(theirs).__name__ == ("Qwen3ForCausalLM" if ours.config.qk_norm else "LlamaForCausalLM")
    assert theirs.dtype == torch.float32
    x = torch.randint(0, ours.config.vocab_size, (2, ours.config.max_seq_len // 2),
                      generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert (theirs(x).logits - nanomind_logits(ours, x)).abs().max().item() <= bound(1e-4, device)
    prompt = x[:1, :10]
    assert prompt[0].tolist() + greedy_alone(ours, prompt[0].tolist(), 20) == greedy(theirs, prompt, 20)
    # and back: the same weights, bit for bit, and the same architecture
    convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "back.pt")])
    back = load_checkpoint(str(tmp_path / "back.pt"))
    switches = ("flash", "grad_checkpoint")  # how nanomind computes, not what: not part of the folder
    assert {k: v for k, v in back["model_config"].items() if k not in switches} == \
        {k: v for k, v in state["model_config"].items() if k not in switches}
    assert back["model"].keys() == state["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_sample_py_greedy_answer_equals_transformers_chat_generate(tmp_path, capsys):
    """The demo-size model: sample.py's greedy answer in the chat template and transformers' generate on
    apply_chat_template's ids, stopped at eos, decode to the same text."""
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", demo_config(), seed=3)
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    question = "What is the capital of Kenya?"
    capsys.readouterr()
    sample.main([f"--ckpt={ckpt}", f"--prompt={question}", "--temperature=0", "--max_new_tokens=24"])
    ours = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    if tok.eos_token_id in out:
        out = out[: out.index(tok.eos_token_id)]
    assert ours == tok.decode(out).strip(" ") + "\n"
    assert len(out) > 3  # a real answer was compared, not two empty strings


@pytest.fixture(scope="module", params=["nanomind", "trained"])
def exported_tokenizer(request, trained_tokenizer, tmp_path_factory):
    """(a tiktoken tokenizer, transformers' AutoTokenizer on the exported folder): nanomind's own, or one trained
    here. (MiniMind's, the default: test_minimind_tokenizer_is_exported_as_it_is.)"""
    directory = NANOMIND_DIR if request.param == "nanomind" else trained_tokenizer
    tmp = tmp_path_factory.mktemp("export")
    ckpt = random_checkpoint(tmp / "ckpt.pt", TINY["tied_gqa"], directory)
    convert.main(["export", str(ckpt), str(tmp / "hf")])
    return load_tokenizer(directory), AutoTokenizer.from_pretrained(tmp / "hf")


def test_autotokenizer_encodes_and_decodes_as_nanomind(exported_tokenizer):
    ours, theirs = exported_tokenizer
    for text in [MIXED, *random_strings(300, seed=5)]:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert theirs.decode(ids) == text
    assert theirs(MIXED)["input_ids"] == [ours.bos_id] + ours.encode(MIXED)  # <s> first, as in pretraining
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_gives_encode_chat_ids(exported_tokenizer, conversation):
    ours, theirs = exported_tokenizer
    messages = CONVERSATIONS[conversation]
    expected, _ = encode_chat(ours, messages)
    for generation_prompt in (True, False):  # [INST] turns always end with [/INST]: the prompt is in the template
        got = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                         return_dict=False)
        assert got == expected


def test_minimind_tokenizer_is_exported_as_it_is(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["untied_mha_qk_norm"], MINIMIND_TOKENIZER)
    convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    ours, theirs = load_tokenizer(MINIMIND_TOKENIZER), AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(MIXED, add_special_tokens=False)["input_ids"] == ours.encode(MIXED)
    assert theirs(MIXED)["input_ids"] == [ours.bos_id] + ours.encode(MIXED)  # bos first, as in pretraining
    assert theirs.decode(ours.encode(MIXED)) == MIXED
    original = json.loads((MINIMIND_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert theirs.chat_template == original["chat_template"]
    for messages in CONVERSATIONS:  # MiniMind's ChatML: the generation prompt only when the user spoke last
        generation = messages[-1]["role"] != "assistant"
        assert theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation,
                                          return_dict=False) == encode_chat(ours, messages)[0]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (ours.bos_id, ours.eos_id,
                                                                                         ours.pad_id)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_export_loads_in_its_dtype(dtype, tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["untied_mha_qk_norm"])
    convert.main(["export", str(ckpt), str(tmp_path / "hf"), f"--dtype={dtype}"])
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.dtype == getattr(torch, dtype)
    # the weights are nanomind's rounded to the dtype, nothing else: in float32 both compute the same logits
    ours, _ = model_from_checkpoint(str(ckpt))
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    x = torch.randint(0, 6400, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rounded = nanomind_logits(ours.eval(), x)
        assert (theirs.float()(x).logits - rounded).abs().max().item() <= 1e-4
        native = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(x).logits.float()
    # computed in the dtype itself: within its rounding (8 bits of mantissa for bfloat16, 11 for float16)
    assert (native - rounded).abs().max().item() <= rounded.abs().max().item() * (0.05 if dtype == "bfloat16" else 0.01)


def test_bad_input_is_refused_and_nothing_is_overwritten(tmp_path, capsys):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["tied_gqa"])
    torch.save(load_checkpoint(str(ckpt))["model"], tmp_path / "state_dict.pth")  # MiniMind-style: not ours
    with pytest.raises(CheckpointError, match="not a nanomind checkpoint"):
        convert.main(["export", str(tmp_path / "state_dict.pth"), str(tmp_path / "a")])
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="notes.txt"):
        convert.main(["export", str(tmp_path / "notes.txt"), str(tmp_path / "a")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--force"):
        convert.main(["export", str(ckpt), str(tmp_path / "full")])
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    with pytest.raises(SystemExit) as e:
        cli(lambda _: convert.main(["export", str(ckpt), str(tmp_path / "b"), "--dtype=float8"]))  # as a user runs it
    assert e.value.code == 2 and "float8" in capsys.readouterr().err and not (tmp_path / "b").exists()
    convert.main(["export", str(ckpt), str(tmp_path / "full"), "--force"])
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_sentencepiece_tokenizer_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_lines(random.Random(0), 500)), encoding="utf-8")
    train_tokenizer([str(tmp_path / "corpus.txt"), "--vocab_size=600", f"--out={tmp_path / 'sp'}",
                     "--backend=sentencepiece"])
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["tied_gqa"], tmp_path / "sp")
    with pytest.raises(ConfigError, match="SentencePiece tokenizer is not exported"):
        convert.main(["export", str(ckpt), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
