"""The report of `bash .ci/gpu`: python .ci/gpu_report.py WORK OUT reads what its steps left in WORK (steps.tsv,
each bench step's last line of JSON, nvidia-smi's CSV) and OUT/devices.xml (the device tests, JUnit), and writes
OUT/report.md (tables to paste into docs/performance.md) and OUT/report.json (every figure)."""
import csv
import json
import os
import sys
import xml.etree.ElementTree as ET

BENCH = ("train", "sft", "generate", "serve")
# each bench step's table: column -> (heading, format)
STAGE = {"variant": ("variant", "{}"), "tokens_per_s": ("tokens/s", "{:,.0f}"),
         "tokens_per_s_median": ("median tokens/s", "{:,.0f}"), "ms_per_step": ("ms/step", "{:.1f}"),
         "tokens_per_step": ("tokens/step", "{:,.0f}"), "mfu": ("MFU", "{:.1%}"), "mfu_median": ("median MFU", "{:.1%}"),
         "mem_gb": ("peak GB", "{:.2f}"), "dtype": ("dtype", "{}")}
TABLES = {"train": STAGE,
          "sft": {**STAGE, "real_tokens_per_s_median": ("median real tokens/s", "{:,.0f}"),
                  "pad_frac": ("padding", "{:.1%}")},
          "generate": {"batch_size": ("batch", "{}"), "prefill_tokens_per_s": ("prefill tokens/s", "{:,.0f}"),
                       "decode_tokens_per_s_cache": ("decode tokens/s (KV cache)", "{:,.1f}"),
                       "decode_tokens_per_s_recompute": ("decode tokens/s (recompute)", "{:,.1f}"),
                       "cache_speedup": ("cache speed-up", "{:.1f}x"), "dtype": ("dtype", "{}")},
          "serve": {"round": ("round", "{}"), "clients": ("streams", "{}"),
                    "tokens_per_s_alone": ("tokens/s, 1 stream", "{:,.1f}"),
                    "tokens_per_s_together": ("tokens/s, all streams", "{:,.1f}"), "ratio": ("ratio", "{:.2f}x")}}


def read_steps(work: str) -> list[dict]:
    path = os.path.join(work, "steps.tsv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{"step": name, "rc": rc, "seconds": int(seconds), "command": command}
                for name, rc, seconds, command in (line.rstrip("\n").split("\t", 3) for line in f if line.strip())]


def read_bench(work: str, name: str) -> dict | None:
    """A bench step's last output line, or None where it failed before printing it."""
    try:
        with open(os.path.join(work, f"{name}.json")) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def read_tests(path: str) -> dict | None:
    """Counts, time, the failures (name, first line of the message) and the slowest tests of a JUnit file."""
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    cases, failed = [], []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        cases.append((float(case.get("time", 0)), name))
        for bad in [*case.findall("failure"), *case.findall("error")]:
            failed.append({"test": name, "message": (bad.get("message") or bad.text or "").strip().split("\n")[0][:300]})
    slowest = [{"test": name, "seconds": round(t, 1)} for t, name in sorted(cases, reverse=True)[:10]]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "seconds": round(float(suite.get("time", 0)), 1), "failed": failed, "slowest": slowest}


def read_gpu(work: str) -> list[dict]:
    try:
        with open(os.path.join(work, "nvidia-smi.csv")) as f:
            return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]
    except OSError:
        return []


def read_text(path: str) -> str:
    """A file's last non-empty line ("" if none): the torch versions, or pytest's summary where it left no JUnit file."""
    try:
        with open(path) as f:
            return ([line.strip() for line in f if line.strip()] or [""])[-1]
    except OSError:
        return ""


def table(rows: list[dict], columns: dict) -> list[str]:
    shown = [k for k in columns if any(k in row for row in rows)]
    lines = ["| " + " | ".join(columns[k][0] for k in shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        cells = [columns[k][1].format(row[k]) if row.get(k) is not None else "" for k in shown]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def shapes(result: dict | None) -> list[str]:
    """gpu_shapes.py's figures: per SDPA backend, ms of a call whose shape is new, and of the same call again."""
    if not result:
        return ["(no figures: the step failed; see gpu.log)"]
    cases = ("decode_gqa", "decode_repeated", "train_causal")
    out = [f"{result['torch']}, CUDA_MODULE_LOADING={result['CUDA_MODULE_LOADING']}, cuDNN attention enabled: "
           f"{result['cudnn_sdp_enabled']}; median of {result['new_shapes']} new shapes, ms (first / again)", "",
           "| backend | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for backend in ("default", "flash", "efficient", "cudnn", "math"):
        cells = [result.get(f"{case}_{backend}", {}) for case in cases]
        out.append(f"| {backend} | " + " | ".join(f"{c['first_ms']} / {c['again_ms']}" if "first_ms" in c
                                                    else c.get("error", "")[:60] for c in cells) + " |")
    m = result["matmul"]
    out += ["", f"matmul (new row count): {m['first_ms']} / {m['again_ms']} ms", ""]
    out += [f"- default kernels, {case}: {', '.join(result.get(f'default_kernels_{case}', []))}"
            for case in ("decode_gqa", "train_causal")]
    return out


def markdown(report: dict) -> str:
    machine = next((b["machine"] for b in report["bench"].values() if b), {})
    peaks = {k: v for b in report["bench"].values() if b for k, v in b.get("peak_flops", {}).items()}
    gpus = ", ".join(f"{g.get('name', '?')} ({g.get('memory.total [MiB]', '?')})"
                     for g in report["gpus"]) or machine.get("cuda") or "no GPU"
    out = [f"## GPU check: {gpus}", "",
           f"{report['torch'] or 'torch ' + machine.get('torch', '?')}, CPU {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores); "
           "`bash .ci/gpu` (bench.py on configs/26m.py; MFU against the matmul peak measured in the same run: "
           + ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in peaks.items()) + ")", ""]
    tests = report["tests"]
    if tests:
        out += [f"**Device tests**: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                f"{tests['skipped']} skipped in {tests['seconds']} s", ""]
        out += [f"- FAILED {f['test']}: {f['message']}" for f in tests["failed"]] + ([""] if tests["failed"] else [])
    else:
        out += [f"**Device tests**: no JUnit file (not run, or stopped at the deadline): "
                f"{report['tests_summary'] or 'see gpu.log'}", ""]
    titles = {"train": "Pretraining, 26m, bfloat16, compile on and off", "sft": "SFT, 26m, bfloat16: padded, packed, packed and compiled",
              "generate": "Generation, 26m, bfloat16 (greedy, batch 1 and 8)", "serve": "serve.py, 26m: 1 stream, then 8"}
    out += ["### New shapes (.ci/gpu_shapes.py)", "", *shapes(report["shapes"]), ""]
    for name in BENCH:
        bench = report["bench"].get(name)
        out += [f"### {titles[name]}", ""]
        out += (table(bench["rows"], TABLES[name]) if bench else ["(no figures: the step failed; see gpu.log)"]) + [""]
    out += ["### Steps", "", "| step | exit | seconds | command |", "|---|---|---|---|"]
    out += [f"| {s['step']} | {s['rc']} | {s['seconds']} | `{s['command']}` |" for s in report["steps"]]
    return "\n".join(out) + "\n"


def main(work: str, out_dir: str):
    report = {"steps": read_steps(work), "gpus": read_gpu(work),
              "tests": read_tests(os.path.join(out_dir, "devices.xml")),
              "tests_summary": read_text(os.path.join(work, "devices.out")),
              "torch": read_text(os.path.join(work, "torch.txt")),
              "shapes": read_bench(work, "shapes"), "bench": {name: read_bench(work, name) for name in BENCH}}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:3])
