"""sweep.py: grid and seeded random search over a script's keys, each trial a subprocess in its own out_dir, failed
trials recorded, successive halving keeping the best 1/eta, reruns skipping recorded trials, best_config.py that
trains. Most tests run a fake script (a few lines that write a metric computed from their keys); one runs
train_pretrain.py on the tiny model."""
import itertools
import json
import math
import os

import pytest

import sweep
import train_pretrain
from config import read_config_file
from conftest import TINY_MODEL, TINY_RUN, read_metrics, run_script
from errors import ConfigError

# val_loss from the keys: least at lr = 10^-(2 + 5 / max_steps) (the optimum moves with the budget: each rung may rank
# its trials differently), + wd; crash=True exits with an error, nan=True logs NaN. Each launch adds a line to
# launches.txt beside the script.
FAKE = r'''
import ast, json, math, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "launches.txt"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
cfg = {"max_steps": 10, "wd": 0.0}
args = sys.argv[1:]
if args and not args[0].startswith("--"):  # a config file
    exec(open(args.pop(0)).read(), {}, cfg)
for arg in args:
    key, text = arg[2:].split("=", 1)
    cfg[key] = text if key == "out_dir" else ast.literal_eval(text)
if cfg.get("crash"):
    sys.exit("error: crash asked for")
val = (math.log10(cfg["lr"]) + 2 + 5 / cfg["max_steps"]) ** 2 + cfg["wd"]
if cfg.get("nan"):
    val = float("nan")
os.makedirs(cfg["out_dir"], exist_ok=True)
with open(os.path.join(cfg["out_dir"], "args.json"), "w") as f:
    json.dump({**cfg, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
with open(os.path.join(cfg["out_dir"], "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": cfg["max_steps"], "loss": 9.0}) + "\n")
    f.write(json.dumps({"step": cfg["max_steps"], "val_loss": 99.0}) + "\n")  # an earlier evaluation
    f.write(json.dumps({"step": cfg["max_steps"], "val_loss": val}) + "\n")
'''


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake.py"
    path.write_text(FAKE)
    return path


def launches(fake) -> int:
    path = fake.parent / "launches.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def results(out) -> list[dict]:
    with open(out / "results.jsonl") as f:
        return [json.loads(line) for line in f]


def trial_args(row) -> dict:
    with open(os.path.join(row["out_dir"], "args.json")) as f:
        return json.load(f)


def own_metric(row) -> float:
    """The trial's metric as its own metrics.jsonl has it: the last val_loss."""
    return [r["val_loss"] for r in read_metrics(row["out_dir"]) if "val_loss" in r][-1]


def test_grid_runs_exactly_the_product_in_order(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "device_slots", lambda: [None])  # one at a time, as on a CPU: rows in launch order
    out = tmp_path / "grid"
    sweep.main([f"--script={fake}", f"--out_dir={out}", "--search=grid", "--lr=1e-3,1e-2", "--wd=0|1|2.5",
                "--max_steps=7"])
    rows = results(out)
    assert [(r["values"]["lr"], r["values"]["wd"]) for r in rows] == list(itertools.product([1e-3, 1e-2], [0, 1, 2.5]))
    for row in rows:  # what the script itself was given
        args = trial_args(row)
        assert (args["lr"], args["wd"], args["max_steps"]) == (row["values"]["lr"], row["values"]["wd"], 7)
        assert args["out_dir"] == row["out_dir"] and type(args["wd"]) is type(row["values"]["wd"])


def test_random_search_is_seeded_and_stays_in_its_ranges(tmp_path):
    space = ["--lr=1e-5:1e-2:log", "--warmup_steps=0:200", "--weight_decay=0.0:0.3", "--optimizer=adamw,muon",
             "--batch_size=8:128:log", "--trials=400"]
    draw = lambda *flags: sweep.candidates(sweep.parse_args([*space, *flags]))  # noqa: E731
    a, b, c = draw("--sweep_seed=1"), draw("--sweep_seed=1"), draw("--sweep_seed=2")
    assert a == b and a != c and len(a) == 400
    lr = [t["lr"] for t in a]
    assert all(1e-5 <= x <= 1e-2 for x in lr)
    # log-uniform: every decade gets about a third, and half fall below the geometric midpoint (uniform: 3%)
    for lo in (1e-5, 1e-4, 1e-3):
        assert 0.25 < sum(lo <= x < 10 * lo for x in lr) / len(lr) < 0.42
    assert 0.4 < sum(x < math.sqrt(1e-5 * 1e-2) for x in lr) / len(lr) < 0.6
    assert all(type(t["warmup_steps"]) is int and 0 <= t["warmup_steps"] <= 200 for t in a)
    assert {0, 200} & {t["warmup_steps"] for t in a} and len({t["warmup_steps"] for t in a}) > 100
    assert all(type(t["batch_size"]) is int and 8 <= t["batch_size"] <= 128 for t in a)
    assert 0.4 < sum(t["batch_size"] < 32 for t in a) / len(a) < 0.6  # log2: 8-31 is half of 8-128
    assert all(type(t["weight_decay"]) is float and 0 <= t["weight_decay"] <= 0.3 for t in a)
    assert {t["optimizer"] for t in a} == {"adamw", "muon"}


def test_ranking_and_best_config_follow_each_trials_metrics(fake, tmp_path):
    out = tmp_path / "random"
    config = tmp_path / "base.py"
    config.write_text("lr = 1.0\nwd = 0.5\nname = 'base'\n")
    ranked = sweep.main([str(config), f"--script={fake}", f"--out_dir={out}", "--lr=1e-4:1e-1:log", "--trials=6",
                         "--max_steps=20"])
    assert len(ranked) == 6 and all(r["status"] == "ok" for r in ranked)
    own = [own_metric(r) for r in ranked]
    assert own == sorted(own) and [r["value"] for r in ranked] == own
    best = read_config_file(out / "best_config.py")
    assert best == {"lr": ranked[0]["values"]["lr"], "wd": 0.5, "name": "base", "max_steps": 20}
    assert trial_args(ranked[0])["wd"] == 0.5  # the config file reached the script
    assert (out / "sweep.png").stat().st_size > 0
    maximized = sweep.main([str(config), f"--script={fake}", f"--out_dir={out}", "--lr=1e-4:1e-1:log", "--trials=6",
                            "--max_steps=20", "--maximize=True"])
    assert [r["trial"] for r in maximized] == [r["trial"] for r in ranked][::-1]


def test_failed_trials_are_recorded_and_the_sweep_goes_on(fake, tmp_path):
    out = tmp_path / "failing"
    ranked = sweep.main([f"--script={fake}", f"--out_dir={out}", "--search=grid", "--crash=False,True",
                         "--nan=False,True", "--lr=1e-3,1e-2"])
    rows = results(out)
    assert len(rows) == 8 and launches(fake) == 8
    for row in rows:
        crash, nan = row["values"]["crash"], row["values"]["nan"]
        assert row["status"] == ("failed" if crash or nan else "ok")
        if crash:
            assert row["error"] == "error: crash asked for" and row["value"] is None
        elif nan:
            assert "nan" in row["error"] and row["value"] is None
    assert [r["status"] for r in ranked] == ["ok"] * 2 + ["failed"] * 6


def test_a_rerun_runs_nothing_new_and_a_cut_row_runs_again(fake, tmp_path):
    out = tmp_path / "rerun"
    argv = [f"--script={fake}", f"--out_dir={out}", "--lr=1e-4:1e-1:log", "--wd=0,1", "--trials=9", "--halving=True",
            "--min_steps=5", "--max_steps=45", "--crash=False|False|True"]
    first = sweep.main(argv)
    n, text = launches(fake), (out / "results.jsonl").read_text()
    again = sweep.main(argv)
    assert launches(fake) == n and (out / "results.jsonl").read_text() == text and again == first
    rows = text.splitlines()  # a crash while writing the last row: half of it on disk
    (out / "results.jsonl").write_text("\n".join(rows[:-1]) + "\n" + rows[-1][: len(rows[-1]) // 2])
    third = sweep.main(argv)
    assert launches(fake) == n + 1  # that trial alone ran again
    assert [r["trial"] for r in third] == [r["trial"] for r in first]
    lines = (out / "results.jsonl").read_text().splitlines()  # the cut row on a line of its own, the rest whole
    assert lines[:-2] == rows[:-1] and lines[-2] == rows[-1][: len(rows[-1]) // 2] and json.loads(lines[-1])


def test_halving_continues_the_best_third_of_each_rung(fake, tmp_path):
    out = tmp_path / "halving"
    ranked = sweep.main([f"--script={fake}", f"--out_dir={out}", "--lr=1e-4:1e-1:log", "--trials=10",
                         "--halving=True", "--min_steps=2", "--eta=3", "--max_steps=40", "--crash=False|True"])
    rows = results(out)
    by_steps = {steps: [r for r in rows if r["max_steps"] == steps] for steps in (2, 6, 18, 40)}
    assert [len(r) for r in by_steps.values()] == [10, 3, 1, 1] and len(rows) == 15
    for lower, upper in ((2, 6), (6, 18), (18, 40)):
        ok = sorted((r for r in by_steps[lower] if r["status"] == "ok"), key=own_metric)
        kept = ok[: max(1, len(by_steps[lower]) // 3)]
        assert [r["values"] for r in kept] == [r["values"] for r in by_steps[upper]]
        assert all(trial_args(r)["max_steps"] == upper for r in by_steps[upper])
    assert ranked[0]["max_steps"] == 40 and ranked[0]["values"] == by_steps[40][0]["values"]
    assert read_config_file(out / "best_config.py")["max_steps"] == 40


def test_several_gpus_run_a_trial_on_each(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "device_slots", lambda: ["0", "1"])
    out = tmp_path / "gpus"
    sweep.main([f"--script={fake}", f"--out_dir={out}", "--search=grid", "--lr=1e-4,1e-3,1e-2,1e-1,1.0"])
    rows = results(out)
    assert len(rows) == 5 and {trial_args(r)["cuda"] for r in rows} == {"0", "1"}


@pytest.mark.parametrize("flags, message", [
    (["--lrr=1e-3,1e-2"], "'lrr'"),
    (["--lr=1e-3:abc"], "'lr': malformed range"),
    (["--lr=1e-3:1e-2:lin"], "'lr': malformed range"),
    (["--lr=1e-2:1e-3"], "'lr': range '1e-2:1e-3' needs low < high"),
    (["--lr=0:1e-2:log"], "'lr': log range '0:1e-2:log' needs low > 0"),
    (["--search=grid", "--lr=1e-4:1e-2"], "'lr': grid search takes a list"),
    (["--warmup_steps=0.5:10"], "'warmup_steps' is an int"),
    (["--optimizer=adamw,3"], "'optimizer'"),
    (["--batch_size=16", "--optimizer=sgd", "--lr=1e-3,1e-2"], "'optimizer'"),
    (["--lr=1e-3,abc"], "'lr'"),
    (["--lr=1e-3,"], "'lr': an empty value"),
    (["--batch_size=16"], "nothing to search"),
    (["--search=bayes", "--lr=1e-3,1e-2"], "'search'"),
    (["--halving=True", "--lr=1e-3,1e-2"], "'max_steps'"),
    (["--halving=True", "--max_steps=50", "--min_steps=50", "--lr=1e-3,1e-2"], "'max_steps'"),
    (["--script=nope.py", "--lr=1e-3,1e-2"], "'script'"),
])
def test_bad_input_is_an_error_naming_the_key(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        sweep.parse_args(flags)


def test_the_command_line_says_one_error_line_and_lists_both_key_sets():
    done = run_script("sweep.py", "--lr=1e-2:1e-3")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: ")
    shown = run_script("sweep.py", "--help")
    assert shown.returncode == 0
    assert all(f"--{k}=" in shown.stdout for k in ("sweep_seed", "halving", "eta", "lr", "warmup_steps", "dim"))


def test_a_sweep_of_train_pretrain_and_its_best_config_trains(demo_dir, tmp_path):
    config = tmp_path / "tiny.py"
    config.write_text(f"data_path = {str(demo_dir / 'pretrain.jsonl')!r}\nbatch_size = 4\nwarmup_steps = 2\n"
                      f"max_steps = 6\neval_interval = 100\nsave_interval = 100\n")
    out = tmp_path / "sweep"
    done = run_script("sweep.py", str(config), f"--out_dir={out}", *TINY_MODEL, *TINY_RUN, "--search=grid",
                      "--lr=1e-3,3e-2", "--optimizer=adamw|sgd")  # sgd: the script refuses it, those trials fail
    assert done.returncode == 0, done.stderr[-2000:]
    rows = results(out)
    statuses = sorted((r["values"]["optimizer"], r["status"]) for r in rows)
    assert statuses == [("adamw", "ok")] * 2 + [("sgd", "failed")] * 2
    assert {r["error"] for r in rows if r["status"] == "failed"} == {
        "error: config key 'optimizer' must be adamw or muon, got 'sgd'"}
    rows = [r for r in rows if r["status"] == "ok"]
    own = {r["values"]["lr"]: own_metric(r) for r in rows}
    assert {r["values"]["lr"]: r["value"] for r in rows} == own
    best_lr = min(own, key=own.get)
    best = read_config_file(out / "best_config.py")
    assert best["lr"] == best_lr and best["max_steps"] == 6 and best["dim"] == 32
    train_pretrain.main([str(out / "best_config.py"), f"--out_dir={tmp_path / 'again'}"])
    again = [r["val_loss"] for r in read_metrics(tmp_path / "again") if "val_loss" in r][-1]
    assert again == pytest.approx(own[best_lr], abs=1e-4)  # the same run: config, seed and data
