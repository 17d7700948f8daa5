"""
Generation, written once: sample.py, serve.py, eval.py, eval_demo.py and bench.py all generate through it.

  KVCache       one layer's keys and values for a batch of rows, preallocated
  sample_next   the next id from last-position logits: temperature, top-k, top-p, repetition penalty
  Row, Engine   rows decoding together in one KV cache, each at its own position: add() prefills prompts (one
                forward for prompts of one length; a prompt may start several rows, a group of completions),
                step() decodes one token for every row, and rows that are done leave the batch
  decode_steps  the one decoding loop: Rows of any prompt lengths, yielded after the prefill and every step
  generate      id lists in -> their rows, streamed (each token as it comes: the CLI, the bench)
  decode        Rows in -> the same Rows, decoded to their ends (RL's groups of completions, tool turns)
  complete      id lists in -> each completion's text (evaluation)
  TextStream    a row's ids -> the text it may show so far: whole UTF-8 characters, never half a stop string
  prompt_ids    messages in the chat template, or a text to continue -> the ids to generate from
  compiled      a model whose forward torch.compile has compiled for generation (--compile in sample/serve.py)

A row that stops (at a stop string, a tool call) can go on later as a new row whose prompt is everything so far
plus what comes next: the model continues a cache at any position (Transformer.hidden_states).
"""
import contextlib
import os
from dataclasses import dataclass

import torch

from chat import encode_chat
from runtime import cpu_info


def compiled(model, freeze: bool | None = None, gemm: bool | None = None):
    """The model, its forward compiled by torch.compile with dynamic shapes: a batch, a prompt and a cache position
    of any size share one compiled graph per kind of call (prefill, rows in lockstep, rows at their own positions)
    instead of one per size. Each kind compiles at its first call (one to three minutes on a 2-core CPU); then a
    decode step runs as fused kernels and matrix products called from C++ (cpp_wrapper), without Python between
    them. freeze=True makes the weights constants of the graph (inductor's freezing), which it prepacks for oneDNN's
    matrix products: on an AMD EPYC they decoded 8 streams 1.6x as fast as MKL's, PyTorch's default, while on an
    Intel Xeon MKL's were the faster (docs/performance.md). gemm=True (frozen weights only) has inductor write the
    products of a decode step (one token a row) as C++ kernels of its own, blocked for these weights and the CPU's
    vector width and reading the weights ahead: on an AMD EPYC one stream decoded 1.7x and 8 streams 1.3x as fast
    as with oneDNN's, while on an Intel Xeon they lost to MKL's at 8 rows; a prefill keeps the library's, faster at
    hundreds of rows. None turns either on for AMD CPUs alone (gemm only where frozen). A frozen model changed
    after compiling runs its old weights, so compile only a model whose weights are final (sample.py, serve.py)."""
    from torch._inductor.compile_fx import compile_fx
    own = own_kernels_by_default(model)
    freeze = own if freeze is None else freeze
    gemm = own and freeze if gemm is None else gemm
    if gemm and not freeze:
        raise ValueError("engine.compiled: gemm=True needs freeze=True (inductor's kernels take constant weights)")

    def inductor(graph, example_inputs):  # a backend of its own per call: graphs of other settings are not reused
        with own_kernels_untimed() if gemm else contextlib.nullcontext():  # a user's own autotuning left as it is
            return compile_fx(graph, example_inputs, config_patches={"cpp_wrapper": True})
    forward = torch.compile(model.forward, dynamic=True, backend=inductor)

    def compiled_forward(idx, *args, **kwargs):  # settings read as dynamo traces: compile_fx patches them too late
        settings = {"freezing": True} if freeze else {}
        if gemm and idx.size(1) == 1:  # a decode step, a graph of its own: dynamo specializes a size of 1
            settings.update(max_autotune_gemm=True, max_autotune_gemm_backends="CPP,ATEN")
        with torch._inductor.config.patch(settings):
            return forward(idx, *args, **kwargs)
    model.forward = compiled_forward
    return model


def own_kernels_by_default(model) -> bool:
    """Whether compiled freezes the weights and takes inductor's own product kernels by default: on AMD CPUs."""
    return next(model.parameters()).device.type == "cpu" and cpu_info().get("vendor_id") == "AuthenticAMD"


# inductor's float32 micro-kernel reads a weight row (k) per step of its loop; asking for the row 32 steps ahead
# (4 KB further in a packed block) keeps memory busy while the FMAs run: 8 streams 1.08-1.12x as fast on a Zen 4
WEIGHT_ROW_READ = "            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);\n"
PREFETCHED_ROW_READ = WEIGHT_ROW_READ + """\
#if defined(__GNUC__)
            __builtin_prefetch(B + (k + 32) * ldb + col * VLEN);
#endif
"""


@contextlib.contextmanager
def own_kernels_untimed():
    """Where inductor offers a C++ kernel of its own for a product (its GEMM template: constant weights), take it
    without timing it against the library's call: no seconds of timing a product at compile time, and the same
    kernels every run; and its float32 kernel reads the weights ahead (WEIGHT_ROW_READ: a torch whose kernel
    reads them otherwise keeps its own). Products it has none for (attention's) keep the library's."""
    import torch._inductor.compile_fx  # noqa: F401  first: inductor's modules import each other in a cycle
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller
    from torch._inductor.select_algorithm import get_algorithm_selector_cache

    def prefer_own(choices):
        own = [c for c in choices if isinstance(getattr(c, "_wrapped", c), CppTemplateCaller)]  # some come wrapped
        return own[:1] or choices
    steps = get_algorithm_selector_cache().preprocessing_fns
    steps.append(prefer_own)
    kernel = CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    CppMicroGemmFP32Vec.TEMPLATE_KERNEL = kernel.replace(WEIGHT_ROW_READ, PREFETCHED_ROW_READ)
    try:
        yield
    finally:
        steps.remove(prefer_own)
        CppMicroGemmFP32Vec.TEMPLATE_KERNEL = kernel


class KVCache:
    """One layer's keys and values, preallocated once: (B, K, max_len, D); a batch of b <= B rows uses rows 0..b-1.
    Rows share one position (start_pos an int: the rows of one prompt length, in lockstep), or each decodes one
    token at its own position (start_pos a (b,) tensor: rows that started at different times)."""

    def __init__(self, batch_size: int, max_len: int):
        self.shape = (batch_size, max_len)
        self.k = self.v = None  # allocated at the first write, in the dtype attention runs in

    def allocate(self, k, v):
        B, max_len = self.shape
        self.k = k.new_zeros(B, k.size(1), max_len, k.size(3))
        self.v = v.new_zeros(B, v.size(1), max_len, v.size(3))

    def update(self, k, v, start_pos: int | torch.Tensor):
        """Write k, v (b, K, T, D) at start_pos; return the keys and values rows 0..b-1 attend to: (b, K, start_pos
        + T, D), or with per-row positions all max_len of them (attention hides each row's keys past its own)."""
        if self.k is None:
            self.allocate(k, v)
        b = k.size(0)
        if isinstance(start_pos, int):
            end = start_pos + k.size(2)
            self.k[:b, :, start_pos:end] = k
            self.v[:b, :, start_pos:end] = v
            return self.k[:b, :, :end], self.v[:b, :, :end]
        rows = torch.arange(b, device=k.device)
        self.k[rows, :, start_pos] = k[:, :, 0]  # row r's key goes to position start_pos[r]: (b, K, D)
        self.v[rows, :, start_pos] = v[:, :, 0]
        return self.k[:b], self.v[:b]

    def prefix(self, length: int) -> "KVCache":
        """This cache's first `length` positions, sharing its storage: a batch decoding at per-row positions
        attends to the keys up to its longest row, not to all max_len."""
        view = KVCache(self.shape[0], length)
        view.k, view.v = self.k[:, :, :length], self.v[:, :, :length]
        return view

    def copy_row(self, row: int, src: "KVCache", src_row: int, length: int):
        """Row `row`'s first `length` positions <- those of src's row src_row: a prompt prefilled elsewhere joins
        the batch, or the batch's last row moves into the place of one that finished."""
        if self.k is None:
            self.allocate(src.k, src.v)
        self.k[row, :, :length] = src.k[src_row, :, :length]
        self.v[row, :, :length] = src.v[src_row, :, :length]


# -----------------------------------------------------------------------------
# sampling

MIN_TEMPERATURE = 1e-5  # sampling at a lower temperature is greedy


def sample_next(logits, history, temperature: float, top_k: int | None, top_p: float | None,
                repetition_penalty: float, generator: torch.Generator | None = None):
    """Pick the next id (B, 1) from last-position logits (B, V) given the ids so far (B, T); random draws come
    from generator (default: torch's global one)."""
    logits = logits.float()
    if repetition_penalty != 1.0:
        # CTRL's penalty on every id already in the sequence: shrink positive logits, push negative ones down
        seen = logits.gather(1, history)
        logits = logits.scatter(1, history, torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty))
    if temperature < MIN_TEMPERATURE:  # 0 means greedy; far below, logits / temperature overflows to inf - inf = nan
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # nucleus: keep the most likely ids until their mass reaches top_p (the first id always stays)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


@dataclass(eq=False)  # compared by identity: rows that share one Sampling are sampled in one call
class Sampling:
    """How rows pick their next token; temperature 0 is greedy. generator: where random draws come from (None:
    torch's global generator)."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None


GREEDY = Sampling(temperature=0.0)


# -----------------------------------------------------------------------------
# rows and the engine

class Row:
    """One sequence being generated: its prompt, the tokens so far, how it samples and when it ends."""

    def __init__(self, prompt: list[int], max_new: int, sampling: Sampling = GREEDY, eos_id: int | None = None):
        self.prompt, self.max_new, self.sampling, self.eos_id = prompt, max_new, sampling, eos_id
        self.tokens: list[int] = []  # generated so far, its eos_id included
        self.finish_reason: str | None = None  # "stop" (eos_id), "length" (max_new), "error", or the caller's own
        self.error: Exception | None = None
        self.number: int | None = None  # set by the engine: the order rows were added in

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached(self) -> int:
        """Positions held in the KV cache: the prompt and every generated token but the last (not yet fed)."""
        return len(self.prompt) + len(self.tokens) - 1

    def append(self, token: int):
        """Take the next token; a subclass may watch it (a server streams it, and may stop the row itself)."""
        self.tokens.append(token)
        if token == self.eos_id:
            self.finish_reason = "stop"
        elif len(self.tokens) == self.max_new:
            self.finish_reason = "length"

    def fail(self, error: Exception):
        self.finish_reason, self.error = "error", error


class Engine:
    """A batch of up to max_batch rows in one KV cache of max_len positions. Rows that started together decode in
    lockstep at one position (no attention mask); rows that started at different times each decode at their own.
    A row leaves the batch when it is done, and the last row moves into its place, so the batch is rows 0..n-1.
    use_cache=False recomputes every row's whole sequence at each step: the reference the cache is tested
    against (rows in lockstep only)."""

    def __init__(self, model, max_batch: int, max_len: int | None = None, use_cache: bool = True):
        self.model, self.max_batch = model, max_batch
        self.max_len = max_len or model.config.max_seq_len
        if self.max_len > model.config.max_seq_len:
            raise ValueError(f"{self.max_len} positions (prompt + new tokens) exceed max_seq_len={model.config.max_seq_len}")
        self.device = next(model.parameters()).device
        self.caches = [KVCache(max_batch, self.max_len) for _ in model.layers] if use_cache else None
        self.rows: list[Row] = []  # row i of the caches holds rows[i]
        self.added = 0  # rows added so far: a row's number orders the draws of its Sampling

    @torch.no_grad()
    def add(self, rows: list[Row]):
        """Prefill the rows' prompts, which must have one length, in one forward pass (a prompt that several rows
        share, once), and sample each row's first token."""
        if len(self.rows) + len(rows) > self.max_batch:
            raise ValueError(f"{len(self.rows)} rows + {len(rows)} new ones exceed max_batch={self.max_batch}")
        prompts = list(dict.fromkeys(tuple(row.prompt) for row in rows))  # each distinct prompt once, in order
        T = len(prompts[0])
        for row in rows:
            if len(row.prompt) != T or len(row.prompt) + row.max_new > self.max_len:
                raise ValueError(f"prompts of one length whose max_new tokens fit in {self.max_len} positions: got "
                                 f"a prompt of {len(row.prompt)} tokens (first {T}) and max_new {row.max_new}")
        source = [prompts.index(tuple(row.prompt)) for row in rows]  # each row's prompt in the prefill batch
        ids = to_device(prompts, self.device)  # (p, T)
        if self.caches is None:
            logits, _ = self.model(ids)
        else:
            own = [KVCache(len(prompts), T) for _ in self.caches]
            logits, _ = self.model(ids, caches=own)
            for r, p in enumerate(source):
                for cache, prefilled in zip(self.caches, own):
                    cache.copy_row(len(self.rows) + r, prefilled, p, T)
        for row in rows:
            row.number, self.added = self.added, self.added + 1
        self.rows += rows
        self.sample(rows, logits[source, -1])
        self.drop_done()

    @torch.no_grad()
    def step(self):
        """One token for every row, then the rows that are done leave."""
        if not self.rows:
            return
        positions = [row.cached for row in self.rows]
        tokens = to_device([[row.tokens[-1]] for row in self.rows], self.device)  # (n, 1)
        if self.caches is None:  # the whole sequence again
            logits, _ = self.model(to_device([row.prompt + row.tokens for row in self.rows], self.device))
        elif len(set(positions)) == 1:  # in lockstep: one position, every cached key visible
            logits, _ = self.model(tokens, caches=self.caches, start_pos=positions[0])
        else:  # each row at its own position, against the keys up to the longest row's
            caches = [cache.prefix(max(positions) + 1) for cache in self.caches]
            logits, _ = self.model(tokens, caches=caches, start_pos=to_device(positions, self.device))
        self.sample(self.rows, logits[:, -1])
        self.drop_done()

    def sample(self, rows: list[Row], logits):
        """Each row's next token from its logits (n, V): the rows that share a Sampling in one call, so a sampling
        that fails fails its own rows alone; then one host sync for all the tokens. A Sampling's rows draw in the
        order they were added, not in their batch places (which change as other rows finish): a seeded group of
        rows samples the same tokens whatever else is in the batch."""
        groups: dict[int, list[int]] = {}
        for i in sorted(range(len(rows)), key=lambda i: rows[i].number):
            groups.setdefault(id(rows[i].sampling), []).append(i)
        picked = []  # (row indices, their tokens (k,) on the device)
        for indices in groups.values():
            s = rows[indices[0]].sampling
            try:
                history = ids_so_far([rows[i] for i in indices], self.device) if s.repetition_penalty != 1.0 else None
                picked.append((indices, sample_next(logits[indices], history, s.temperature, s.top_k, s.top_p,
                                                    s.repetition_penalty, s.generator)[:, 0]))
            except Exception as e:  # a server's client may send what fails here: only its rows end
                for i in indices:
                    rows[i].fail(e)
        if not picked:
            return
        tokens = iter(torch.cat([t for _, t in picked]).tolist())  # the step's one host sync
        for indices, _ in picked:
            for i in indices:
                rows[i].append(next(tokens))

    def drop_done(self):
        for i in reversed(range(len(self.rows))):  # rows after i are live by now: the last may move into i
            if self.rows[i].done:
                last = self.rows.pop()
                if i < len(self.rows):
                    if self.caches is not None:
                        for cache in self.caches:
                            cache.copy_row(i, cache, len(self.rows), last.cached)
                    self.rows[i] = last


def to_device(ids: list, device) -> torch.Tensor:
    """A (nested) list of ints as an int64 tensor on device; to a GPU from pinned memory, so that the copy does
    not make the host wait."""
    t = torch.tensor(ids, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def ids_so_far(rows: list[Row], device) -> torch.Tensor:
    """(n, T) prompt and generated ids of each row, shorter ones padded with their own first id (the repetition
    penalty counts an id once however often it appears)."""
    seqs = [row.prompt + row.tokens for row in rows]
    longest = max(map(len, seqs))
    return to_device([[s[0]] * (longest - len(s)) + s for s in seqs], device)


def by_length(rows: list[Row]) -> dict[int, list[Row]]:
    """The rows grouped by prompt length, each group in the rows' order."""
    groups: dict[int, list[Row]] = {}
    for row in rows:
        groups.setdefault(len(row.prompt), []).append(row)
    return groups


def decode_steps(model, rows: list[Row], use_cache: bool = True):
    """Decode rows of any prompt lengths together: one prefill per length (a prompt that several rows share,
    once), then one token a step for every row, each at its own position. Yields the rows after the prefills and
    after every step until all are done; a failed row raises its error. use_cache=False (the reference the cache
    is tested against) recomputes every step and takes prompts of one length."""
    groups = by_length(rows)
    if not use_cache and len(groups) > 1:
        raise ValueError(f"use_cache=False decodes prompts of one length, got lengths {sorted(groups)}")
    engine = Engine(model, len(rows), max(len(row.prompt) + row.max_new for row in rows), use_cache)
    for length in sorted(groups):  # rows sharing a Sampling draw in an order of their own: length, then place
        engine.add(groups[length])
    while True:
        for row in rows:
            if row.error is not None:
                raise row.error
        yield rows
        if not engine.rows:
            return
        engine.step()


def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
             eos_id: int | None = None, use_cache: bool = True):
    """Id lists in, their rows out, streamed (decode_steps): each row's .tokens grows by one a step until it has
    max_new_tokens tokens or ends with eos_id."""
    yield from decode_steps(model, [Row(list(p), max_new_tokens, sampling, eos_id) for p in prompts], use_cache)


def decode(model, rows: list[Row]) -> list[Row]:
    """Rows in (each with its own prompt, max_new, Sampling and eos_id), the same rows out, decoded to their ends
    (decode_steps)."""
    for _ in decode_steps(model, rows):
        pass
    return rows


def complete(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
             batch_size: int = 64) -> list[str]:
    """Id lists in, the text of each completion out (answer_text): at most max_new_tokens, and at most what the
    model's context leaves. Prompts of one length decode together, batch_size at a time, in lockstep (one
    position for every row: no per-row mask)."""
    rows = [Row(list(ids), min(max_new_tokens, model.config.max_seq_len - len(ids)), sampling, tokenizer.eos_id)
            for ids in prompts]
    for group in by_length(rows).values():
        for start in range(0, len(group), batch_size):
            decode(model, group[start : start + batch_size])
    return [answer_text(tokenizer, row) for row in rows]


def answer_text(tokenizer, row: Row) -> str:
    """A finished row's text without its end of turn (eos) and without the template's surrounding spaces."""
    return tokenizer.decode(row.tokens[:-1] if row.finish_reason == "stop" else row.tokens).strip()


# -----------------------------------------------------------------------------
# prompts and text

def prompt_ids(tokenizer, messages: list[dict] | str, system: str | None = None, max_len: int | None = None,
               tools: list | None = None, thinking: bool = False):
    """The ids to generate from: messages in the tokenizer's chat template (with tools offered, and the think
    block opened or closed), ending with its generation prompt (the earliest turns dropped to fit max_len); or a
    text to continue, after <s> (its beginning dropped)."""
    if isinstance(messages, str):
        ids = [tokenizer.bos_id] + tokenizer.encode(messages)
        return ids[-max_len:] if max_len is not None else ids
    ids, _ = encode_chat(tokenizer, messages, system, max_len=max_len, tools=tools, thinking=thinking)
    return ids


class TextStream:
    """A row's token ids -> the text that may be shown so far: never half a multi-byte character (it waits for
    the rest), never the beginning of what may still become a stop string, nor the stop string and what follows.
    strip: a chat answer loses the template's spaces around it. The work per token is bounded: it decodes the ids
    since the last character boundary between tokens (a few), and reads the text near its end."""

    def __init__(self, tokenizer, stop: list[str] = (), strip: bool = True):
        self.tokenizer, self.stop, self.strip = tokenizer, list(stop), strip
        self.borders = [borders(s) for s in self.stop]
        self.reach = max(map(len, self.stop), default=1) - 1  # how far before changed text a stop string may start
        self.tail: list[int] = []  # the ids since the last character boundary between tokens
        self.tail_text = ""  # their text; the `done` characters decoded before them are final
        self.done = 0
        self.lead = 0  # spaces stripped from the text's start
        self.text, self.start = "", 0  # the (stripped) text from position start on: what may still be read
        self.length = 0  # of the whole (stripped) text
        self.pieces: list[str] = []  # the text sent, as add and finish returned it
        self.n_sent = 0
        self.diverged = False  # text already sent has changed since (a cut character sent after waiting)
        self.stopped = False
        self.waited = 0  # tokens held back in a row for an incomplete character; 4 means it never completes

    @property
    def sent(self) -> str:
        """All the text sent so far."""
        return "".join(self.pieces)

    def add(self, token: int) -> str:
        """The next new text after token (maybe ""); sets stopped when a stop string appears."""
        changed = self.extend(token)
        if self.stopped:  # only finish() sends more: what follows the stop string
            return ""
        found = [i for i in (self.find(s, changed) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self.send(self.rstripped(min(found)) if self.strip else min(found))
        self.waited += 1
        if self.text.endswith("\ufffd") and self.waited < 4:  # a cut character: its other (at most 3) bytes come next
            return ""
        self.waited = 0
        held = max([overlap(self.text, s, b) for s, b in zip(self.stop, self.borders)], default=0)
        return self.send(min(self.length - held, self.rstripped(self.length)) if self.strip else self.length - held)

    def finish(self) -> str:
        """The rest of the text, when the answer ends without a stop string."""
        return self.send(self.rstripped(self.length) if self.strip else self.length)

    def extend(self, token: int) -> int:
        """Decode token onto the text; returns the position from which the text changed. The ids before the last
        character boundary between tokens (where the next token decodes alone to the text it adds) are not
        decoded again: UTF-8 decodes the bytes on either side of a character boundary apart."""
        keep_from = max(0, self.done - self.lead - self.reach)  # this step changes nothing before done - lead
        keep_from = keep_from if self.diverged else min(keep_from, self.n_sent)
        if keep_from > self.start:
            self.text, self.start = self.text[keep_from - self.start :], keep_from
        tail = self.tail + [token]
        text = self.tokenizer.decode(tail)
        kept = len(os.path.commonprefix([self.tail_text, text]))  # of any two strings, character by character
        if self.tail and text == self.tail_text + (alone := self.tokenizer.decode([token])):
            self.done, kept, tail, text = self.done + kept, 0, [token], alone  # the text before token is final
        self.tail, self.tail_text = tail, text
        return self.replace(self.done + kept, text[kept:])

    def replace(self, changed: int, new: str) -> int:
        """The decoded text from position changed on is now new: the (stripped) text takes it; returns the
        position in the stripped text from which it changed."""
        if self.strip and changed <= self.lead:  # nothing but spaces before: the stripped text starts in new
            stripped = new.lstrip(" ")
            self.lead, changed, new = changed + len(new) - len(stripped), 0, stripped
        else:
            changed -= self.lead
        if not self.diverged and changed < self.n_sent:
            self.diverged = self.text[changed - self.start : self.n_sent - self.start] != new[: self.n_sent - changed]
        self.text = self.text[: changed - self.start] + new
        self.length = changed + len(new)
        return changed

    def find(self, stop: str, changed: int) -> int:
        """Where stop first occurs in the text (-1: nowhere), knowing that it did not before position changed."""
        if not stop:
            return 0
        i = self.text.find(stop, max(changed - len(stop) + 1 - self.start, 0))
        return i if i < 0 else self.start + i

    def rstripped(self, end: int) -> int:
        """end, less the spaces just before it (looking back no further than the text kept)."""
        return self.start + len(self.text[: end - self.start].rstrip(" "))

    def send(self, end: int) -> str:
        """The text up to end that was not sent yet; nothing once sent text has changed (it cannot be recalled)."""
        if self.diverged or end <= self.n_sent:
            return ""
        new = self.text[self.n_sent - self.start : end - self.start]
        self.pieces.append(new)
        self.n_sent = end
        return new


def borders(s: str) -> list[int]:
    """KMP's table: borders[i] = the length of the longest proper prefix of s[: i + 1] that also ends it."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        k += s[i] == s[k]
        table[i] = k
    return table


def overlap(text: str, stop: str, table: list[int]) -> int:
    """The length of the longest proper prefix of stop that text ends with: KMP over text's last len(stop) - 1
    characters, so linear in len(stop) where trying every prefix would be quadratic."""
    k = 0
    for c in text[max(0, len(text) - len(stop) + 1):]:
        while k and c != stop[k]:
            k = table[k - 1]
        k += c == stop[k]
    return k
