"""sample.py: a chat checkpoint is prompted in its template (a multi-turn chat with its history), a pretrained one with
plain text; answers repeat under the same seed; the defaults fit a short context."""
import io
from types import SimpleNamespace

import torch

import sample
from chat import encode_chat
from checkpoint import load_model
from conftest import run_script
from engine import prompt_ids
from tokenizer import load_tokenizer


def chat_args(**overrides):
    args = dict(temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0, max_new_tokens=16, system="Be brief.")
    return SimpleNamespace(**{**args, **overrides})


def test_a_scripted_two_turn_chat_feeds_history_in_the_template(tiny_sft, monkeypatch):
    model, _, config = load_model(str(tiny_sft))
    tok = load_tokenizer()
    assert config["stage"] == "sft"
    fed = []  # the ids each answer is generated from
    respond = sample.respond
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, *rest: fed.append(ids) or respond(model, tok, ids, *rest))
    lines = iter(["What is 2 + 3?", "法国的首都是哪里？"])

    def read(prompt):  # like input(): a line per call, then EOFError (Ctrl-D)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    history = sample.chat_loop(model, tok, chat_args(), chat=True, read=read, out=io.StringIO())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    expected_turn_two, _ = encode_chat(tok, history[:3], system="Be brief.")
    assert fed[1] == expected_turn_two  # turn one's question and answer, then turn two's question, in the template
    assert tok.decode(fed[1]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert tok.decode(fed[1]).endswith("<|im_start|>user\n法国的首都是哪里？<|im_end|>\n<|im_start|>assistant\n"
                                       "<think>\n\n</think>\n\n")


def test_answers_are_reproducible_with_the_same_seed(tiny_sft):
    model, _, _ = load_model(str(tiny_sft))
    tok = load_tokenizer()
    ids = prompt_ids(tok, [{"role": "user", "content": "What is 2 + 3?"}], None, 40)
    greedy = [sample.respond(model, tok, ids, chat_args()) for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(5)
        sampled.append(sample.respond(model, tok, ids, chat_args(temperature=1.0, top_p=0.95), generator=generator))
    assert sampled[0] == sampled[1]


def test_the_cli_uses_the_template_for_chat_checkpoints_and_plain_text_for_pretrain(tiny_sft, tiny_pretrained,
                                                                                      monkeypatch, capsys):
    tok = load_tokenizer()
    fed = []
    monkeypatch.setattr(sample, "respond", lambda model, tok, ids, *rest: fed.append(ids) or "")
    sample.main([f"--ckpt={tiny_sft}", "--prompt=What is 2 + 3?", "--max_new_tokens=8"])
    sample.main([f"--ckpt={tiny_pretrained}", "--prompt=The capital of", "--max_new_tokens=8"])
    assert fed[0] == encode_chat(tok, [{"role": "user", "content": "What is 2 + 3?"}])[0]
    assert fed[1] == [tok.bos_id] + tok.encode("The capital of")


def test_sample_defaults_fit_a_short_context_model_and_a_bad_max_new_tokens_is_an_error_line(tiny_sft, monkeypatch):
    """The tiny SFT model's context is 128 ids: by default the prompt keeps at most half of it and the answer may
    take the rest, to the context's end; an explicit --max_new_tokens that leaves no room for the prompt is one
    error line."""
    import sample

    max_seq_len = load_model(str(tiny_sft))[0].config.max_seq_len
    assert max_seq_len == 128
    decoded = []  # (prompt length, max_new_tokens) of each generate call
    generate = sample.generate
    monkeypatch.setattr(sample, "generate", lambda model, prompts, max_new, *rest: decoded.append(
        (len(prompts[0]), max_new)) or generate(model, prompts, max_new, *rest))
    sample.main([f"--ckpt={tiny_sft}", "--prompt=" + "What is the capital of Kenya? " * 20])
    (prompt, max_new), = decoded
    assert 0 < prompt <= max_seq_len // 2 and prompt + max_new == max_seq_len
    result = run_script("sample.py", f"--ckpt={tiny_sft}", "--prompt=hi", "--max_new_tokens=128")
    assert result.returncode == 2 and result.stderr.startswith("error: --max_new_tokens")
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_model_runs_in_the_dtype_asked_for(tiny_sft, monkeypatch, capsys):
    """--dtype autocasts the forward (auto picks bfloat16 or float16 on a GPU; a CPU's auto is float32)."""
    from model import Transformer

    seen = []
    forward = Transformer.forward
    monkeypatch.setattr(Transformer, "forward", lambda self, *a, **kw: seen.append(
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32) or forward(self, *a, **kw))
    for dtype in ("bfloat16", "auto"):
        sample.main([f"--ckpt={tiny_sft}", "--prompt=hi", "--max_new_tokens=2", "--device=cpu", f"--dtype={dtype}"])
    assert seen[0] == torch.bfloat16 and seen[-1] == torch.float32 and len(set(seen)) == 2
