"""What several test files share: the demo data and the tiny models trained on it, tiny training runs and their
metrics, nanomind's own tokenizer and data files, strings for tokenizer tests, serve.py in a subprocess."""
import dataclasses
import faulthandler
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import metrics
import prepare_demo
import tokenizer as tk
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUCK_S = 900  # a test (its fixtures included) still running after this is stuck, even on a loaded machine


def stuck(signum, frame):
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)  # lands in the report's captured stderr
    raise TimeoutError(f"stuck for {STUCK_S} s: every thread's stack is in the captured stderr")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that hangs fails with every thread's stack, and the suite goes on instead of running out its time."""
    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(STUCK_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

# every in-process training run in the tests: a tiny model, float32 on the CPU, a fixed MFU peak
TINY_MODEL = ["--dim=32", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", "--max_seq_len=32"]
TINY_CONTEXT = 128  # the tiny pretrained and SFT models' max_seq_len: two ChatML turns with their think tags fit
TINY_RUN = ["--device=cpu", "--dtype=float32", "--peak_flops=1e12", "--log_interval=1", "--eval_steps=2"]
LORA = ["--lora_rank=4", "--lora_alpha=8"]  # the LoRA runs' adapters


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A small copy of the demo data set (the generator is seeded, so it is the same every session)."""
    out = tmp_path_factory.mktemp("demo")
    prepare_demo.main([f"--out_dir={out}", "--pretrain_docs=2000", "--sft=600", "--dpo=300"])
    return out


def greedy_alone(model, prompt: list[int], max_new: int, eos_id: int | None = None) -> list[int]:
    """The model's greedy continuation of one prompt, generated alone: up to max_new ids, eos_id last if it ends
    there."""
    from engine import generate

    for (row,) in generate(model, [prompt], max_new, eos_id=eos_id):
        pass
    return row.tokens


def tiny(**overrides) -> Transformer:
    """A small random model, the same for the same overrides (seeded)."""
    torch.manual_seed(0)
    cfg = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)
    return Transformer(ModelConfig(**{**cfg, **overrides}))


def read_metrics(out_dir) -> list[dict]:
    """The run's rows as the run went on: a resume's restart row applied (metrics.read_metrics)."""
    return metrics.read_metrics(str(out_dir))


def train_losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def final_weights(out_dir, step: int) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out_dir, f"step_{step:07d}.pt"), weights_only=False)["model"]


def assert_resumes_exactly(run, full, resumed, saved: int, last: int):
    """run(out_dir, *flags) to step `last` in full, uninterrupted, and in resumed from a copy of full's step `saved`
    checkpoint alone (as if the run had died right after it): the losses after `saved` and the last weights are
    the same, bit for bit."""
    run(full)
    os.makedirs(resumed)
    shutil.copy(os.path.join(full, f"step_{saved:07d}.pt"), resumed)
    run(resumed, "--resume=True")
    a, b = train_losses(full), train_losses(resumed)
    assert set(b) == set(range(saved + 1, last + 1)) and all(a[s] == b[s] for s in b)
    wa, wb = final_weights(full, last), final_weights(resumed, last)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="session")
def tiny_pretrained(demo_dir, tmp_path_factory):
    """A tiny model pretrained for a few dozen steps on the demo text: the starting point of SFT tests."""
    import train_pretrain

    out = tmp_path_factory.mktemp("pretrain")
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out}", *TINY_MODEL, *TINY_RUN,
                         "--batch_size=16", "--lr=1e-2", "--warmup_steps=5", "--max_steps=60", "--eval_interval=60",
                         f"--max_seq_len={TINY_CONTEXT}"])
    return out / "best.pt"


@pytest.fixture(scope="session")
def tiny_sft(demo_dir, tiny_pretrained, tmp_path_factory):
    """The tiny model after a short SFT on the demo conversations: the starting point of DPO tests."""
    import train_sft

    out = tmp_path_factory.mktemp("sft")
    train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out}",
                    *TINY_RUN, "--batch_size=16", "--lr=5e-3", "--max_steps=150", "--eval_interval=150",
                    f"--max_seq_len={TINY_CONTEXT}"])
    return out / "best.pt"


TOOLS_CONTEXT = 352  # the demo's calculator conversations: ~340 tokens, most of them the tools block


@pytest.fixture(scope="session")
def tiny_tools(demo_dir, tmp_path_factory):
    """A tiny ChatML model fine-tuned on 16 of the demo's tool-calling conversations until it knows them: asked
    one of their questions ("What is 37 times 48?") it calls calculate_math with the two numbers, reads the result
    and states it."""
    import train_pretrain
    import train_sft

    out = tmp_path_factory.mktemp("tools")
    with open(demo_dir / "tools_sft.jsonl", encoding="utf-8") as f:
        write_jsonl(out / "tools_16.jsonl", [json.loads(line) for line in list(f)[:16]])
    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out}/pretrain", *TINY_RUN,
                         "--dim=64", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", f"--max_seq_len={TOOLS_CONTEXT}",
                         "--batch_size=4", "--max_steps=1", "--eval_interval=1"])
    train_sft.main([f"--init_from={out}/pretrain/best.pt", f"--data_path={out}/tools_16.jsonl", f"--out_dir={out}/sft",
                    *TINY_RUN, "--batch_size=8", "--lr=1e-2", "--min_lr=1e-3", "--max_steps=400",
                    "--eval_interval=400", "--val_data_path=" + str(out / "tools_16.jsonl"), "--log_interval=50",
                    "--early_stopping_patience=1000", f"--max_seq_len={TOOLS_CONTEXT}",
                    "--pack=False"])  # a conversation fills a row either way; the recipe was found with these batches
    return out / "sft" / "best.pt"


# --- tiny runs of the scripts ---------------------------------------------------------------------

def pretrain(demo_dir, out_dir, *flags):
    """A tiny pretraining run on the demo text: batches of 8, lr 3e-3, 3 warmup steps."""
    import train_pretrain

    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out_dir}", *TINY_MODEL, *TINY_RUN,
                         "--batch_size=8", "--lr=3e-3", "--warmup_steps=3", *flags])


def pretrain_short(demo_dir, out_dir, *flags):
    """A cheaper tiny pretraining run: windows of 16 tokens, batches of 4, 3 warmup steps, the default lr."""
    import train_pretrain

    train_pretrain.main([f"--data_path={demo_dir}/pretrain.jsonl", f"--out_dir={out_dir}", *TINY_MODEL, *TINY_RUN,
                         "--max_seq_len=16", "--batch_size=4", "--warmup_steps=3", *flags])


def sft(tiny_pretrained, demo_dir, out_dir, *flags):
    """SFT of the tiny pretrained model on the demo conversations: batches of 8, lr 5e-3, 64 positions."""
    import train_sft

    train_sft.main([f"--init_from={tiny_pretrained}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out_dir}",
                    *TINY_RUN, "--batch_size=8", "--lr=5e-3", "--max_seq_len=64", *flags])


def lora_sft(base, demo_dir, out_dir, *flags):
    """LoRA SFT (rank 4, alpha 8) of the checkpoint base on the demo conversations: batches of 8, lr 1e-2."""
    import train_sft

    train_sft.main([f"--init_from={base}", f"--data_path={demo_dir}/sft.jsonl", f"--out_dir={out_dir}", *TINY_RUN,
                    "--batch_size=8", "--lr=1e-2", "--max_seq_len=64", *LORA, *flags])


def pretrain_ddp_matches_one_process(demo_dir, tmp_path, *flags) -> dict:
    """Tiny pretraining for 5 steps of accum 2 with flags, batch 4 in one process and batch 2 on each of 2 ranks
    under torchrun: the same losses and final weights (within 1e-5), identical on both ranks. The DDP run's last
    checkpoint."""
    import train_pretrain
    from checkpoint import load_checkpoint

    common = [f"--data_path={demo_dir}/pretrain.jsonl", *TINY_MODEL, *TINY_RUN, "--lr=3e-3", "--warmup_steps=3",
              "--max_steps=5", "--accum_steps=2", *flags]
    train_pretrain.main(common + ["--batch_size=4", f"--out_dir={tmp_path / 'single'}"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train_pretrain.py"), *common, "--batch_size=2", f"--out_dir={tmp_path / 'ddp'}"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert set(a) == set(b) and all(abs(a[s] - b[s]) <= 1e-5 for s in a)
    ckpt = load_checkpoint(str(tmp_path / "ddp" / "step_0000005.pt"))
    assert ckpt["rank_weight_diff"] == 0.0  # both ranks hold identical weights
    single = final_weights(tmp_path / "single", 5)
    assert max((single[k] - ckpt["model"][k]).abs().max().item() for k in single) <= 1e-5
    return ckpt


def run_script(*args, cwd=REPO):
    """python *args in a process, as a user runs a script: its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# --- nanomind's own tokenizer and data files -------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    """nanomind's own tokenizer (vocab/nanomind/, the default before MiniMind's): the tests of its format, of
    the [INST] template and of data handling that holds for any tokenizer."""
    return load_tokenizer(tk.NANOMIND_DIR)


def shorter_is_better(tmp_path, chars_per_point=1) -> str:
    """The --reward flag of a reward that spreads within every group, so that each RL step updates (a tiny model's
    answers may all be wrong, and equal rewards have no advantage): -1 per chars_per_point characters written."""
    (tmp_path / "short.py").write_text(
        f"def short(messages, completion, record):\n    return -len(completion) / {chars_per_point}\n")
    return f"--reward={tmp_path}/short.py:short"


def write_jsonl(path, rows):
    """rows as a JSONL file, one per line (a string row is written as it is: a malformed line); its path."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


# a system prompt and two turns, the second in Chinese
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "法国在哪里？"},
    {"role": "assistant", "content": "法国位于欧洲。"},
]


# --- strings for tokenizer tests ------------------------------------------------------------------

EN = ("the model learns from data and we train it on text with numbers while people read books "
      "about history science music water light small large quickly function return value").split()
ZH = ("我们 你好 世界 中文 模型 训练 数据 学习 语言 计算 机器 时间 问题 今天 天气 朋友 北京 "
      "上海 科学 历史 音乐 文字 数字 方法 结果 系统 网络 图书 老师 学生").split()
CHECK = [  # strings every round-trip / agreement test sees
    "",
    "Hello, world! It's 2024; don't panic.",
    "我们今天学习中文，明天学习英文。《三体》很好看！",
    "用Python写代码 12+34=46 ２０２３年 二〇二三年",
    "emoji 😀👍🏽 ❤️ 1️⃣ 👨‍👩‍👧 🏴‍☠️ 🇨🇳 family: 👩‍❤️‍💋‍👨",
    "def f(x):\n\tif x > 0:\r\n        return x ** 2  # 平方\n\n\n",
    "  \t \n \r\n\r\n\u3000\u00a0x \u2028y\x1c\x1fz \t\x1c",
    "I'M HE'LL we'VE 'ſ 'K (long s, Kelvin) ",
    "e\u0301 n\u0303 ½ ² ١٢٣ ๑๒ \u2581 \ufffd \U00031350\U000323af",
    "<s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nhi [/INST] ok </s><pad>",
    "\x00\x01\x7f\x80\x9f é ß Ω Ж ا",
]


def random_strings(n: int, seed: int) -> list[str]:
    """Seeded strings mixing ASCII, Chinese, emoji and any code point (astral too), plus every
    boundary of the pattern's ranges, where an escaping or range slip would show."""
    rng = random.Random(seed)
    edges = sorted({c + d for table in (tk._SPACE, tk._DIGIT, tk._HAN, tk._SYMBOL)
                    for a, b in table for c in (a, b) for d in (-1, 0, 1)})
    edges = [chr(e) for e in edges if 0 <= e <= 0x10FFFF and not 0xD800 <= e <= 0xDFFF]
    # where engines tend to disagree: \s, (?i) and \d differ around these
    tricky = list("\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f \x85\xa0\u2028\u3000'sSlLvVeErRmMtTdD"
                  "\u017f\u212a_9٣９〇中\u0301\u200d")
    pools = [(0x20, 0x7E), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0, 0x10FFFF)]

    def char() -> str:
        if rng.random() < 0.4:
            return rng.choice(edges if rng.random() < 0.5 else tricky)
        lo, hi = rng.choice(pools)
        c = rng.randint(lo, hi)
        return chr(c) if not 0xD800 <= c <= 0xDFFF else "\ud7ff"  # lone surrogates are not text
    return ["".join(char() for _ in range(rng.randint(1, 24))) for _ in range(n)]


def corpus_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choices(EN, k=rng.randint(4, 12))).capitalize() + ".")
        elif kind == 1:
            lines.append("，".join("".join(rng.choices(ZH, k=3)) for _ in range(3)) + "。")
        elif kind == 2:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            emoji = rng.choice(["😀", "👨‍👩‍👧", "❤️"])
            lines.append(f"{a}+{b}={a + b}, 2024年{rng.randint(1, 12)}月 {emoji}")
        else:
            lines.append(f"def {rng.choice(EN)}(x):\n    return x * {rng.randint(2, 99)}\n")
    return lines


# --- serve.py in a subprocess ---------------------------------------------------------------------

def start_server(ckpt, *flags):
    """serve.py in a subprocess on a free port -> (process, base url, its stderr file)."""
    err = open(f"{ckpt}.{os.getpid()}.{time.time_ns()}.stderr", "w+")
    proc = subprocess.Popen([sys.executable, "serve.py", f"--ckpt={ckpt}", "--port=0", *flags], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    assert "http://" in line, (line, open(err.name).read())
    return proc, "http://" + line.split("http://", 1)[1].split("/", 1)[0], err


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A random-init model with a 4096-token context: an answer long enough to walk away from."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=6400, max_seq_len=4096)
    path = tmp_path_factory.mktemp("long") / "long.pt"
    torch.save({"model": Transformer(cfg).state_dict(), "model_config": dataclasses.asdict(cfg),
                "config": {"tokenizer_path": None}, "stage": "sft"}, path)
    proc, url, _ = start_server(path)
    yield url
    proc.terminate()
    proc.wait()


def health(url) -> dict:
    with urllib.request.urlopen(url + "/health") as r:
        return json.loads(r.read())


def wait_until(condition, seconds: float = 60) -> bool:
    """Poll condition until it holds (True) or seconds have passed (False): a property, not a timing."""
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


# --- devices: the tests that prove a path run on every device this machine has ---------------------

# CPU always; CUDA and MPS where present (an absent one is not collected). `bash .ci/gpu` selects the CUDA cases
# with -k cuda; on a CPU machine each such test is its CPU case alone, as before.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (
    ["mps"] if torch.backends.mps.is_available() else [])

# How far two computations of one value of order 1 may differ, by the precision they ran in. Stated once; a test
# takes max(its own CPU float32 bound, this) off the CPU (bound()), so that its CPU float32 case keeps its bound.
TOLERANCES = {
    "float32": 1e-4,  # float32 on another device: other tilings and split-K orders, 3xTF32 in fused attention
    "tf32": 5e-3,  # CUDA float32 matmuls in TF32 (runtime.open_device asks for "high"): 10-bit mantissa, 2^-11
    "float16": 5e-3,  # 10-bit mantissa: 2^-11 = 5e-4 per rounding, a few roundings deep, fp32 accumulation
    "bfloat16": 4e-2,  # 7-bit mantissa: 2^-8 = 4e-3 per rounding, a few roundings deep, fp32 accumulation
}


def bound(cpu_float32: float, device: str, dtype: str = "float32") -> float:
    """A test's bound on device in dtype: its own CPU float32 bound there, else at least TOLERANCES[dtype]."""
    if device == "cpu" and dtype == "float32":
        return cpu_float32
    return max(cpu_float32, TOLERANCES[dtype])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device this machine has, by name ("cpu", "cuda", "mps"). On CUDA, float32 matmuls run in IEEE float32
    during the test (TOLERANCES["float32"] holds for a model called directly), whatever an earlier test's
    runtime.open_device left set; a training script run inside the test turns TF32 on again ("tf32")."""
    if request.param != "cuda":
        yield request.param
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield request.param
    finally:
        torch.set_float32_matmul_precision(before)


def on_device(device: str, *flags) -> list[str]:
    """A tiny run's flags (after TINY_RUN) for device: on CUDA uncompiled (compile is its own test, in
    tests/test_devices.py), so that each run does not spend half a minute compiling."""
    if device == "cpu":
        return list(flags)  # TINY_RUN's device: the CPU case is the test as it was
    return [f"--device={device}", *(["--compile=False"] if device == "cuda" else []), *flags]


def repeatable(device: str, *flags) -> list[str]:
    """on_device(device, *flags), for runs compared bit for bit: on CUDA the math attention path, since the backward
    of SDPA's fused kernels adds with atomics in any order (unless torch.use_deterministic_algorithms)."""
    return on_device(device, *flags, *(["--flash=False"] if device == "cuda" else []))
