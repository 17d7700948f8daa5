"""
Hyperparameter search over a training script's keys: grid or seeded random search, optionally with successive
halving, each trial a short run of the real script.

    python sweep.py configs/demo.py --lr=3e-4:3e-2:log --trials=9 --halving=True --min_steps=50 --max_steps=450
    python sweep.py configs/demo.py --search=grid --lr=1e-3,3e-3,1e-2 --warmup_steps=0,30 --max_steps=300
    python sweep.py configs/demo_sft.py --script=train_sft.py --lr=1e-4:1e-2:log --optimizer=adamw,muon
    python sweep.py --help                         # sweep's keys, then the script's (with --script=...: that one's)

A flag's value says what is searched: `a,b,c` or `a|b|c` lists values (grid: every combination, in the order
given, the first key slowest; random: choices), `low:high` is a uniform range and `low:high:log` a log-uniform
one (random search only; an int key draws ints), anything else is fixed for every trial. A key whose value is
itself a comma list (data_path, lora_targets, reward, tools) keeps its commas: list its values with | (quoted in a
shell). The keys and the values' types are checked against the script's config dataclasses before anything runs (a
script of your own checks its own); a value that breaks one of the script's rules (optimizer=sgd) fails its trials.

Every trial runs `python SCRIPT CONFIG --fixed... --values... --max_steps=... --out_dir=OUT/trials/ID` from the
current directory, its console in stdout.txt and stderr.txt beside its metrics.jsonl. Its metric is the last row of
that metrics.jsonl holding the metric's key: for val_loss, the evaluation every training script makes at its last
step, i.e. the model the run ends with (a short run usually evaluates only there). A trial that exits non-zero, or
whose metric is missing or not finite, is failed (with its stderr's last line); the sweep goes on.

Successive halving (--halving=True): every trial runs min_steps; the best 1/eta of a rung by the metric (at least
one) run eta times as many steps, and so on; the last rung runs max_steps (the config's or the flag's). A continued
trial reruns from step 0 in a fresh out_dir: its learning-rate schedule spans its own budget (a resumed short run's
cosine would already have decayed). Each rung costs about trials x min_steps steps: with three rungs and eta 3, a
third of running every trial for max_steps.

OUT/results.jsonl is the record, a row per trial appended as it ends. A trial is identified by everything it runs
with (the script, the config file's keys, the flags, its values and max_steps): running a sweep again skips the
trials recorded there, the failed ones too (delete a row to run that trial again), so an interrupted sweep goes on
where it stopped. At the end: the ranking on the console (trials of the last rung first), OUT/best_config.py (the
config file's keys with the best trial's values and max_steps: `python SCRIPT OUT/best_config.py` trains it) and
OUT/sweep.png (the metric against each searched key). With several GPUs trials run at once, one per GPU
(CUDA_VISIBLE_DEVICES); otherwise one after another.
"""
import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import types

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from config import (DistillConfig, DPOConfig, GRPOConfig, PretrainConfig, RewardConfig, SFTConfig,  # noqa: E402
                    check_type, help_text, load_config, parse_flag_value, read_config_file)
from errors import ConfigError, UserError, cli  # noqa: E402
from fileio import atomic_write  # noqa: E402
from metrics import read_metrics  # noqa: E402
from model import ModelConfig  # noqa: E402


@dataclasses.dataclass
class Sweep:
    # --- I/O
    out_dir: str = "out/sweep"  # results.jsonl, best_config.py, sweep.png, and trials/<id>/ (each trial's out_dir)
    script: str = "train_pretrain.py"  # the training script every trial runs
    # --- search
    search: str = "random"  # grid: every combination of the listed values | random: `trials` seeded samples
    trials: int = 20  # random search: configurations drawn (with halving: those of the first rung)
    sweep_seed: int = 0  # random search's own generator (--seed is the training script's)
    metric: str = "val_loss"  # the key read from each trial's metrics.jsonl (its last row holding it)
    maximize: bool = False  # a higher metric is better
    # --- successive halving
    halving: bool = False  # the best 1/eta of each rung continue with eta times the steps, up to max_steps
    min_steps: int = 100  # the first rung's max_steps
    eta: int = 3


REPO = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = {"train_pretrain.py": (PretrainConfig, ModelConfig), "train_distill.py": (DistillConfig, ModelConfig),
           "train_sft.py": (SFTConfig,), "train_dpo.py": (DPOConfig,), "train_reward.py": (RewardConfig,),
           "train_grpo.py": (GRPOConfig,)}  # the dataclasses each of nanomind's scripts passes to load_config
COMMA_KEYS = {"data_path", "val_data_path", "lora_targets", "reward", "tools"}  # values that are comma lists
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
USAGE = "usage: python sweep.py [config_file.py] [--key=value ...] [--key=a,b,c | --key=low:high[:log] ...]"


@dataclasses.dataclass(frozen=True)
class Range:
    """A random search's interval of one key: uniform, or uniform in log(value); ints for an int key."""
    low: float
    high: float
    log: bool
    ints: bool

    def sample(self, rng: random.Random):
        if self.ints:  # high + 1: every int of [low, high] gets its share, high's too
            lo, hi = (math.log(self.low), math.log(self.high + 1)) if self.log else (self.low, self.high + 1)
            x = rng.uniform(lo, hi)
            return min(int(math.exp(x) if self.log else math.floor(x)), int(self.high))
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)


@dataclasses.dataclass
class Plan:
    """What a sweep runs: its own settings, the script with its config file and fixed flags, the searched keys."""
    sweep: Sweep
    script: str
    config_path: str | None
    fixed: dict  # key -> value, the same for every trial (the config file's keys are read by the script)
    space: dict  # key -> a list of values or a Range, in the order of the flags
    settings: dict  # the config file's keys with the fixed flags applied
    budgets: list  # max_steps of each rung; [None] without halving when max_steps is the script's business


@dataclasses.dataclass
class Trial:
    values: dict  # the searched keys' values
    max_steps: int | None  # the rung's budget, else the config's or the flag's; None: the script's default
    rung: int
    id: str


# -----------------------------------------------------------------------------
# the command line

def key_of(flag: str) -> str:
    return flag[2:].split("=", 1)[0]


def script_path(name: str) -> str:
    """A script as given (from the current directory), else nanomind's own of that name."""
    for path in (name, os.path.join(REPO, name)):
        if os.path.isfile(path):
            return path
    raise ConfigError(f"config key 'script': no such file {name!r}")


def schemas_of(script: str) -> tuple:
    """The config dataclasses of one of nanomind's scripts; () for a script of one's own."""
    in_repo = os.path.dirname(os.path.abspath(script)) == REPO
    return SCHEMAS.get(os.path.basename(script), ()) if in_repo else ()


def field_types(schemas) -> dict:
    return {f.name: f.type for schema in schemas for f in dataclasses.fields(schema)}


def kinds(annotation) -> tuple:
    """The types a field allows: (int, NoneType) for `int | None`."""
    return annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)


def parse_value(key: str, text: str, annotation):
    """A flag's text -> a list of values, a Range, or None for a fixed value."""
    separator = "|" if "|" in text else "," if "," in text and key not in COMMA_KEYS else None
    if separator:
        parts = text.split(separator)
        if any(not p.strip() for p in parts):
            raise ConfigError(f"config key {key!r}: an empty value in the list {text!r}")
        return [parse_flag_value(p.strip()) for p in parts]
    parts = text.split(":")
    if len(parts) == 1 or not NUMBER.fullmatch(parts[0]):  # a path or URL holding ':' is a plain value
        return None
    if len(parts) not in (2, 3) or not NUMBER.fullmatch(parts[1]) or parts[2:] not in ([], ["log"]):
        raise ConfigError(f"config key {key!r}: malformed range {text!r}; expected low:high or low:high:log")
    low, high = parse_flag_value(parts[0]), parse_flag_value(parts[1])
    if low >= high:
        raise ConfigError(f"config key {key!r}: range {text!r} needs low < high")
    if len(parts) == 3 and low <= 0:
        raise ConfigError(f"config key {key!r}: log range {text!r} needs low > 0")
    ints = (int in kinds(annotation) and float not in kinds(annotation)) if annotation else \
        type(low) is int and type(high) is int  # a script of one's own: ints if both ends are
    if ints and not (type(low) is int and type(high) is int):
        raise ConfigError(f"config key {key!r} is an int: range {text!r} needs int ends")
    return Range(low, high, len(parts) == 3, ints)


def print_help(argv: list[str]):
    """Sweep's keys, then those of the script --script names (default: train_pretrain.py)."""
    (sweep,) = load_config([a for a in argv if a.startswith("--script=")], Sweep)
    schemas = schemas_of(script_path(sweep.script))
    keys = help_text((Sweep, *schemas), ()).split("\n", 1)[1]  # without its usage line, which knows no ranges
    what = f"those of {sweep.script}" + (" and the model" if ModelConfig in schemas else "") if schemas else \
        f"{sweep.script}'s own"
    print(f"{USAGE}\nSweep's keys, then {what}; every other --key=value goes to the script: fixed, a list (a,b or "
          f"a|b) or a range (low:high, low:high:log).\n{keys}")


def parse_args(argv: list[str]) -> Plan:
    """`[config_file] [--key=value ...]` -> the plan. The keys, the types of the values and the config file with the
    fixed flags are checked against the script's dataclasses: such a mistake stops the sweep before it runs."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print_help(argv)
        raise SystemExit(0)
    config_path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
    own = {f.name for f in dataclasses.fields(Sweep)}
    (sweep,) = load_config([a for a in argv if key_of(a) in own], Sweep)
    for key, ok, rule in [("search", sweep.search in ("grid", "random"), "grid or random"),
                          ("trials", sweep.trials >= 1, "at least 1"),
                          ("min_steps", sweep.min_steps >= 1, "at least 1"),
                          ("eta", sweep.eta >= 2, "at least 2")]:
        if not ok:
            raise ConfigError(f"config key {key!r} must be {rule}, got {getattr(sweep, key)!r}")
    script = script_path(sweep.script)
    schemas, fixed, space = schemas_of(script), {}, {}
    types_ = field_types(schemas)
    for arg in (a for a in argv if key_of(a) not in own):
        key, text = arg[2:].split("=", 1)
        if schemas and key not in types_:
            raise ConfigError(f"unknown config key {key!r} for {sweep.script}; known keys: {', '.join(sorted(types_))}")
        searched = parse_value(key, text, types_.get(key))
        if searched is None:
            fixed[key] = parse_flag_value(text)
            space.pop(key, None)
        else:
            space[key] = searched
            fixed.pop(key, None)
    if not space:
        raise ConfigError("nothing to search: give a key a list (--lr=1e-3,3e-3) or a range (--lr=1e-4:1e-2:log)")
    if sweep.search == "grid" and (ranged := [k for k, v in space.items() if isinstance(v, Range)]):
        raise ConfigError(f"config key {ranged[0]!r}: grid search takes a list of values, not a range")
    if schemas:  # a value that breaks a rule (lr > 0, dim divisible by n_heads) fails its trial with the script's error
        load_config(([config_path] if config_path else []) + [f"--{k}={v!r}" for k, v in fixed.items()], *schemas)
        for key, searched in space.items():
            for value in ([searched.low, searched.high] if isinstance(searched, Range) else searched):
                check_type(key, value, types_[key], "command line")
    settings = {**(read_config_file(config_path) if config_path else {}), **fixed}
    return Plan(sweep, script, config_path, fixed, space, settings, budgets(sweep, settings, space))


def budgets(sweep: Sweep, settings: dict, space: dict) -> list:
    """Each rung's max_steps: min_steps, eta x min_steps, ... below max_steps, then max_steps."""
    if not sweep.halving:
        return [None]
    if "max_steps" in space:
        raise ConfigError("config key 'max_steps': halving sets it for each rung; it cannot be searched too")
    max_steps = settings.get("max_steps")
    if not isinstance(max_steps, int) or max_steps <= sweep.min_steps:
        raise ConfigError(f"config key 'max_steps' (the last rung's) must be an int above min_steps = "
                          f"{sweep.min_steps} for halving, got {max_steps!r}")
    steps = [sweep.min_steps]
    while steps[-1] * sweep.eta < max_steps:
        steps.append(steps[-1] * sweep.eta)
    return steps + [max_steps]


# -----------------------------------------------------------------------------
# the trials

def candidates(plan: Plan) -> list[dict]:
    """The first rung's values: the grid's product, or `trials` draws from the sweep's own generator."""
    keys = list(plan.space)
    if plan.sweep.search == "grid":
        return [dict(zip(keys, combo)) for combo in itertools.product(*(plan.space[k] for k in keys))]
    rng = random.Random(plan.sweep.sweep_seed)
    return [{k: v.sample(rng) if isinstance(v, Range) else rng.choice(v) for k, v in plan.space.items()}
            for _ in range(plan.sweep.trials)]


def make_trial(plan: Plan, values: dict, budget: int | None, rung: int) -> Trial:
    """A trial's id: a hash of all it runs with, so a rerun (or another sweep in the same out_dir) finds it."""
    settings = {**plan.settings, **values, **({"max_steps": budget} if budget else {})}
    text = json.dumps({"script": plan.sweep.script, "settings": settings}, sort_keys=True, default=repr)
    digest, max_steps = hashlib.sha1(text.encode()).hexdigest()[:10], settings.get("max_steps")
    return Trial(values, max_steps, rung, f"s{max_steps}-{digest}" if isinstance(max_steps, int) else digest)


def trial_command(plan: Plan, trial: Trial, out_dir: str) -> list[str]:
    flags = {**plan.fixed, **trial.values, **({"max_steps": trial.max_steps} if trial.max_steps is not None else {})}
    return [sys.executable, plan.script, *([plan.config_path] if plan.config_path else []),
            *(f"--{k}={v!r}" for k, v in flags.items()), f"--out_dir={out_dir}"]


def device_slots() -> list:
    """One slot per GPU when there are several (their CUDA_VISIBLE_DEVICES names); else one slot, the device as is."""
    n = torch.cuda.device_count()  # NVML: no CUDA context in this process
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (visible.split(",") if visible else [str(i) for i in range(n)])[:n] if n > 1 else [None]


def read_metric(out_dir: str, metric: str) -> float:
    """The last value of metric in out_dir/metrics.jsonl (a cut last line is skipped); a UserError if none."""
    value = None
    try:
        for row in read_metrics(out_dir):
            if type(row.get(metric)) in (int, float):
                value = float(row[metric])
    except FileNotFoundError:
        raise UserError("it wrote no metrics.jsonl") from None
    if value is None:
        raise UserError(f"no row of its metrics.jsonl holds {metric}")
    if not math.isfinite(value):
        raise UserError(f"its last {metric} is {value}")
    return value


def last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else ""


def run_trials(plan: Plan, trials: list[Trial], slots: list, record):
    """Run the trials, one per slot at a time, and record(row) each as it ends. Whatever stops the sweep (Ctrl-C)
    stops the running trials unrecorded: the next run of the sweep starts them again."""
    waiting, running = list(trials), {}  # slot -> (trial, process, start time)
    try:
        while waiting or running:
            for slot in slots:
                if slot not in running and waiting:
                    running[slot] = launch(plan, waiting.pop(0), slot)
            time.sleep(0.05)
            for slot, (trial, proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    del running[slot]
                    record(outcome(plan, trial, proc.returncode, time.time() - t0))
    finally:
        for _, proc, _ in running.values():
            proc.terminate()
            proc.wait()


def trial_dir(plan: Plan, trial: Trial) -> str:
    return os.path.join(plan.sweep.out_dir, "trials", trial.id)


def launch(plan: Plan, trial: Trial, slot) -> tuple:
    out_dir = trial_dir(plan, trial)
    shutil.rmtree(out_dir, ignore_errors=True)  # an unrecorded run of this trial, cut short: start afresh
    os.makedirs(out_dir)
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": slot} if slot is not None else {})}
    print(f"start {trial.id} ({describe(trial.values)}){f' on GPU {slot}' if slot is not None else ''}", flush=True)
    with open(os.path.join(out_dir, "stdout.txt"), "w") as out, open(os.path.join(out_dir, "stderr.txt"), "w") as err:
        proc = subprocess.Popen(trial_command(plan, trial, out_dir), stdout=out, stderr=err, env=env)
    return trial, proc, time.time()


def outcome(plan: Plan, trial: Trial, returncode: int, seconds: float) -> dict:
    """A results.jsonl row: the trial's metric, or why it failed."""
    out_dir, metric = trial_dir(plan, trial), plan.sweep.metric
    value, error = None, None
    try:
        if returncode:
            raise UserError(last_line(os.path.join(out_dir, "stderr.txt")) or f"exit status {returncode}")
        value = read_metric(out_dir, metric)
    except UserError as e:
        error = str(e)
    row = {"trial": trial.id, "rung": trial.rung, "max_steps": trial.max_steps, "values": trial.values,
           "metric": metric, "value": value, "status": "failed" if error else "ok", "error": error,
           "seconds": round(seconds, 2), "out_dir": out_dir}
    print(f"done  {trial.id}: " + (f"{metric} {value:.4f}" if value is not None else f"failed: {error}") +
          f" ({seconds:.0f} s)", flush=True)
    return row


def describe(values: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


# -----------------------------------------------------------------------------
# the record: results.jsonl

def read_results(path: str) -> dict:
    """trial id -> its row (the last one); a line cut by a crash is skipped, and ended so the next row starts clean."""
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "trial" in row:
            rows[row["trial"]] = row
    if text and not text.endswith("\n"):
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n")
    return rows


def append_row(path: str, row: dict):
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def rank(plan: Plan, rows: list[dict]) -> list[dict]:
    """The trials that ran furthest first, each rung best first; the failed ones last. Stable: ties keep their order."""
    sign = -1 if plan.sweep.maximize else 1
    return sorted(rows, key=lambda r: (r["status"] != "ok", -r["rung"], sign * (r["value"] or 0)))


# -----------------------------------------------------------------------------
# the results: table, best_config.py, sweep.png

def print_table(plan: Plan, ranked: list[dict]):
    metric, keys = plan.sweep.metric, list(plan.space)
    cells = [["rank", "rung", "steps", metric, *keys, "seconds", "trial"]]
    for i, r in enumerate(ranked, 1):
        values = [f"{r['values'][k]:.4g}" if isinstance(r["values"][k], float) else str(r["values"][k]) for k in keys]
        shown = f"{r['value']:.4f}" if r["status"] == "ok" else "failed"
        cells.append([str(i), str(r["rung"]), str(r["max_steps"] or "-"), shown, *values, f"{r['seconds']:.0f}",
                      r["trial"]])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for i, r in enumerate(ranked, 1):
        if r["status"] != "ok":
            print(f"{i}: {r['error']}")


def write_best_config(plan: Plan, best: dict) -> str:
    """OUT/best_config.py: the config file's keys, the fixed flags, the best trial's values and max_steps, written
    whole or not at all."""
    settings = {**plan.settings, **best["values"], **({"max_steps": best["max_steps"]} if best["max_steps"] else {})}
    path = os.path.join(plan.sweep.out_dir, "best_config.py")
    steps = f" after {best['max_steps']} steps" if best["max_steps"] else ""
    lines = [f"# sweep.py's best trial, {best['trial']}: {best['metric']} {best['value']:.4f}{steps}",
             f"# python {plan.sweep.script} {path}"]
    lines += [f"{k} = {v!r}" for k, v in settings.items()]
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def plot(plan: Plan, ranked: list[dict]) -> str:
    """OUT/sweep.png: the metric against each searched key, a colour per rung, the best trial circled; a log x-axis
    for a log range and for a list of positive numbers spanning 10x or more."""
    ok = [r for r in ranked if r["status"] == "ok"]
    keys = list(plan.space)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), dpi=100, squeeze=False)
    for ax, key in zip(axes[0], keys):
        searched = plan.space[key]
        numeric = isinstance(searched, Range) or all(type(v) in (int, float) for v in searched)
        labels = None if numeric else list(dict.fromkeys(str(v) for v in searched))
        x = lambda r: r["values"][key] if numeric else labels.index(str(r["values"][key]))  # noqa: E731
        for rung in sorted({r["rung"] for r in ok}):
            rows = [r for r in ok if r["rung"] == rung]
            ax.scatter([x(r) for r in rows], [r["value"] for r in rows], s=24,
                       label=f"{rows[0]['max_steps']} steps" if rows[0]["max_steps"] else None)
        if ok:
            ax.scatter([x(ok[0])], [ok[0]["value"]], s=120, facecolors="none", edgecolors="black", label="best")
        if isinstance(searched, Range) and searched.log or isinstance(searched, list) and numeric and \
                min(searched) > 0 and max(searched) >= 10 * min(searched):
            ax.set_xscale("log")
        if labels:
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(key)
        ax.set_ylabel(plan.sweep.metric)
        ax.grid(alpha=0.3)
    if ok and len({r["rung"] for r in ok}) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(plan.sweep.out_dir, "sweep.png")
    fig.savefig(path)
    plt.close(fig)
    return path


# -----------------------------------------------------------------------------

def main(argv: list[str]) -> list[dict]:
    """Run the sweep; its trials' rows, ranked."""
    plan = parse_args(argv)
    sweep, t0 = plan.sweep, time.time()
    os.makedirs(sweep.out_dir, exist_ok=True)
    results = os.path.join(sweep.out_dir, "results.jsonl")
    done = read_results(results)

    def record(row: dict):
        append_row(results, row)
        done[row["trial"]] = row

    slots, values, rows, ran = device_slots(), candidates(plan), [], 0
    for rung, steps in enumerate(plan.budgets):
        trials = list({t.id: t for t in (make_trial(plan, v, steps, rung) for v in values)}.values())  # no repeats
        todo = [t for t in trials if t.id not in done]
        print(f"rung {rung}: {len(trials)} trial{'s' * (len(trials) != 1)}" + (f" of {steps} steps" if steps else "") +
              f", {len(trials) - len(todo)} of them recorded in {results} already", flush=True)
        try:
            run_trials(plan, todo, slots, record)
        except KeyboardInterrupt:
            print(f"\ninterrupted: the finished trials are in {results}; the same command goes on from there")
            raise SystemExit(130) from None
        ran += len(todo)
        ranked = rank(plan, [{**done[t.id], "rung": rung, "values": t.values} for t in trials])
        rows += ranked
        values = [r["values"] for r in ranked if r["status"] == "ok"][: max(1, len(trials) // sweep.eta)]
        if not values:
            break
    rows = rank(plan, rows)
    print_table(plan, rows)
    print(f"{len(rows)} trials, {ran} of them run now in {time.time() - t0:.0f} s; plot: {plot(plan, rows)}")
    if rows[0]["status"] != "ok":
        raise UserError(f"every trial failed, the first with: {rows[0]['error']} (see {rows[0]['out_dir']}/stderr.txt)")
    print(f"best: {describe(rows[0]['values'])}, {sweep.metric} {rows[0]['value']:.4f}; its config: "
          f"{write_best_config(plan, rows[0])}")
    return rows


if __name__ == "__main__":
    cli(main)
