"""engine.py: the KV cache against full forwards, the engine's rows against each row alone and against
recomputation, sampling, and the text a stream may show."""
import contextlib
import copy
import random

import pytest
import torch

import model as model_py
from conftest import bound, tiny
from engine import (Engine, KVCache, Row, Sampling, TextStream, borders, compiled, complete, generate,
                    overlap, prompt_ids, sample_next)
from model import Transformer
from openai_api import MAX_STOP_CHARS
from tokenizer import NANOMIND_DIR, load_tokenizer

# the math path in one tile (T <= 64 here) and in tiles of 8 and 4 rows, the last one shorter
TILES = [(True, 64), (False, 64), (False, 8), (False, 4)]


def sharpen(model: Transformer) -> Transformer:
    """At init a model's next token mostly echoes the current one; larger weights make context matter."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


def ids(model, B=3, T=17, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


def prompts_of(*lengths: int) -> list[list[int]]:
    """A random prompt of each length (ids below the tiny model's vocab_size), seeded by its length."""
    return [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def run(model, prompts, max_new, **options) -> list[list[int]]:
    """generate() to the end: each row's tokens."""
    for rows in generate(model, [p.tolist() if torch.is_tensor(p) else p for p in prompts], max_new, **options):
        pass
    return [row.tokens for row in rows]


def alone(model, prompt: list[int], max_new: int) -> list[int]:
    return run(model, [prompt], max_new)[0]


# --- the KV cache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flash, tile", TILES)
def test_decoding_with_the_kv_cache_gives_the_logits_of_a_full_forward(flash, tile, device, monkeypatch):
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = sharpen(tiny(flash=flash)).to(device).eval()
    idx = ids(model, B=2, T=12).to(device)
    full = model.output(model.hidden_states(idx))  # (B, 12, V)
    caches = [KVCache(2, 12) for _ in model.layers]
    steps = [model(idx[:, :5], caches=caches)[0]]
    for t in range(5, 12):
        steps.append(model(idx[:, t : t + 1], caches=caches, start_pos=t)[0])
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 4:], atol=bound(1e-5, device))


@pytest.mark.parametrize("flash, tile", TILES)
def test_a_cache_continued_by_several_tokens_at_once_gives_the_logits_of_a_full_forward(flash, tile, device,
                                                                                       monkeypatch):
    # what a row that stopped (at a tool call) and goes on with more text needs: chunks fed at positions 5, 9, 16
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = sharpen(tiny(flash=flash)).to(device).eval()
    idx = ids(model, B=2, T=20).to(device)
    full = model.output(model.hidden_states(idx))
    caches = [KVCache(2, 20) for _ in model.layers]
    for start, end in ((0, 5), (5, 9), (9, 16), (16, 20)):
        h = model.hidden_states(idx[:, start:end], caches, start_pos=start)
        assert (model.output(h) - full[:, start:end]).abs().max() <= bound(1e-5, device), (start, end)


@pytest.mark.parametrize("flash, tile", TILES)
def test_rows_decoding_at_their_own_positions_give_the_logits_of_their_own_full_forward(flash, tile, device,
                                                                                       monkeypatch):
    # a server's batch: prompts of 3, 9 and 6 tokens, each prefilled alone, then decoded together one token per row
    # per step, each row at its own position, in a cache with a spare row
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = sharpen(tiny(flash=flash)).to(device).eval()
    lengths, steps = [3, 9, 6], 8
    rows = [ids(model, B=1, T=n + steps + 1, seed=n)[0, : n + steps].to(device) for n in lengths]
    caches = [KVCache(4, 40) for _ in model.layers]
    for r, (n, row) in enumerate(zip(lengths, rows)):
        own = [KVCache(1, n) for _ in model.layers]
        model(row[None, :n], caches=own)
        for cache, prefilled in zip(caches, own):
            cache.copy_row(r, prefilled, 0, n)
    positions = torch.tensor(lengths, device=device)
    for s in range(steps):
        tokens = torch.stack([row[n + s] for n, row in zip(lengths, rows)])[:, None]  # (3, 1)
        logits, _ = model(tokens, caches=caches, start_pos=positions + s)
        for r, (n, row) in enumerate(zip(lengths, rows)):
            full = model.output(model.hidden_states(row[None, : n + s + 1]))[0, -1]
            assert (logits[r, 0] - full).abs().max() <= bound(1e-5, device), (r, s)


# --- rows in the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("flash, tile", TILES)
def test_greedy_generation_with_kv_cache_equals_recomputation(flash, tile, device, monkeypatch):
    monkeypatch.setattr(model_py, "ATTENTION_TILE", tile)
    model = sharpen(tiny(flash=flash)).to(device).eval()
    prompt = ids(model, B=3, T=6)
    cached = run(model, prompt, 30, use_cache=True)
    uncached = run(model, prompt, 30, use_cache=False)
    assert [len(t) for t in cached] == [30, 30, 30]
    assert cached == uncached


def test_sampling_with_kv_cache_equals_recomputation_under_the_same_seed(device):
    model = tiny().to(device).eval()
    prompt = ids(model, B=2, T=5)
    outs = []
    for use_cache in (True, False):  # the generator on the model's device, as the server makes it
        sampling = Sampling(0.8, top_k=20, top_p=0.9, generator=torch.Generator(device).manual_seed(123))
        outs.append(run(model, prompt, 20, sampling=sampling, use_cache=use_cache))
    assert outs[0] == outs[1]


def test_generation_refuses_to_run_past_max_seq_len():
    model = tiny(max_seq_len=16).eval()
    with pytest.raises(ValueError, match="max_seq_len"):
        run(model, ids(model, B=1, T=11), 10)


def test_rows_stop_at_eos_and_the_others_go_on():
    model = tiny().eval()
    prompt = ids(model, B=2, T=4)
    free = run(model, prompt, 12)
    eos = free[0][3]  # row 0 produces this id at its 4th new token
    out = run(model, prompt, 12, eos_id=eos)
    for row in range(2):
        if eos in free[row]:
            assert out[row] == free[row][: free[row].index(eos) + 1]  # up to its first eos, which ends it
        else:
            assert out[row] == free[row]
    assert out[0][-1] == eos and len(out[0]) <= 4


def test_top_k_1_a_tiny_top_p_and_a_tiny_temperature_are_greedy():
    model = tiny().eval()
    prompt = ids(model, B=2, T=5)
    greedy = run(model, prompt, 10)
    g = torch.Generator().manual_seed(0)
    assert run(model, prompt, 10, sampling=Sampling(1.0, top_k=1, generator=g)) == greedy
    assert run(model, prompt, 10, sampling=Sampling(1.0, top_p=1e-6, generator=g)) == greedy
    for temperature in (1e-38, 1e-45, 5e-324):  # too small to divide by (nan probabilities): greedy, in every caller
        assert run(model, prompt, 10, sampling=Sampling(temperature)) == greedy


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    history = torch.tensor([[3, 1]])
    # id 3: 3.0 / 2 = 1.5 < 2.0, so greedy now picks id 0; id 1 is pushed further down
    assert sample_next(logits, history, 0, None, None, 2.0).item() == 0
    assert sample_next(logits, history, 0, None, None, 1.0).item() == 3


def test_the_repetition_penalty_of_rows_of_different_lengths_is_each_row_s_own():
    # rows sampled together but at different lengths: each row's penalty counts its own ids only
    model = sharpen(tiny()).eval()
    prompts = [ids(model, B=1, T=n, seed=n)[0].tolist() for n in (4, 7)]
    penalised = Sampling(0.0, repetition_penalty=3.0)
    engine = Engine(model, 2)
    rows = [Row(p, 8, penalised) for p in prompts]
    engine.add(rows[:1])
    engine.step()  # row 0 is a token ahead when row 1 joins
    engine.add(rows[1:])
    while engine.rows:
        engine.step()
    for row, prompt in zip(rows, prompts):
        assert row.tokens == run(model, [prompt], 8, sampling=Sampling(0.0, repetition_penalty=3.0))[0]


@pytest.mark.parametrize("flash", [True, False])
def test_rows_joining_and_leaving_the_batch_get_what_they_get_alone(flash, device, monkeypatch):
    # 7 prompts, room for 3 rows: rows start and end at different steps, and later prompts wait for a row
    monkeypatch.setattr(model_py, "ATTENTION_TILE", 4)
    model = sharpen(tiny(flash=flash)).to(device).eval()
    prompts = prompts_of(3, 9, 5, 12, 4, 7, 6)
    lengths = [20, 6, 14, 3, 25, 9, 11]
    engine = Engine(model, max_batch=3)
    waiting = [Row(prompt, n) for prompt, n in zip(prompts, lengths)]
    rows, batch_sizes = list(waiting), []
    while waiting or engine.rows:
        while waiting and len(engine.rows) < 3:
            engine.add([waiting.pop(0)])  # each prefilled alone
        engine.step()
        batch_sizes.append(len(engine.rows))
    assert max(batch_sizes) == 3 and len(set(batch_sizes)) > 2  # full, then shrinking as rows finish
    for row, prompt, n in zip(rows, prompts, lengths):
        assert row.tokens == alone(model, prompt, n) and row.finish_reason == "length"


def test_a_prompt_prefilled_once_for_a_group_of_rows(device):
    # a group of completions of one prompt (RL's rollouts): greedy rows all give the answer alone; sampled rows
    # draw from one generator, differ from each other, and repeat under the same seed
    model = sharpen(tiny()).to(device).eval()
    prompt = ids(model, B=1, T=6)[0].tolist()
    assert run(model, [prompt] * 4, 12) == [alone(model, prompt, 12)] * 4
    sampled = [run(model, [prompt] * 4, 12, sampling=Sampling(1.0, generator=torch.Generator(device).manual_seed(7)))
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len({tuple(t) for t in sampled[0]}) > 1


def test_a_decode_step_waits_for_the_device_once(device, monkeypatch):
    """Rows that each sample their own way (a server's requests) still make one host sync per step: every row's
    token is read back at once."""
    model = tiny().to(device).eval()
    engine = Engine(model, max_batch=3)
    for n, s in zip((3, 5, 4), (Sampling(0.0), Sampling(0.9, generator=torch.Generator(device).manual_seed(1)),
                                Sampling(1.2, top_k=5, generator=torch.Generator(device).manual_seed(2)))):
        engine.add([Row(list(range(1, n + 1)), 8, s)])
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, original=original, name=name: reads.append(name) or original(t))
    engine.step()
    assert reads == ["tolist"] and all(len(row.tokens) == 2 for row in engine.rows)


def test_a_row_whose_sampling_fails_fails_alone():
    model = tiny(dim=32).eval()
    engine = Engine(model, max_batch=3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    # the middle row samples with something that is no generator: torch.multinomial raises for it alone
    samplings = [Sampling(0.0), Sampling(1.0, generator="not a generator"), Sampling(0.0)]
    rows = [Row(p, 6, s) for p, s in zip(prompts, samplings)]
    for row in rows:
        engine.add([row])
    for _ in range(20):  # bounded: 6 tokens each
        engine.step()
    assert rows[1].finish_reason == "error" and isinstance(rows[1].error, TypeError)
    for row in (rows[0], rows[2]):
        assert row.tokens == alone(model, row.prompt, 6) and row.finish_reason == "length"
    with pytest.raises(TypeError):  # generate() raises it
        run(model, [prompts[0]], 6, sampling=samplings[1])


def test_generate_takes_prompts_of_any_lengths_and_each_gets_what_it_gets_alone():
    model = sharpen(tiny()).eval()
    prompts = [ids(model, B=1, T=n, seed=n)[0].tolist() for n in (5, 3, 5, 8)]
    assert run(model, prompts, 10) == [alone(model, p, 10) for p in prompts]
    with pytest.raises(ValueError, match="one length"):  # the reference recomputes whole rows: one length
        run(model, prompts, 10, use_cache=False)


def test_complete_answers_each_prompt_as_it_would_be_answered_alone():
    model, tokenizer = sharpen(tiny(vocab_size=6400)).eval(), load_tokenizer()
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in ("Hi", "Where is Kenya?", "Ho")]
    eos = alone(model, prompts[1], 8)[2]  # an id the second answer writes third: it ends there
    tokenizer.eos_id = eos
    texts = complete(model, tokenizer, prompts, max_new_tokens=8, batch_size=1)
    assert texts == complete(model, tokenizer, prompts, max_new_tokens=8)  # batched by prompt length: the same
    for prompt, text in zip(prompts, texts):
        tokens = alone(model, prompt, 8)
        tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert text == tokenizer.decode(tokens).strip()


# --- prompts and text --------------------------------------------------------------------------------

def test_a_prompt_is_the_chat_template_or_bos_and_the_text_each_cut_to_fit():
    tokenizer = load_tokenizer()
    text = "The capital of Kenya is"
    assert prompt_ids(tokenizer, text) == [tokenizer.bos_id] + tokenizer.encode(text)
    assert prompt_ids(tokenizer, text, max_len=3) == tokenizer.encode(text)[-3:]  # the end stays
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Where is Kenya?"}]
    whole = prompt_ids(tokenizer, turns, system="Be brief.")
    generation_prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # ChatML's, MiniMind's way
    assert tokenizer.decode(whole).endswith(f"Where is Kenya?<|im_end|>\n{generation_prompt}")
    short = prompt_ids(tokenizer, turns, system="Be brief.", max_len=len(whole) - 1)  # the first turn goes
    assert "Hello!" not in tokenizer.decode(short) and "Be brief." in tokenizer.decode(short)


def test_text_is_sent_in_whole_characters_and_never_the_start_of_a_stop_string():
    tokenizer = load_tokenizer()
    text = " Paris 😀 北京 é ST OP"
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # the emoji is cut across byte tokens
    stream = TextStream(tokenizer, ["STOP", " OP"], strip=True)
    pieces = [stream.add(i) for i in ids]
    assert stream.stopped and "".join(pieces) == "Paris 😀 北京 é ST"
    assert not any("\ufffd" in p for p in pieces)
    assert "😀" in pieces[[tokenizer.decode(ids[: k + 1]).endswith("😀") for k in range(len(ids))].index(True)]
    broken = TextStream(tokenizer, [], strip=False)  # bytes that never make a character are not held forever
    pieces = [broken.add(240) for _ in range(6)]
    assert pieces[3] and "".join(pieces) + broken.finish() == tokenizer.decode([240] * 6)
    held = TextStream(tokenizer, ["ST OPX"], strip=True)  # " ST OP" may yet become it: held back
    pieces = [held.add(i) for i in ids]
    assert not held.stopped and "".join(pieces) == "Paris 😀 北京 é " and held.finish() == "ST OP"


class Counted(str):
    """A str that counts the characters read out of it by indexing and slicing."""
    reads = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        Counted.reads += len(part)
        return part


def test_holding_back_a_stop_string_s_start_reads_it_a_bounded_number_of_times():
    tokenizer = load_tokenizer()
    n = MAX_STOP_CHARS
    stops = [Counted("a" * (n - 1) + "b"), Counted("ab" * (n // 2 - 1) + "ac"), Counted("a" * (n - 2) + "ba"),
             Counted("ba" * (n // 2))]  # long runs of what the text repeats: the worst case of trying each prefix
    text = tokenizer.encode("a" * (n + 200))
    stream = TextStream(tokenizer, stops, strip=False)
    per_token = []
    for token in text:
        Counted.reads = 0
        stream.add(token)
        per_token.append(Counted.reads)
    assert max(per_token) <= 3 * sum(map(len, stops))  # linear; trying every prefix reads ~n^2/2 per stop
    assert not stream.stopped and stream.sent == "a" * (len(tokenizer.decode(text)) - (n - 1))  # may yet be stop 0
    assert stream.sent + stream.finish() == tokenizer.decode(text)


def test_held_back_text_is_the_longest_start_of_a_stop_string_it_ends_with():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        text, stop = ("".join("ab"[i] for i in torch.randint(0, 2, (n,), generator=g).tolist())
                      for n in torch.randint(1, 12, (2,), generator=g).tolist())
        brute = max([k for k in range(1, len(stop)) if text.endswith(stop[:k])], default=0)
        assert overlap(text, stop, borders(stop)) == brute, (text, stop)


class FullDecode:
    """The naive reference of TextStream: every token decodes the whole reply again and reads all of its text."""

    def __init__(self, tokenizer, stop: list[str], strip: bool):
        self.tokenizer, self.stop, self.strip = tokenizer, stop, strip
        self.ids, self.sent, self.stopped, self.waited = [], "", False, 0

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids)
        return text.lstrip(" ") if self.strip else text

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.text()
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self.send(text[: min(found)].rstrip(" ") if self.strip else text[: min(found)])
        self.waited += 1
        if text.endswith("\ufffd") and self.waited < 4:
            return ""
        self.waited = 0
        held = max([k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
        if self.strip:
            held = max(held, len(text) - len(text.rstrip(" ")))
        return self.send(text[: len(text) - held])

    def finish(self) -> str:
        return self.send(self.text().rstrip(" ") if self.strip else self.text())

    def send(self, text: str) -> str:
        new = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += new
        return new


class CountingDecodes:
    """A tokenizer whose decode counts the ids it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


MIXED_TEXTS = ["你好，世界！今天天气很好。", " Paris 😀 北京 é ST OP", "👨‍👩‍👧 family  ", "  spaces   around   ",
               "a b  c\n\n d", "数学：3+4=7。🎉🎉", "<|im_end|> 🇰🇪 naïve"]


def stream_pieces(stream, ids: list[int]) -> list[str]:
    """What a stream sends for ids, token by token up to a stop string, then what finish() sends."""
    pieces = []
    for token in ids:
        pieces.append(stream.add(token))
        if stream.stopped:
            break
    return pieces + [stream.finish()]


@pytest.mark.parametrize("vocab", ["minimind", "nanomind"])
def test_a_text_stream_sends_what_decoding_the_whole_reply_at_every_token_sends(vocab):
    # random ids (cut characters, completed or never), Chinese text and emoji, and the two mixed; stop strings
    # from the reply's own text; with and without strip
    tokenizer = load_tokenizer(NANOMIND_DIR if vocab == "nanomind" else None)
    cut = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).endswith("\ufffd")]
    g = random.Random(0)
    for _ in range(400):
        text = tokenizer.encode("".join(g.choice(MIXED_TEXTS) for _ in range(g.randrange(1, 4))))
        noise = [g.choice(cut) if g.random() < 0.5 else g.randrange(tokenizer.vocab_size) for _ in range(40)]
        ids = g.choice([noise[: g.randrange(1, 40)], text, text + noise[:5] + text])
        reply = tokenizer.decode(ids)
        stop = [reply[i : i + g.randrange(1, 5)] for i in g.sample(range(len(reply)), min(len(reply), g.randrange(3)))]
        stop = [s for s in stop if "\ufffd" not in s]  # what a client may send
        strip = g.random() < 0.5
        expected = stream_pieces(FullDecode(tokenizer, stop, strip), ids)
        assert stream_pieces(TextStream(tokenizer, stop, strip), ids) == expected, (ids, stop, strip)


@pytest.mark.parametrize("vocab", ["minimind", "nanomind"])
def test_a_text_stream_decodes_a_bounded_number_of_ids_per_token(vocab):
    tokenizer = load_tokenizer(NANOMIND_DIR if vocab == "nanomind" else None)
    reply = "".join(MIXED_TEXTS) * 150
    ids = tokenizer.encode(reply)
    counting = CountingDecodes(tokenizer)
    stream, per_token = TextStream(counting, ["STOP", "<|im_start|>"], strip=True), []
    for token in ids:
        counting.decoded = 0
        stream.add(token)
        per_token.append(counting.decoded)
    assert len(ids) > 4000 and max(per_token) <= 8  # decoding the whole reply again: up to len(ids) a token
    assert stream.sent + stream.finish() == reply.strip(" ")


def test_a_decode_step_takes_inductors_own_product_kernels_untimed_and_a_prefill_does_not():
    """gemm=True: the products of a decode step (one token a row) become inductor's C++ kernels, chosen without
    timing them against the library's, that read the weights ahead; a prefill's stay the library's calls, and
    inductor's kernel is left as it was for other compiles."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache, run_and_get_cpp_code
    torch._dynamo.reset()
    eager = sharpen(tiny(flash=False)).eval()
    fast = compiled(copy.deepcopy(eager), freeze=True, gemm=True)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec  # after compile_fx: they import in a cycle
    batch = ids(eager, B=2, T=5)
    kernel = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    with torch.no_grad(), fresh_cache():  # a cached graph is not generated again, and counts nothing
        counters.clear()
        assert torch.allclose(fast(batch)[0], eager(batch)[0], rtol=0, atol=1e-4)
        assert counters["inductor"]["cpp_templated_kernel_counter"] == 0
        (logits, _), code = run_and_get_cpp_code(fast, batch[:, :1])
        assert torch.allclose(logits, eager(batch[:, :1])[0], rtol=0, atol=1e-4)
        assert counters["inductor"]["cpp_templated_kernel_counter"] > 0
        assert counters["inductor"]["select_algorithm_autotune"] == 0
    assert "__builtin_prefetch(B + (k + 32) * ldb" in code
    assert CppMicroGemmFP32Vec.TEMPLATE_KERNEL == kernel and "prefetch(B + (k + 32)" not in kernel
    with pytest.raises(ValueError, match="gemm=True needs freeze=True"):
        compiled(copy.deepcopy(eager), freeze=False, gemm=True)
    compiled(copy.deepcopy(eager), freeze=False)  # on any CPU: unfrozen, gemm's default is off


def served(model, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each prompt's tokens, decoded as a server does with room for 2 rows: rows start and end at different steps."""
    engine, waiting = Engine(model, max_batch=2), [Row(p, n) for p, n in zip(prompts, lengths)]
    rows = list(waiting)
    while waiting or engine.rows:
        while waiting and len(engine.rows) < 2:
            engine.add([waiting.pop(0)])
        engine.step()
    return [row.tokens for row in rows]


def test_a_compiled_model_warmed_up_as_the_server_does_takes_prompts_of_new_lengths_without_compiling():
    """serve.py --compile compiles each kind of call once before it listens (warmed_up). Prompts of other lengths,
    one longer than an attention tile, and rows at their own positions then compile nothing: a compile would stall
    every stream for a minute, and past dynamo's limit of graphs the model would run eagerly."""
    from serve import warmed_up
    torch._dynamo.reset()
    eager = sharpen(tiny(flash=False, max_seq_len=160)).eval()
    fast = warmed_up(compiled(copy.deepcopy(eager)), contextlib.nullcontext)
    prompts = prompts_of(6, 70, 11)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert served(fast, prompts, [9, 5, 7]) == served(eager, prompts, [9, 5, 7])


@pytest.mark.parametrize("flash,freeze,gemm", [(True, False, False), (False, True, True), (True, True, False)])
def test_a_compiled_model_decodes_what_the_eager_one_does(flash, freeze, gemm):
    """engine.compiled (sample.py and serve.py --compile), its weights inputs of the graph or frozen into it, a
    decode step's products the library's or inductor's own kernels (on any CPU, whichever its vendor picks): prompts
    prefilled together and alone, rows in lockstep, rows joining and leaving the batch at their own positions, one
    row alone: the tokens of the eager model. The compiled kernels sum in their own order, so the logits agree to
    rounding, not bit for bit."""
    torch._dynamo.reset()  # the graphs earlier tests compiled count toward dynamo's limit, past which it runs eager
    eager = sharpen(tiny(flash=flash)).eval()
    fast = compiled(copy.deepcopy(eager), freeze=freeze, gemm=gemm)
    batch = ids(eager, B=3, T=7)
    with torch.no_grad():
        assert torch.allclose(fast(batch)[0], eager(batch)[0], rtol=0, atol=1e-4)
    prompts = prompts_of(3, 9, 5, 12)
    assert served(fast, prompts, [20, 6, 14, 9]) == served(eager, prompts, [20, 6, 14, 9])
    assert run(fast, batch, 12) == run(eager, batch, 12)
    assert run(fast, batch[:1], 12) == run(eager, batch[:1], 12)
    with torch.no_grad():  # frozen, the graph keeps the weights it was compiled with; else it reads the model's
        before = fast(batch)[0]
        fast.layers[0].attention.wq.weight.mul_(2)
        assert torch.equal(fast(batch)[0], before) == freeze
