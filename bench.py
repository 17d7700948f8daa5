"""
Measured speed of every stage, through the real code: tokens/s, ms/step, MFU, peak memory and where a step's
time goes for train_pretrain.py, train_sft.py, train_dpo.py and train_grpo.py (each run as it is, on synthetic
data); KV-cache decoding against recomputation; a group of RL completions sampled together against one by one;
tokenisation and batching throughput; a model with experts against the dense one of as many active parameters; SFT
on whole conversations packed into rows against rows padded to the batch's longest, in real (non-pad) tokens/s.

    python bench.py configs/26m.py --mode=train --batch_size=8 --variants "dtype=float32" "dtype=bfloat16"
    python bench.py configs/26m.py --mode=sft --batch_size=8
    python bench.py configs/26m.py --mode=dpo --batch_size=4      # on-the-fly vs precomputed reference
    python bench.py configs/26m.py --mode=lora --batch_size=8     # full fine-tuning vs LoRA, SFT and DPO
    python bench.py configs/26m.py --mode=grpo --batch_size=2 --group_size=8 --max_new_tokens=64  # rollouts
    python bench.py configs/26m.py --mode=generate                 # batch 1 and 8, 256 new tokens
    python bench.py configs/26m.py --mode=data --batch_size=8
    python bench.py configs/26m.py --mode=serve                    # serve.py: 1 client alone, then 8 at once
    python bench.py configs/26m.py --mode=serve --flood=1000       # ... and 8 again beside 1000 idle connections
    python bench.py configs/moe_198m.py --mode=moe --max_seq_len=128 --batch_size=4  # MoE vs dense, in turns
    python bench.py configs/26m.py --mode=pack --batch_size=8 --steps=3   # SFT packed vs padded, lognormal lengths
    python bench.py configs/26m.py --mode=llamacpp   # nanomind's engine vs llama.cpp (float32, Q8_0), 1 and 8 streams

Bench's own keys are those of Bench below; every other --key=value goes to the training script (sft/dpo/grpo: model
keys shape the random-init checkpoint they start from; generate/data: model, batch_size, device, dtype; moe: as
train, with experts; pack: as sft); --help lists both. --variants is the one key that takes several words, a variant
each: a space-separated list of key=value overrides on top of those; each runs in a fresh subprocess, so its peak
memory (CUDA max allocated, or peak RSS on the CPU) is its own. The script runs `steps` warm-up steps, then `steps`
more, each logged (and timed) on its own: tokens/s, ms/step, MFU and the time split are those of the fastest of
them, tokens_per_s_median and mfu_median those of the median one. MFU is against the measured matmul peak of the
run's dtype: peak_repeats measurements before the first variant and after every one, the best of all of them in the
whole bench run. On a shared VM the speed of the same work can move by half from second to second, so the fastest
step against the fastest matmul, both sampled over the same minutes, compares like with like, and the median shows
what a long run sees. other_load is how many cores other processes kept busy meanwhile (from /proc/stat; a VM's
neighbours on the same host do not show in it). The last line of output is one JSON object with every figure
(mode=llamacpp: the line before it; its last line is nanomind's decode speed over llama.cpp's, llamacpp_bench.py).
"""
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import demo_data
import llamacpp_bench
from checkpoint import model_from_checkpoint
from config import DPOConfig, GRPOConfig, PretrainConfig, SFTConfig, help_text, load_config, read_config_file
from data import Loader, PretrainData
from engine import generate, prompt_ids
from errors import ConfigError, cli
from grpo import rollout
from lora import add_lora, trainable_params
from metrics import measure_peak_flops
from model import ModelConfig, Transformer
from runtime import setup, synchronize
from serve_load import Flood, request_seconds, running_server, timed_clients
from synthetic import LENGTHS, Synthetic, write_pretraining_file
from timing import BestPeak, OtherLoad, calls_per_second, fastest_and_median, machine, measured_process, spread
from token_cache import tokenize_file
from tokenizer import DEFAULT_DIR, load_tokenizer


@dataclasses.dataclass
class Bench:
    # --- what to measure
    mode: str = "train"  # train | sft | dpo | lora | grpo | generate | data | serve | moe | pack | llamacpp
    steps: int = 5  # steps 1..N warm up (allocations settle), N+1..2N are timed one by one
    peak_repeats: int = 3  # measure_peak_flops runs before the first variant and after each (unless --peak_flops)
    # --- mode=lora
    lora_rank: int = 8  # the LoRA runs' adapters (their alpha and targets: lora_alpha, lora_targets)
    # --- mode=grpo
    group_repeats: int = 5  # rounds of a group of completions sampled together, then the same number one by one
    # --- mode=generate, mode=serve and mode=llamacpp
    prompt_tokens: int = 64
    new_tokens: int = 256
    # --- mode=serve and mode=llamacpp
    clients: int = 8  # streams at once, against one alone
    # --- mode=serve
    flood: int = 0  # N: each round again with N idle and trickling connections open (half each), and a request's time
    # --- mode=llamacpp
    threads: int = 0  # nanomind's (torch) and llama.cpp's threads alike; 0: torch's default
    # --- mode=serve, mode=moe, mode=pack and mode=llamacpp
    rounds: int = 3  # serve: 1 client, then `clients` (a row each); moe: experts, dense; pack: padded, packed; llamacpp
    # --- mode=sft and mode=pack
    lengths: str = ""  # the conversations' lengths: uniform | lognormal (synthetic.py); "": lognormal for mode=pack
    # --- mode=data
    data_mb: float = 2000.0  # size of the synthetic file to tokenise when no --data_path is given (deleted after)


REPO = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = {"train": ("train_pretrain.py", PretrainConfig), "sft": ("train_sft.py", SFTConfig),
           "dpo": ("train_dpo.py", DPOConfig), "grpo": ("train_grpo.py", GRPOConfig)}  # each mode's script, its keys
DEFAULT_VARIANTS = {"dpo": ["precompute_ref=False", "precompute_ref=True"]}
GENERATE_BATCH_SIZES = (1, 8)
NEVER = 10**9  # an eval/save interval the run never reaches: it evaluates (1 batch) and saves only at the end
USAGE = 'usage: python bench.py [config_file.py] [--key=value ...] [--variants "key=value ..." ...]'


def key(flag: str) -> str:
    return flag[2:].split("=", 1)[0]


def keys(*schemas) -> set[str]:
    return {f.name for schema in schemas for f in dataclasses.fields(schema)}


def stage_script(mode: str) -> tuple:
    """(script, its Config) of the stage a mode runs: lora and pack run SFT; generate, data, serve and moe read
    train_pretrain's keys."""
    return SCRIPTS.get("sft" if mode in ("lora", "pack") else mode, SCRIPTS["train"])


def stage_schemas(mode: str) -> tuple:
    """The dataclasses a mode's flags fill: the stage script's Config and the model's."""
    return stage_script(mode)[1], ModelConfig


def print_help(argv: list[str]):
    """Bench's keys, then those of the stage --mode names (default: train), under bench's own usage line."""
    (bench,) = load_config([a for a in argv if key(a) == "mode"], Bench)
    schemas = stage_schemas(bench.mode)
    script = stage_script(bench.mode)[0]
    keys = help_text((Bench, *schemas), ()).split("\n", 1)[1]  # without its usage line, which knows no variants
    print(f"{USAGE}\nBench's keys, then those of {script} and the model (--mode=sft --help, --mode=dpo --help, "
          f"--mode=grpo --help: theirs); a variant sets the latter.\n{keys}")


def parse_args(argv: list[str]) -> tuple[Bench, list[str], list[str]]:
    """`[config_file] [--key=value ...] [--variants "k=v k=v" ...]` -> (bench settings, the run's flags with
    the config file's settings first, the variants). Every variant's keys are checked here: a typo in the last
    would otherwise stop the bench after the first variants have run."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print_help(argv)
        raise SystemExit(0)
    flags = []
    if argv and not argv[0].startswith("--"):
        flags = [f"--{k}={v!r}" for k, v in read_config_file(argv.pop(0)).items()]  # parse_flag_value reads repr
    variants = []
    if "--variants" in argv:
        i = end = argv.index("--variants")
        while end + 1 < len(argv) and not argv[end + 1].startswith("--"):
            end += 1
        variants, argv = argv[i + 1 : end + 1], argv[:i] + argv[end + 1 :]
    (bench,) = load_config([a for a in argv if key(a) in keys(Bench)], Bench)
    if bench.mode not in (*SCRIPTS, "lora", "generate", "data", "serve", "moe", "pack", "llamacpp"):
        raise ConfigError(f"mode must be train, sft, dpo, lora, grpo, generate, data, serve, moe, pack or llamacpp, "
                          f"got {bench.mode!r}")
    bench = dataclasses.replace(bench, lengths=bench.lengths or ("lognormal" if bench.mode == "pack" else "uniform"))
    if bench.lengths not in LENGTHS:
        raise ConfigError(f"lengths must be {' or '.join(LENGTHS)}, got {bench.lengths!r}")
    flags += [a for a in argv if key(a) not in keys(Bench)]
    variants = variants or DEFAULT_VARIANTS.get(bench.mode, [""])
    for variant in variants:
        _, model_cfg = resolve(bench.mode, flags + variant_flags(variant))
        if bench.mode == "moe" and not model_cfg.n_experts:
            raise ConfigError(f"mode=moe needs a model with experts (n_experts > 0, e.g. configs/moe_198m.py), "
                              f"got n_experts=0{f' in variant {variant!r}' if variant else ''}")
    return bench, flags, variants


def variant_flags(variant: str) -> list[str]:
    return [f"--{kv}" for kv in variant.split()]


def resolve(mode: str, flags: list[str]):
    """(script config, model config) the flags give; an unknown key is an error that names it."""
    schema = stage_schemas(mode)[0]
    if mode not in ("sft", "dpo", "lora", "grpo", "pack"):
        return load_config(flags, schema, ModelConfig)
    unknown = {key(f) for f in flags} - keys(schema, ModelConfig)
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)} for {stage_script(mode)[0]} or ModelConfig")
    return (load_config([f for f in flags if key(f) in keys(schema)], schema)[0],
            load_config([f for f in flags if key(f) in keys(ModelConfig)], ModelConfig)[0])


def timed_steps(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> tuple[list, dict]:
    """One variant of train/sft/dpo/grpo: synthetic data (and a random-init checkpoint, tmp/init.pt, to start
    from), the script as a subprocess -> (the timed steps as (metrics row, the step's seconds), the device, dtype
    and matmul peak the script logged MFU against)."""
    mode, given = bench.mode, {key(f) for f in flags}
    cfg, model_cfg = resolve(mode, flags)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    peak = cfg.peak_flops or peak_of(run.device, run.dtype, again=False)  # for the script's own MFU column
    n_items = (2 * bench.steps + 1) * cfg.batch_size * cfg.accum_steps  # no epoch ends (and evaluates) in the run
    script, schema = SCRIPTS[mode]
    args = [f for f in flags if key(f) in keys(schema) or mode == "train"]  # a copy: mode=moe reuses flags each round
    if "data_path" not in given:
        synth.rng.seed(cfg.seed)  # every variant or run of one mode trains on the same conversations (lengths)
        for split, n in (("train", n_items), ("val", cfg.batch_size)):
            demo_data.write_jsonl(f"{tmp}/{split}.jsonl", synth.stage_data(mode, cfg, model_cfg, n, bench.lengths))
        args += [f"--data_path={tmp}/train.jsonl", f"--val_data_path={tmp}/val.jsonl"]
    if mode != "train" and "init_from" not in given:  # random weights train as fast as pretrained ones
        # the tokenizer the synthetic data were sized with (a checkpoint that names none is of nanomind's)
        torch.save({"model": Transformer(model_cfg).state_dict(), "model_config": dataclasses.asdict(model_cfg),
                    "config": {"tokenizer_path": cfg.tokenizer_path or str(DEFAULT_DIR)}}, f"{tmp}/init.pt")
        args.append(f"--init_from={tmp}/init.pt")
    n = bench.steps
    args += [f"--out_dir={tmp}/out", f"--max_steps={2 * n}", "--log_interval=1", f"--eval_interval={NEVER}",
             "--eval_steps=1", f"--save_interval={NEVER}", "--keep_checkpoints=1", f"--peak_flops={peak!r}"]
    with open(f"{tmp}/log.txt", "w") as log:
        done = subprocess.run([sys.executable, script, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        with open(f"{tmp}/log.txt") as log:
            raise RuntimeError(f"{script} {' '.join(args)} failed:\n"
                               + "".join(log.readlines()[-30:]))
    if not cfg.peak_flops:  # sample the peak again after the steps: main() takes the best of all samples
        peak_of(run.device, run.dtype)
    with open(f"{tmp}/out/metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    rows = [row for row in logged if "tokens_per_s" in row]  # one per step
    evaluations = [row["step"] for row in logged if "tokens_per_s" not in row and "layer_grad_norms" not in row]
    if any(n <= step < 2 * n for step in evaluations):  # an epoch ended: the next step's interval holds the evaluation
        raise RuntimeError(f"{script} evaluated after step(s) {evaluations} (an epoch ended) "
                           f"while steps {n + 1}..{2 * n} were timed: give it more data or fewer --steps")
    # a step's own interval: nothing but the step and its log line ran between two rows
    seconds = [row["elapsed_s"] - before["elapsed_s"] for before, row in zip(rows[n - 1 :], rows[n:])]
    return list(zip(rows[n:], seconds)), {"device": str(run.device), "dtype": run.dtype, "peak_flops": peak,
                                          "peak_measured": not cfg.peak_flops}


def run_stage(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """One variant of train/sft/dpo: tokens/s, ms/step, MFU and time split of the fastest and the median step; where
    the script logs its padding, real tokens/s too (real_tokens)."""
    steps, measured_on = timed_steps(bench, flags, tmp, synth, peak_of)
    (fastest, fastest_s), (median, _) = fastest_and_median(steps, lambda step: step[0]["tokens_per_s"])
    return [{"tokens_per_s": fastest["tokens_per_s"], "tokens_per_s_median": median["tokens_per_s"],
             "ms_per_step": 1000 * fastest_s, "tokens_per_step": fastest["tokens_per_s"] * fastest_s,
             "mfu": fastest["mfu"], "mfu_median": median["mfu"], "mem_gb": steps[-1][0]["mem_gb"],
             **{k: v for k, v in fastest.items() if k.startswith("frac_")}, **real_tokens(steps), **measured_on}]


def real_tokens(steps: list) -> dict:
    """From the timed steps' pad_frac (the share of the input tokens fed that are padding): real_tokens_per_s of the
    fastest and the median step by it (tokens_per_s x (1 - pad_frac): what padding wastes and packing recovers),
    pad_frac of all their input tokens together and the real tokens a step fed (their mean). Nothing where the log
    has no pad_frac."""
    if any("pad_frac" not in row for row, _ in steps):
        return {}

    def real(step) -> float:
        return step[0]["tokens_per_s"] * (1 - step[0]["pad_frac"])

    fastest, median = fastest_and_median(steps, real)
    fed = [row["tokens_per_s"] * seconds for row, seconds in steps]  # each step's input tokens
    real_fed = [n * (1 - row["pad_frac"]) for n, (row, _) in zip(fed, steps)]
    return {"real_tokens_per_s": real(fastest), "real_tokens_per_s_median": real(median),
            "pad_frac": 1 - sum(real_fed) / sum(fed), "real_tokens_per_step": statistics.mean(real_fed)}


def run_lora(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """Full fine-tuning against LoRA of rank lora_rank, each through run_stage: SFT, then DPO (half the batch_size
    in pairs: as many sequences) with the reference a second model and with the adapters switched off. Each row
    adds the run's trainable parameters."""
    cfg, model_cfg = resolve("sft", flags)
    model = Transformer(model_cfg)
    model.tok_embeddings.weight.requires_grad_(not cfg.freeze_embeddings)
    full = trainable_params(model)
    adapters = trainable_params(add_lora(model, bench.lora_rank, cfg.lora_alpha, 0.0, cfg.lora_targets.split(",")))
    lora, pairs = [f"--lora_rank={bench.lora_rank}"], [f"--batch_size={max(1, cfg.batch_size // 2)}"]
    runs = [("sft", "full", []), ("sft", "LoRA", lora), ("dpo", "full, reference model", pairs),
            ("dpo", "LoRA, reference model", [*pairs, *lora, f"--ref_from={tmp}/3/init.pt"]),  # run_stage writes it
            ("dpo", "LoRA, adapters-off reference", [*pairs, *lora])]
    rows = []
    for i, (mode, name, extra) in enumerate(runs):
        os.makedirs(f"{tmp}/{i}")
        print(f"  {mode} {name} ...", file=sys.stderr, flush=True)
        (row,) = run_stage(dataclasses.replace(bench, mode=mode), flags + extra, f"{tmp}/{i}", synth, peak_of)
        rows.append({"run": f"{mode} {name}", "trainable_params": adapters if lora[0] in extra else full, **row})
    return rows


def run_grpo(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """train_grpo.py on sums to work out (reward=answer: random weights mostly score 0, and sample as fast as trained
    ones; they rarely sample eos, so completions take all max_new_tokens): rollout tokens/s (the completion tokens a
    step sampled per second of its rollout phase), ms/step and the step's split into rollout, reward and update
    (forward, backward, optimizer) of the fastest and the median step by rollout tokens/s; then group_rollouts on
    the model the run started from."""
    cfg, _ = resolve("grpo", flags)
    steps, _ = timed_steps(bench, flags, tmp, synth, peak_of)
    completions = cfg.batch_size * cfg.accum_steps * cfg.group_size

    def rollout_speed(step) -> float:  # frac_rollout: the rollout's share of the phases, all of a step but its log
        row, seconds = step
        return completions * row["completion_len"] / (row["frac_rollout"] * seconds)

    fastest, median = fastest_and_median(steps, rollout_speed)
    row, seconds = fastest
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    init = cfg.init_from if "init_from" in {key(f) for f in flags} else f"{tmp}/init.pt"
    model = model_from_checkpoint(init, run.device, flash=cfg.flash)[0].eval()
    prompt = prompt_ids(synth.tok, synth.sum_prompt()["conversations"])
    return [{"rollout_tokens_per_s": rollout_speed(fastest), "rollout_tokens_per_s_median": rollout_speed(median),
             "ms_per_step": 1000 * seconds, "completion_len": row["completion_len"],
             "frac_rollout": row["frac_rollout"], "frac_reward": row["frac_reward"],
             "frac_update": row["frac_forward"] + row["frac_backward"] + row["frac_optimizer"],
             "mem_gb": steps[-1][0]["mem_gb"], **group_rollouts(model, prompt, cfg, run, bench.group_repeats)}]


def timed_rollouts(model, prompt: list[int], group_size: int, calls: int, new_tokens: int, cfg, run) -> tuple:
    """(seconds, completion tokens) of `calls` grpo.rollout calls on one prompt, group_size completions each (decoded
    together). No eos: every completion samples all new_tokens, so any split of a group samples as many."""
    synchronize(run.device)
    t0, tokens = time.perf_counter(), 0
    with run.autocast():
        for seed in range(calls):
            rows = rollout(model, [prompt], [seed], group_size, new_tokens, None, cfg.temperature, cfg.top_p)
            tokens += sum(len(row.tokens) for row in rows)
    synchronize(run.device)
    return time.perf_counter() - t0, tokens


def group_rollouts(model, prompt: list[int], cfg, run, rounds: int) -> dict:
    """group_size completions of one prompt sampled together (one rollout, as train_grpo.py samples them) against
    one by one (group_size rollouts of one), max_new_tokens each, in turns -- together, one by one, together, ...
    -- so that the machine's changing load hits both alike: the tokens each way samples, each way's median tokens/s,
    and the min, median and max over the rounds of the ratio together / one by one."""
    ways = {"group": (cfg.group_size, 1), "one_by_one": (1, cfg.group_size)}  # (group_size, calls)
    for size, calls in ways.values():  # warm-up: first-call allocations and kernel choices
        timed_rollouts(model, prompt, size, calls, min(8, cfg.max_new_tokens), cfg, run)
    timed = [{way: timed_rollouts(model, prompt, *ways[way], cfg.max_new_tokens, cfg, run) for way in ways}
             for _ in range(rounds)]  # [{way: (seconds, tokens)}] round by round
    speeds = {way: [tokens / seconds for seconds, tokens in (t[way] for t in timed)] for way in ways}
    return {"group_tokens": timed[0]["group"][1], "one_by_one_tokens": timed[0]["one_by_one"][1],
            "group_tokens_per_s": statistics.median(speeds["group"]),
            "one_by_one_tokens_per_s": statistics.median(speeds["one_by_one"]),
            **spread("group_speedup", (g / alone for g, alone in zip(speeds["group"], speeds["one_by_one"])))}


def timed_generation(model, prompt, new_tokens: int, use_cache: bool, run) -> tuple[float, float]:
    """(prefill seconds: the prompt's forward and the first token, decode seconds: the other new_tokens - 1)."""
    stream = generate(model, prompt.tolist(), new_tokens, use_cache=use_cache)  # greedy
    with run.autocast():
        synchronize(run.device)  # clocks read after the device has finished, not when its work was queued
        t0 = time.perf_counter()
        next(stream)
        synchronize(run.device)
        t1 = time.perf_counter()
        for _ in stream:
            pass
        synchronize(run.device)
    return t1 - t0, time.perf_counter() - t1


def run_generate(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """Prefill and decode tokens/s of a random-init model with the KV cache and with recomputation."""
    cfg, model_cfg = resolve("generate", flags)
    run = setup(cfg.device, cfg.dtype, cfg.seed)
    model = Transformer(model_cfg).to(run.device).eval()
    rows = []
    for B in GENERATE_BATCH_SIZES:
        prompt = torch.randint(model_cfg.vocab_size, (B, bench.prompt_tokens), device=run.device)
        timed_generation(model, prompt, 8, True, run)  # warm-up: first-call allocations and kernel choices
        prefill, cached = timed_generation(model, prompt, bench.new_tokens, True, run)
        prefill_again, recomputed = timed_generation(model, prompt, bench.new_tokens, False, run)
        decoded = B * (bench.new_tokens - 1)
        rows.append({"batch_size": B, "prefill_tokens_per_s": B * bench.prompt_tokens / min(prefill, prefill_again),
                     "decode_tokens_per_s_cache": decoded / cached,
                     "decode_tokens_per_s_recompute": decoded / recomputed,
                     "cache_speedup": recomputed / cached, "dtype": run.dtype})
    return rows


TOKENISE = """import json, resource, sys, time
from token_cache import tokenize_file
from tokenizer import load_tokenizer
path, tokenizer_path, processes = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
tokenizer = load_tokenizer(tokenizer_path)
t0 = time.perf_counter()
tokenize_file(path, tokenizer, "pretrain", processes=processes, verbose=False)
own, workers = (resource.getrusage(who).ru_maxrss * 1024 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"seconds": time.perf_counter() - t0, "maxrss": own + processes * workers}))
"""


def timed_tokenisation(path: str, tokenizer_path: str | None, processes: int, tmp: str) -> tuple[float, float]:
    """(seconds, peak resident bytes of the process tree) of data.tokenize_file in a fresh process: its peak is
    its own. The tree's RSS is sampled every 50 ms; without /proc, the process's and its workers' maxima."""
    measured, peak = measured_process([sys.executable, "-c", TOKENISE, path, tokenizer_path or "", str(processes)],
                                      REPO, f"{tmp}/tokenise.out", f"tokenising {path}")
    return measured["seconds"], peak or measured["maxrss"]


def run_data(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """Tokenisation MB/s and peak memory of data.tokenize_file with 1 and 2 processes, each from scratch in a
    subprocess, on a generated file of data_mb (deleted with tmp); then Loader.next_batch() calls per second
    from the memory-mapped cache."""
    cfg, model_cfg = resolve("data", flags)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    if "data_path" in {key(f) for f in flags}:  # a link in tmp: the cache is written beside it, not the file
        path = os.path.join(tmp, os.path.basename(cfg.data_path))
        os.symlink(os.path.abspath(cfg.data_path), path)
    else:
        path = f"{tmp}/tokenise.jsonl"
        write_pretraining_file(path, bench.data_mb, synth.rng)
    size_mb, row = os.path.getsize(path) / 1e6, {}
    for processes in (1, 2):
        if os.path.exists(f"{path}.pretrain.cache"):
            os.remove(f"{path}.pretrain.cache")
        seconds, peak = timed_tokenisation(path, cfg.tokenizer_path, processes, tmp)
        row[f"tokenise_mb_per_s_{processes}proc"] = size_mb / seconds
        row[f"tokenise_peak_gb_{processes}proc"] = peak / 1e9
    records = tokenize_file(path, tokenizer, "pretrain", verbose=False)  # the cache the last run wrote
    loader = Loader(PretrainData(records, model_cfg.max_seq_len), cfg.batch_size, tokenizer.pad_id,
                    setup(cfg.device, cfg.dtype, cfg.seed).device)
    batches_per_s = calls_per_second(loader.next_batch, min_calls=10, min_seconds=2.0)
    return [{"file_mb": size_mb, "tokens": sum(len(s) for s in records.token_spans()), **row,
             "loader_batches_per_s": batches_per_s,
             "loader_tokens_per_s": batches_per_s * cfg.batch_size * model_cfg.max_seq_len}]


def run_serve(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """serve.py with a random-init model, driven over HTTP by streaming clients: greedy continuations of
    prompt_tokens-token prompts, new_tokens each. Each round times one client alone, then `clients` at once
    (decoded in one batch); ratio = their aggregate tokens/s over the lone client's."""
    cfg, model_cfg = resolve("serve", flags)
    torch.manual_seed(cfg.seed)
    torch.save({"model": Transformer(model_cfg).state_dict(), "model_config": dataclasses.asdict(model_cfg),
                "config": {"tokenizer_path": cfg.tokenizer_path}, "stage": "sft"}, f"{tmp}/init.pt")
    device = setup(cfg.device, cfg.dtype, cfg.seed).device
    with running_server(f"{tmp}/init.pt", f"--device={device}", f"--max_batch={bench.clients}") as url:
        prompts = [synth.text(bench.prompt_tokens) for _ in range(bench.clients)]
        timed_clients(url, prompts[:1], 8)  # warm-up: first-call allocations and kernel choices
        rows = []
        for r in range(bench.rounds):
            alone = timed_clients(url, prompts[r % len(prompts):][:1], bench.new_tokens)
            together = timed_clients(url, prompts, bench.new_tokens)
            rows.append({"round": r + 1, "clients": bench.clients, "tokens_per_s_alone": alone,
                         "tokens_per_s_together": together, "ratio": together / alone})
            if bench.flood:
                with Flood(url, bench.flood) as flood:
                    time.sleep(1.0)  # the trickle has begun
                    rows[-1]["tokens_per_s_flooded"] = timed_clients(url, prompts, bench.new_tokens)
                    rows[-1]["request_s_flooded"] = request_seconds(url)  # the streams done, the flood still on
                    rows[-1]["reopened"] = flood.reopened
    return rows


def dense_counterpart(model_cfg: ModelConfig) -> list[str]:
    """The flags that make a model with experts dense with as many active parameters (the router's aside): one
    SwiGLU as wide as a token's experts together, everything else equal."""
    return ["--n_experts=0", f"--ffn_dim={model_cfg.experts_per_token * model_cfg.moe_ffn_dim}"]


def run_moe(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """train_pretrain.py with the model with experts and with its dense counterpart, each through run_stage, in
    turns (MoE, dense, MoE, ...) for `rounds` rounds, so that the machine's changing load hits both alike. A row per
    model: its parameters (all, and those one token uses), its fastest step of all rounds (tokens/s, ms/step, MFU,
    time split), the median of its rounds' median steps, its largest peak memory, and each round's ratio of its
    fastest step to the dense model's (vs_dense: the median, min and max over the rounds) and of the peak memories."""
    models = {"moe": flags, "dense": flags + dense_counterpart(resolve("train", flags)[1])}
    rounds = in_turns(bench, "train", models, tmp, synth, peak_of)
    rows, dense_mem = [], max(measured["dense"]["mem_gb"] for measured in rounds)
    for name, model_flags in models.items():
        runs = [measured[name] for measured in rounds]
        fastest = max(runs, key=lambda row: row["tokens_per_s"])
        median, mem = statistics.median(row["tokens_per_s_median"] for row in runs), max(row["mem_gb"] for row in runs)
        with torch.device("meta"):  # shapes only, no memory
            model = Transformer(resolve("train", model_flags)[1])
        rows.append({"model": name, "params": model.num_params(), "active_params": model.num_params(active=True),
                     "tokens_per_s": fastest["tokens_per_s"], "tokens_per_s_median": median,
                     "ms_per_step": fastest["ms_per_step"], "mem_gb": mem, "mem_vs_dense": mem / dense_mem,
                     # MFU is tokens/s times a constant (one model, one peak): the median's against the fastest's peak
                     "mfu": fastest["mfu"], "mfu_median": fastest["mfu"] * median / fastest["tokens_per_s"],
                     **spread("vs_dense", (m[name]["tokens_per_s"] / m["dense"]["tokens_per_s"] for m in rounds)),
                     **{k: v for k, v in fastest.items() if k.startswith("frac_")},
                     **{k: fastest[k] for k in ("device", "dtype", "peak_flops", "peak_measured")}})
    return rows


def in_turns(bench: Bench, mode: str, runs: dict[str, list[str]], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """Each of runs (name -> flags) through run_stage as mode, in turns, for bench.rounds rounds: a dict per round,
    name -> its row."""
    rounds = []
    for r in range(bench.rounds):
        rounds.append({})
        for name, run_flags in runs.items():
            os.makedirs(run_dir := f"{tmp}/{r}_{name}")
            print(f"  round {r + 1} {name} ...", file=sys.stderr, flush=True)
            (rounds[-1][name],) = run_stage(dataclasses.replace(bench, mode=mode), run_flags, run_dir, synth, peak_of)
    return rounds


def run_pack(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """train_sft.py on one file of conversations (of bench.lengths), with rows padded to the batch's longest
    (pack=False) and with rows of max_seq_len packed with whole conversations (pack=True), each through run_stage,
    in turns (padded, packed, padded, ...) for `rounds` rounds, so that the machine's changing load hits both alike;
    batch_size counts conversations in the one and rows in the other. A row per way: tokens/s fed (padding included)
    and real tokens/s of its median step (the median over the rounds) and of its fastest of all rounds, its padding
    fraction, the real tokens a step fed, and each round's ratio of its median real tokens/s to the padded run's
    (vs_padded: the median, min and max over the rounds)."""
    ways = {"padded": flags + ["--pack=False"], "packed": flags + ["--pack=True"]}
    rounds = in_turns(bench, "sft", ways, tmp, synth, peak_of)
    if "pad_frac" not in rounds[0]["padded"]:
        raise RuntimeError("train_sft.py logged no pad_frac: mode=pack needs metrics rows with it")
    rows = []
    for name in ways:
        runs = [measured[name] for measured in rounds]
        rows.append({"way": name, **{k: statistics.median(row[k] for row in runs) for k in (
                         "tokens_per_s_median", "real_tokens_per_s_median", "pad_frac", "real_tokens_per_step")},
                     "real_tokens_per_s": max(row["real_tokens_per_s"] for row in runs),
                     "mem_gb": max(row["mem_gb"] for row in runs),
                     **spread("vs_padded", (m[name]["real_tokens_per_s_median"]
                                            / m["padded"]["real_tokens_per_s_median"] for m in rounds)),
                     "device": runs[0]["device"], "dtype": runs[0]["dtype"]})
    return rows


def run_llamacpp(bench: Bench, flags: list[str], tmp: str, synth: Synthetic, peak_of) -> list[dict]:
    """nanomind's engine against llama.cpp on a random-init model of the config's shape (llamacpp_bench.py)."""
    return llamacpp_bench.compare(bench, *resolve("llamacpp", flags), tmp)


RUNNERS = {"train": run_stage, "sft": run_stage, "dpo": run_stage, "lora": run_lora, "grpo": run_grpo,
           "generate": run_generate, "data": run_data, "serve": run_serve, "moe": run_moe, "pack": run_pack,
           "llamacpp": run_llamacpp}
STAGE_COLUMNS = {"tokens_per_s": "{:.0f}", "tokens_per_s_median": "{:.0f}", "ms_per_step": "{:.0f}",
                 "mfu": "{:.2%}", "mfu_median": "{:.2%}", "mem_gb": "{:.2f}",
                 "frac_data": "{:.1%}", "frac_forward": "{:.1%}", "frac_backward": "{:.1%}", "frac_optimizer": "{:.1%}"}
REAL_COLUMNS = {"real_tokens_per_s": "{:.0f}", "real_tokens_per_s_median": "{:.0f}", "pad_frac": "{:.1%}"}
# each mode's table: column -> format (main puts variant before them and other_load after; "-" where a row has none)
COLUMNS = {"train": STAGE_COLUMNS, "sft": {**STAGE_COLUMNS, **REAL_COLUMNS}, "dpo": STAGE_COLUMNS,
           "pack": {"way": "{}", "tokens_per_s_median": "{:.0f}", **REAL_COLUMNS,
                    "real_tokens_per_step": "{:.0f}", "mem_gb": "{:.2f}", "vs_padded": "{:.2f}x",
                    "vs_padded_min": "{:.2f}x", "vs_padded_max": "{:.2f}x"},
           "lora": {"run": "{}", "trainable_params": "{:,}", "tokens_per_s": "{:.0f}", "tokens_per_s_median": "{:.0f}",
                    "ms_per_step": "{:.0f}", "mem_gb": "{:.2f}"},
           "grpo": {"rollout_tokens_per_s": "{:.0f}", "rollout_tokens_per_s_median": "{:.0f}", "ms_per_step": "{:.0f}",
                    "completion_len": "{:.0f}", "frac_rollout": "{:.1%}", "frac_reward": "{:.1%}",
                    "frac_update": "{:.1%}", "mem_gb": "{:.2f}", "group_tokens_per_s": "{:.0f}",
                    "one_by_one_tokens_per_s": "{:.0f}", "group_speedup": "{:.2f}x", "group_speedup_min": "{:.2f}x",
                    "group_speedup_max": "{:.2f}x"},
           "generate": {"batch_size": "{}", "prefill_tokens_per_s": "{:.0f}", "decode_tokens_per_s_cache": "{:.1f}",
                        "decode_tokens_per_s_recompute": "{:.1f}", "cache_speedup": "{:.1f}x"},
           "moe": {"model": "{}", "params": "{:,}", "active_params": "{:,}", "tokens_per_s": "{:.0f}",
                   "tokens_per_s_median": "{:.0f}", "ms_per_step": "{:.0f}", "mfu": "{:.2%}", "mfu_median": "{:.2%}",
                   "mem_gb": "{:.2f}", "vs_dense": "{:.2f}x", "vs_dense_min": "{:.2f}x", "vs_dense_max": "{:.2f}x",
                   "mem_vs_dense": "{:.2f}x", "frac_forward": "{:.1%}", "frac_backward": "{:.1%}",
                   "frac_optimizer": "{:.1%}"},
           "serve": {"round": "{}", "clients": "{}", "tokens_per_s_alone": "{:.1f}", "tokens_per_s_together": "{:.1f}",
                     "ratio": "{:.2f}x", "tokens_per_s_flooded": "{:.1f}", "request_s_flooded": "{:.3f}",
                     "reopened": "{}"},
           "data": {"file_mb": "{:.1f}", "tokens": "{:.3g}", "tokenise_mb_per_s_1proc": "{:.2f}",
                    "tokenise_peak_gb_1proc": "{:.2f}", "tokenise_mb_per_s_2proc": "{:.2f}",
                    "tokenise_peak_gb_2proc": "{:.2f}", "loader_batches_per_s": "{:.0f}",
                    "loader_tokens_per_s": "{:.3g}"},
           "llamacpp": llamacpp_bench.COLUMNS}


def main(argv: list[str]) -> dict:
    bench, flags, variants = parse_args(argv)
    info = machine()
    print(f"cpu {info['cpu']} ({info['cores']} cores, {' '.join(info['cpu_flags'])}), gpu {info['cuda']}, "
          f"torch {info['torch']} ({info['threads']} threads)")
    peak_of = BestPeak(measure_peak_flops, bench.peak_repeats)
    synth = Synthetic(load_tokenizer(resolve(bench.mode, flags)[0].tokenizer_path))
    rows = []
    for variant in variants:
        print(f"{bench.mode} {variant or 'base'} ...", file=sys.stderr, flush=True)
        with OtherLoad() as load, tempfile.TemporaryDirectory(prefix="bench_") as tmp:
            measured = RUNNERS[bench.mode](bench, flags + variant_flags(variant), tmp, synth, peak_of)
        rows += [{"variant": variant or "base", **row, "other_load": load.cores} for row in measured]
    for row in rows:  # every measured MFU against the best peak of the whole run
        if row.get("peak_measured"):
            best = peak_of.best[f"{row['device']}/{row['dtype']}"]
            scale = row["peak_flops"] / best  # the script logged MFU against the best peak at its start
            row["mfu"], row["mfu_median"], row["peak_flops"] = row["mfu"] * scale, row["mfu_median"] * scale, best
    columns = {"variant": "{}", **COLUMNS[bench.mode], "other_load": "{:.2f}"}
    cells = [list(columns)] + [[fmt.format(row[k]) if k in row else "-" for k, fmt in columns.items()] for row in rows]
    for line in cells:
        print("  ".join(c.rjust(max(len(r[i]) for r in cells)) for i, c in enumerate(line)))
    result = {"mode": bench.mode, "argv": list(argv), "machine": info, "rows": rows, "peak_flops": peak_of.best}
    if any(row["other_load"] > 0.2 for row in rows):
        print("warning: other processes used the CPU during the run (other_load): the figures may be low")
    print(json.dumps(result))
    if bench.mode == "llamacpp":
        print(llamacpp_bench.summary(rows))
    return result


if __name__ == "__main__":
    cli(main)
