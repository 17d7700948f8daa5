"""
nanomind's engine against llama.cpp on one model, in one process, on the CPU (bench.py --mode=llamacpp).

The model -- random weights of a config's shape (random_model) -- is exported to GGUF in float32 and in Q8_0
(gguf_export.py) with MiniMind's tokenizer: the prompts are random ids, so the file's tokenizer only has to be one
llama.cpp reads (nanomind's own is refused by the export). llama.cpp runs each file through llama-cpp-python's
low-level API: a llama_decode of a llama_batch per step, a sequence id per stream, each sequence's next token the
argmax of its logits. nanomind runs the model through engine.generate (one prefill of all the streams' prompts, then
a batched step per token). Both get the same prompts (random ids, seeded), the same lengths, greedy, no eos, and as
many threads (torch.set_num_threads; llama.cpp's n_threads and n_threads_batch). Each is timed from the prompts as
Python lists to the first new tokens as Python ints (prefill: the prompts' forward and the first token), then to the
last ones (decode: the other new_tokens - 1 steps).

In rounds -- nanomind, llama.cpp float32, llama.cpp Q8_0, with 1 stream, then with `streams` -- so that the
machine's changing load hits all alike: each cell's median tokens/s and its spread over the rounds, each round's
ratio of nanomind's decode tokens/s to the other's, and the share of the other's greedy tokens that are nanomind's
(the float32 file's are, but for near ties: the same work is timed). With --compile=True nanomind runs three times a
turn: eager; with its forward compiled (engine.compiled, as sample.py and serve.py compile it), the one the ratios
are of; and compiled with the other choice of matrix products (other_products), so that one run shows what
engine.compiled's choice for this CPU is worth (its row's ratio: the default's tokens/s over its own). llama.cpp keeps
its own defaults otherwise: a float16 KV cache and flash attention (auto: on), which round attention's inputs to
float16 and move the logits by ~5e-3 (a near tie may go the other way, and the rest of that stream with it;
LlamaCpp(exact=True) computes nanomind's logits to ~5e-6), and a KV buffer per sequence. nanomind's KV cache is in
its compute dtype (float32).
"""
import contextlib
import copy
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine import compiled, generate, own_kernels_by_default
from errors import ConfigError
from gguf_export import export_gguf
from hf_export import tokenizer_files
from model import Transformer
from runtime import setup
from timing import machine, spread
from tokenizer import DEFAULT_DIR, load_tokenizer

NANOMIND, COMPILED = "nanomind", "nanomind compiled"  # the engine eager, and with its forward compiled
FILES = ("float32", "q8_0")  # the GGUF files llama.cpp runs: nanomind's own precision, and 8-bit weights
COLUMNS = {"engine": "{}", "streams": "{}", "prefill_tokens_per_s": "{:.0f}", "prefill_tokens_per_s_min": "{:.0f}",
           "prefill_tokens_per_s_max": "{:.0f}", "decode_tokens_per_s": "{:.1f}", "decode_tokens_per_s_min": "{:.1f}",
           "decode_tokens_per_s_max": "{:.1f}", "nanomind_vs": "{:.2f}x", "nanomind_vs_min": "{:.2f}x",
           "nanomind_vs_max": "{:.2f}x", "same_tokens": "{:.0%}"}  # bench.py's table of the mode


def llama_cpp_module():
    """llama-cpp-python, or a ConfigError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError("mode=llamacpp needs llama-cpp-python (a test and bench extra, not a dependency of "
                          "nanomind): pip install llama-cpp-python") from None
    return llama_cpp


@contextlib.contextmanager
def quiet_llama_cpp():
    """llama.cpp's log lines off (a failure is raised here): llama-cpp-python maps ggml's log levels one off, so that
    its own "errors only" lets llama.cpp's warnings through."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def random_model(model_cfg) -> Transformer:
    """Random weights, every matrix N(0, 1 / its input width): Transformer's own init (std 0.02, the embedding tied)
    makes a model that repeats its prompt's last token, on which any two engines agree; with these it picks among the
    vocabulary (logits of std ~1), so that llama.cpp's tokens being nanomind's says both ran the same computation. A
    forward takes as long whatever the weights are."""
    model = Transformer(model_cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.size(-1) ** -0.5)
    return model.eval()


class LlamaCpp:
    """A GGUF file's model in llama.cpp with a context for `streams` sequences of up to max_len positions each,
    their prompts of prompt_len; generate() as engine.generate, greedy."""

    def __init__(self, lc, model, streams: int, prompt_len: int, max_len: int, threads: int,
                 stack: contextlib.ExitStack, exact: bool = False):
        params = lc.llama_context_default_params()  # llama.cpp's own defaults, but for these
        params.n_seq_max = streams
        # each sequence its n_ctx / n_seq_max positions (kv_unified is off), which llama.cpp rounds up to 256s
        params.n_ctx = streams * -(-max_len // 256) * 256
        params.n_batch = max(params.n_batch, streams * prompt_len)  # every stream's prompt in one llama_decode
        params.n_threads = params.n_threads_batch = threads
        if exact:  # attention in float32 as nanomind's: logits within ~5e-6 of its own (the defaults: ~5e-3)
            params.type_k = params.type_v = lc.GGML_TYPE_F32
            params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.kv_type, self.flash_attn = params.type_k, params.flash_attn_type
        self.lc, self.ctx = lc, lc.llama_init_from_model(model, params)
        if self.ctx is None:
            raise RuntimeError("llama.cpp could not make a context")
        stack.callback(lc.llama_free, self.ctx)
        self.batch = lc.llama_batch_init(streams * prompt_len, 0, 1)
        stack.callback(lc.llama_batch_free, self.batch)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def put(self, i: int, token: int, pos: int, seq: int, logits: bool):
        b = self.batch
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq

    def decode(self, n_tokens: int, n_outputs: int) -> list[int]:
        """The batch's first n_tokens through the model -> the argmax of each of its n_outputs logit rows."""
        self.batch.n_tokens = n_tokens
        status = self.lc.llama_decode(self.ctx, self.batch)
        if status:
            raise RuntimeError(f"llama_decode failed (status {status})")
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(n_outputs, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
        """(prefill seconds, decode seconds, each stream's tokens) of prompts of one length, a sequence each."""
        n, T = len(prompts), len(prompts[0])
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)  # the previous run's sequences
        t0 = time.perf_counter()
        for s, prompt in enumerate(prompts):
            for i, token in enumerate(prompt):
                self.put(s * T + i, token, i, s, i == T - 1)
        last = self.decode(n * T, n)
        t1 = time.perf_counter()
        tokens = [[token] for token in last]
        for step in range(new_tokens - 1):
            for s in range(n):
                self.put(s, last[s], T + step, s, True)
            last = self.decode(n, n)
            for s, token in enumerate(last):
                tokens[s].append(token)
        return t1 - t0, time.perf_counter() - t1, tokens


def nanomind_generate(model, run, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds, decode seconds, each stream's tokens) of engine.generate, greedy, on the CPU."""
    with run.autocast():
        t0 = time.perf_counter()
        stream = generate(model, prompts, new_tokens)
        rows = next(stream)  # the prefill: every prompt in one forward, and each row's first token
        t1 = time.perf_counter()
        for rows in stream:
            pass
    return t1 - t0, time.perf_counter() - t1, [row.tokens for row in rows]


def export_files(model, tmp: str) -> dict[str, Path]:
    """The model as GGUF files, FILES' dtypes, with MiniMind's tokenizer."""
    tokenizer = load_tokenizer(str(DEFAULT_DIR))
    files = tokenizer_files(tokenizer, DEFAULT_DIR, model.config.max_seq_len)
    paths = {dtype: Path(tmp) / f"{dtype}.gguf" for dtype in FILES}
    for dtype, path in paths.items():
        export_gguf(model.state_dict(), model.config, tokenizer, files, dtype, path, "nanomind-bench",
                    f"tokenizer {DEFAULT_DIR}")
    return paths


def load_llama_cpp(lc, path: Path, quantized: bool, stack: contextlib.ExitStack):
    """llama.cpp's model of a GGUF file, and whether it may repack the weights (extra buffer types)."""
    params = lc.llama_model_default_params()
    # This build's AMX kernels (an extra buffer type) crash on any quantized model on an AMX CPU (llama.cpp issue
    # 20824; tests/test_gguf_quant.py does the same): there llama.cpp runs quantized weights as the file has them.
    params.use_extra_bufts = not (quantized and "amx_bf16" in machine()["cpu_flags"])
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if model is None:
        raise RuntimeError(f"llama.cpp could not load {path}")
    stack.callback(lc.llama_model_free, model)
    return model, params.use_extra_bufts


def in_turns(engines: dict, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict:
    """engines: (name, streams) -> generate(prompts, new_tokens). A short warm-up of each (first-call allocations),
    then each in turn, `rounds` times: (name, streams) -> [(prefill tokens/s, decode tokens/s, tokens)], a round
    each."""
    for (_, n), generate_fn in engines.items():
        generate_fn(prompts[:n], min(new_tokens, 4))
    timed = {key: [] for key in engines}
    for r in range(rounds):
        print(f"  round {r + 1} ...", file=sys.stderr, flush=True)
        for (name, n), generate_fn in engines.items():
            prefill, decode, tokens = generate_fn(prompts[:n], new_tokens)
            timed[name, n].append((n * len(prompts[0]) / prefill, n * (new_tokens - 1) / decode, tokens))
    return timed


def same_share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the new tokens, stream by stream and position by position, that are the reference's."""
    pairs = [(a, b) for row, ref in zip(tokens, reference) for a, b in zip(row, ref)]
    return sum(a == b for a, b in pairs) / len(pairs)


def rows_of(timed: dict, reference: str = NANOMIND) -> list[dict]:
    """A row per (engine, streams): the median and spread of its tokens/s and of the reference's (nanomind's,
    eager or compiled) decode tokens/s over its own, round by round; the share of its first round's greedy tokens
    that are the reference's."""
    rows = []
    for (name, n), runs in timed.items():
        ours = timed[reference, n]
        rows.append({"engine": name, "streams": n, **spread("prefill_tokens_per_s", (p for p, _, _ in runs)),
                     **spread("decode_tokens_per_s", (d for _, d, _ in runs)),
                     **spread("nanomind_vs", (o[1] / d for o, (_, d, _) in zip(ours, runs))),
                     "same_tokens": same_share(runs[0][2], ours[0][2])})
    return rows


def check(bench, cfg, model_cfg):
    if cfg.device not in ("auto", "cpu"):
        raise ConfigError(f"mode=llamacpp compares nanomind and llama.cpp on the CPU, got --device={cfg.device}")
    if bench.new_tokens < 2 or bench.prompt_tokens < 1:
        raise ConfigError("mode=llamacpp times a prefill and a decode: prompt_tokens at least 1, new_tokens at "
                          f"least 2, got {bench.prompt_tokens} and {bench.new_tokens}")
    if bench.prompt_tokens + bench.new_tokens > model_cfg.max_seq_len:
        raise ConfigError(f"prompt_tokens + new_tokens ({bench.prompt_tokens} + {bench.new_tokens}) exceed the "
                          f"model's max_seq_len={model_cfg.max_seq_len}: pass a smaller --new_tokens")


def compare(bench, cfg, model_cfg, tmp: str) -> list[dict]:
    """bench: prompt_tokens, new_tokens, clients (the streams at once), rounds, threads (0: torch's default);
    cfg: device, dtype, seed, tokenizer_path, compile (also time nanomind compiled, and compare llama.cpp with
    that). A row per engine and stream count (rows_of)."""
    check(bench, cfg, model_cfg)
    lc = llama_cpp_module()
    run, threads = setup("cpu", cfg.dtype, cfg.seed), bench.threads or torch.get_num_threads()
    model = random_model(model_cfg)  # seeded by setup
    paths = export_files(model, tmp)
    prompts = torch.randint(model_cfg.vocab_size, (bench.clients, bench.prompt_tokens),
                            generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    T, max_len, streams = bench.prompt_tokens, bench.prompt_tokens + bench.new_tokens, sorted({1, bench.clients})
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_llama_cpp())
        lc.llama_backend_init()
        llamas = {dtype: load_llama_cpp(lc, path, dtype != "float32", stack) for dtype, path in paths.items()}
        engines, contexts = {}, []
        fast = {COMPILED: compiled(copy.deepcopy(model)), **other_products(model)} if cfg.compile else {}
        for n in streams:
            engines[NANOMIND, n] = lambda p, k: nanomind_generate(model, run, p, k)
            for name, m in fast.items():
                engines[name, n] = lambda p, k, m=m: nanomind_generate(m, run, p, k)
            for dtype, (llama_model, _) in llamas.items():
                contexts.append(LlamaCpp(lc, llama_model, n, T, max_len, threads, stack))
                engines[f"llama.cpp {dtype}", n] = contexts[-1].generate
        describe(bench, cfg, model, run, threads, lc, contexts[0], llamas)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            timed = in_turns(engines, prompts, bench.new_tokens, bench.rounds)
        finally:
            torch.set_num_threads(before)
    return [row | {"threads": threads, "prompt_tokens": T, "new_tokens": bench.new_tokens}
            for row in rows_of(timed, COMPILED if cfg.compile else NANOMIND)]


def other_products(model) -> dict:
    """The model compiled with the matrix products engine.compiled does not take on this CPU by default: the library's
    (MKL, weights as they are) where it takes inductor's own kernels (frozen weights), and those where it takes the
    library's -- the same two choices on every CPU."""
    own = not own_kernels_by_default(model)
    name = f"{COMPILED}, {'inductor' if own else 'library'} products"
    return {name: compiled(copy.deepcopy(model), freeze=own, gemm=own)}


def describe(bench, cfg, model, run, threads: int, lc, context: LlamaCpp, llamas: dict):
    """What the table compares, before it."""
    c = model.config
    types = {getattr(lc, k): k[len("GGML_TYPE_"):] for k in dir(lc) if k.startswith("GGML_TYPE_")}
    flash = {lc.LLAMA_FLASH_ATTN_TYPE_AUTO: "auto", lc.LLAMA_FLASH_ATTN_TYPE_ENABLED: "on"}.get(context.flash_attn,
                                                                                             "off")
    tokenizer = "" if cfg.tokenizer_path in (None, "", str(DEFAULT_DIR)) else (
        f"; not the config's {cfg.tokenizer_path}: the export takes only a tokenizer llama.cpp can split")
    print(f"model: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads ({c.n_kv_heads} kv), vocab {c.vocab_size}, "
          f"{model.num_params():,} parameters, random weights; the GGUF files carry MiniMind's tokenizer (the prompts "
          f"are random ids){tokenizer}")
    print(f"work: {bench.clients} prompts of {bench.prompt_tokens} random ids (seed {cfg.seed}; 1 stream: the "
          f"first), {bench.new_tokens} new tokens each, greedy, no eos; {threads} threads on both (torch; llama.cpp "
          f"n_threads and n_threads_batch); {bench.rounds} rounds in turns")
    extra = ", ".join(f"{dtype} {'on' if on else 'off (AMX crash workaround)'}" for dtype, (_, on) in llamas.items())
    print(f"nanomind: engine.generate, {run.dtype}, KV cache {run.dtype}"
          f"{', eager, compiled (engine.compiled) and compiled with the other products' if cfg.compile else ''}; "
          f"llama.cpp {lc.__version__} "
          f"(llama-cpp-python's low-level batch API): KV cache {types.get(context.kv_type, context.kv_type)} and "
          f"flash attention {flash} (its defaults), extra buffer types {extra}")


def summary(rows: list[dict]) -> str:
    """The last line: nanomind's decode tokens/s (compiled, when it ran so) over llama.cpp's on the float32 file,
    per stream count."""
    ratios = {row["streams"]: row["nanomind_vs"] for row in rows if row["engine"] == f"llama.cpp {FILES[0]}"}
    name = COMPILED if any(row["engine"] == COMPILED for row in rows) else NANOMIND
    return f"{name} / llama.cpp decode tokens/s: " + ", ".join(
        f"{n} stream{'s' if n > 1 else ''} {ratio:.2f}x" for n, ratio in sorted(ratios.items()))
