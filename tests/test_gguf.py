"""convert.py export to .gguf: the gguf package reads back the keys and every tensor, and llama.cpp itself (through
llama-cpp-python, unpatched) tokenizes as nanomind does, computes the same logits and picks the same greedy tokens;
a tokenizer split by a rule llama.cpp lacks is refused before anything is written."""
import random
from pathlib import Path

import gguf
import llama_cpp
import pytest
import torch
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

import convert
from chat import encode_chat
from checkpoint import model_from_checkpoint
from conftest import corpus_lines, random_strings
from errors import ConfigError
from gguf_export import gguf_name, halves_to_pairs
from test_export import CONVERSATIONS, MINIMIND_TOKENIZER, MIXED, TINY, nanomind_logits, random_checkpoint
from tokenizer import NANOMIND_DIR, load_tokenizer

SHAPES = {name: shape | {"vocab_size": 6400} for name, shape in TINY.items()}  # llama; qwen3 (qk_norm, untied)


def llama(path: Path) -> Llama:
    """llama.cpp on the file, every position's logits kept, its KV cache in float32 (float16 by default, which alone
    moves the logits by ~4e-3)."""
    return Llama(str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False,
                 type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


def assert_same_greedy_tokens(model, llm, prompt: list[int], n: int = 16):
    """llama.cpp's first n greedy tokens after prompt are nanomind's (recomputed, no cache)."""
    with torch.no_grad():
        expected = []
        for _ in range(n):
            expected.append(model(torch.tensor([prompt + expected]))[0][0, -1].argmax().item())
    llm.reset()
    got = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        got.append(token)
        if len(got) == n:
            break
    assert got == expected


def export_random(shape: dict, tmp):
    """(nanomind's model, its tokenizer, the GGUF's path, llama.cpp's model of it): random weights of shape,
    MiniMind's tokenizer, float32."""
    ckpt = random_checkpoint(tmp / "ckpt.pt", shape, MINIMIND_TOKENIZER)
    convert.main(["export", str(ckpt), str(tmp / "model.gguf")])
    model, _ = model_from_checkpoint(str(ckpt))
    return model.eval(), load_tokenizer(MINIMIND_TOKENIZER), tmp / "model.gguf", llama(tmp / "model.gguf")


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request, tmp_path_factory):
    return export_random(SHAPES[request.param], tmp_path_factory.mktemp("gguf"))


def test_the_gguf_package_reads_back_the_model_s_keys_and_every_tensor(exported):
    model, tok, path, _ = exported
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    cfg = model.config
    arch = "qwen3" if cfg.qk_norm else "llama"
    assert fields["general.architecture"] == arch and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert (fields[f"{arch}.block_count"], fields[f"{arch}.embedding_length"], fields[f"{arch}.attention.head_count"],
            fields[f"{arch}.attention.head_count_kv"], fields[f"{arch}.attention.key_length"]) == (
        cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.vocab_size and tokens[tok.bos_id] == "<|im_start|>" and tokens[tok.eos_id] == "<|im_end|>"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.add_bos_token"]) == (tok.bos_id, True)
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors}
    state = model.state_dict()
    assert ("output.weight" in tensors) != cfg.tie_embeddings and len(tensors) == len(state) - cfg.tie_embeddings
    for name, weight in state.items():  # every tensor, bit for bit: llama's q and k rows in adjacent-pair order
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if not cfg.qk_norm and name.endswith((".wq.weight", ".wk.weight")):
            weight = halves_to_pairs(weight, cfg.n_heads if ".wq." in name else cfg.n_kv_heads)
        assert torch.equal(tensors[gguf_name(name)], weight), name


def test_llama_cpp_tokenizes_every_string_as_nanomind(exported):
    _, tok, _, llm = exported
    texts = [MIXED, *corpus_lines(random.Random(1), 200), *random_strings(300, seed=7)]
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), repr(text)
        assert llm.detokenize(tok.encode(text)).decode("utf-8", errors="replace") == text, repr(text)
    assert llm.tokenize(MIXED.encode()) == [tok.bos_id, *tok.encode(MIXED)]  # bos first, as in pretraining


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_llama_cpp_renders_the_chat_template_as_encode_chat(exported, conversation):
    _, tok, path, llm = exported
    template = gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()
    messages = CONVERSATIONS[conversation]
    generation = messages[-1]["role"] != "assistant"  # as encode_chat: the generation prompt when the user spoke last
    rendered = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   add_generation_prompt=generation)(messages=messages)
    ids = llm.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
    assert ids == encode_chat(tok, messages)[0]


def test_llama_cpp_computes_nanomind_s_logits_and_greedy_tokens(exported):
    model, tok, _, llm = exported
    ids = [tok.bos_id, *tok.encode(MIXED)][:40]
    llm.reset()
    llm.eval(ids)
    theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    ours = nanomind_logits(model, torch.tensor([ids]))[0]  # every position's
    assert (theirs - ours).abs().max() <= 2e-3
    assert_same_greedy_tokens(model, llm, ids[:8])


def test_a_tokenizer_llama_cpp_cannot_split_is_refused_and_nothing_written(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", TINY["tied_gqa"], NANOMIND_DIR)  # its own split rule
    with pytest.raises(ConfigError, match="nanomind's own rule .*, which llama.cpp does not implement"):
        convert.main(["export", str(ckpt), str(tmp_path / "model.gguf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_an_existing_gguf_is_replaced_only_with_force(tmp_path):
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", SHAPES["tied_gqa"], MINIMIND_TOKENIZER)
    out = tmp_path / "model.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(ConfigError, match="--force"):
        convert.main(["export", str(ckpt), str(out)])
    assert out.read_bytes() == b"keep"
    convert.main(["export", str(ckpt), str(out), "--force", "--dtype=float16"])
    assert Path(out).read_bytes()[:4] == b"GGUF"
    convert.main(["export", str(ckpt), str(tmp_path / "new" / "model.gguf")])  # its folder made, as a folder export's
    assert (tmp_path / "new" / "model.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_half_precision_gguf_computes_the_rounded_model_s_logits(shape, dtype, tmp_path):
    """Weights stored in float16 or bfloat16 (norms in float32): llama.cpp's logits are those of nanomind's model
    with its weights so rounded. Whether ggml also rounds each matmul's input to that type depends on the CPU (its
    AMX kernels keep float32 inputs, its other kernels round them), so the bound is not float32's but the type's."""
    ckpt = random_checkpoint(tmp_path / "ckpt.pt", SHAPES[shape], MINIMIND_TOKENIZER)
    convert.main(["export", str(ckpt), str(tmp_path / "model.gguf"), f"--dtype={dtype}"])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert types["blk.0.ffn_up.weight"] == {"float16": "F16", "bfloat16": "BF16"}[dtype]
    assert types["blk.0.ffn_norm.weight"] == "F32"
    model, _ = model_from_checkpoint(str(ckpt))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(p.to(getattr(torch, dtype)).float())
    tok = load_tokenizer(MINIMIND_TOKENIZER)
    ids = [tok.bos_id, *tok.encode(MIXED)][:40]
    llm = llama(tmp_path / "model.gguf")
    llm.eval(ids)
    theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    ours = nanomind_logits(model.eval(), torch.tensor([ids]))[0]
    unit_roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
    # each rounded matmul input moves a logit by about a unit roundoff of its scale; these add up over the layers
    assert (theirs - ours).abs().max() <= 8 * unit_roundoff * ours.abs().max()
