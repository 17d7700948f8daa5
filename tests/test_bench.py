"""bench.py: each mode (training, generation, DPO, GRPO, data, serving, LoRA, MoE against dense, SFT packed against
padded) runs the real code and ends with a JSON row, MFU against the best peak sampled around each variant; --help,
and a user's mistake as one error line."""
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

import bench
import demo_data
import llamacpp_bench
from conftest import REPO, TINY_MODEL, tiny
from config import GRPOConfig
from errors import ConfigError
from model import Transformer
from runtime import Run, setup
from token_cache import encode_dpo
from tokenizer import load_tokenizer

TINY = [*TINY_MODEL, "--device=cpu", "--peak_flops=1e12"]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_parse_args_splits_bench_keys_flags_and_variants(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("dim = 64\n")
    settings, flags, variants = bench.parse_args([str(path), "--mode=dpo", "--batch_size=2", "--variants",
                                                  "dtype=bfloat16 flash=False", "", "--steps=4"])
    assert (settings.mode, settings.steps) == ("dpo", 4)
    assert flags == ["--dim=64", "--batch_size=2"]  # the file's settings first: flags override them
    assert variants == ["dtype=bfloat16 flash=False", ""]
    assert bench.parse_args(["--mode=dpo"])[2] == ["precompute_ref=False", "precompute_ref=True"]
    with pytest.raises(ConfigError, match="'learning_rate'"):
        bench.resolve("sft", ["--learning_rate=1"])


def test_train_mode_runs_the_real_script_and_ends_with_json(capsys):
    t0 = time.time()
    result = bench.main(["--mode=train", *TINY, "--batch_size=2", "--steps=3"])
    wall = time.time() - t0
    assert last_json(capsys) == json.loads(json.dumps(result))
    (row,) = result["rows"]
    # tokens/s (the script's log) times the step's duration (between two log rows) is the batch: 2 x 32 tokens
    assert row["tokens_per_s"] > 0 and row["mem_gb"] > 0 and row["tokens_per_step"] == pytest.approx(2 * 32)
    assert row["tokens_per_s_median"] <= row["tokens_per_s"]
    assert 6 * row["ms_per_step"] / 1000 < wall  # 3 warm-up and 3 timed steps ran within the bench's own run
    flops_per_token = Transformer(bench.resolve("train", TINY)[1]).flops_per_token(32)
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops_per_token / 1e12)  # TINY's --peak_flops=1e12
    assert row["mfu_median"] == pytest.approx(row["tokens_per_s_median"] * flops_per_token / 1e12)


def test_mfu_is_against_the_best_peak_sampled_before_and_after_every_variant(monkeypatch):
    samples = iter([1e12, 3e12, 2e12])  # before variant 1, after it (= before variant 2), after variant 2
    monkeypatch.setattr(bench, "measure_peak_flops", lambda device, dtype: next(samples))
    tiny = [a for a in TINY if not a.startswith("--peak_flops")]
    result = bench.main(["--mode=train", *tiny, "--batch_size=2", "--steps=1", "--peak_repeats=1",
                         "--variants", "", "accum_steps=2"])
    assert next(samples, None) is None and result["peak_flops"] == {"cpu/float32": 3e12}
    flops_per_token = Transformer(bench.resolve("train", tiny)[1]).flops_per_token(32)
    for row in result["rows"]:  # the first variant's script logged MFU against 1e12, the second's against 3e12
        assert row["peak_flops"] == 3e12
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops_per_token / 3e12)
        assert row["mfu_median"] == pytest.approx(row["tokens_per_s_median"] * flops_per_token / 3e12)


def test_an_epoch_ending_among_the_timed_steps_is_an_error(tmp_path):
    # 4 conversations, batches of 2: SFT evaluates after step 2, between the timed steps 3 and 4
    conversations = [{"conversations": [{"role": "user", "content": f"{i} + {i}?"},
                                        {"role": "assistant", "content": f"{2 * i}"}]} for i in range(4)]
    demo_data.write_jsonl(tmp_path / "sft.jsonl", conversations)
    with pytest.raises(RuntimeError, match=r"evaluated after step\(s\) \[0, 2, 4\].*steps 3\.\.4 were timed"):
        bench.main(["--mode=sft", *TINY, "--batch_size=2", "--steps=2", f"--data_path={tmp_path / 'sft.jsonl'}",
                    f"--val_data_path={tmp_path / 'sft.jsonl'}"])


def test_generate_mode_cached_and_recomputed(capsys):
    result = bench.main(["--mode=generate", *TINY, "--prompt_tokens=4", "--new_tokens=8"])
    assert [row["batch_size"] for row in last_json(capsys)["rows"]] == list(bench.GENERATE_BATCH_SIZES)
    assert all(row["decode_tokens_per_s_cache"] > 0 and row["cache_speedup"] > 0 for row in result["rows"])


def test_generation_reads_each_clock_after_the_device_has_finished(monkeypatch):
    """On a GPU the host queues kernels and runs ahead: a clock read without synchronising times the queueing."""
    events = []
    monkeypatch.setattr(bench, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: events.append("clock") or float(len(events)))
    run = Run(torch.device("cpu"), "float32")
    prefill, decode = bench.timed_generation(tiny().eval(), torch.tensor([[1, 2, 3]]), 4, True, run)
    assert events.count("clock") == 3 and all(events[i - 1] == "sync" for i, e in enumerate(events) if e == "clock")
    assert prefill > 0 and decode > 0


def test_dpo_mode_measures_both_reference_paths(capsys):
    result = bench.main(["--mode=dpo", *TINY, "--batch_size=2", "--steps=1"])
    rows = last_json(capsys)["rows"]
    assert [row["variant"] for row in rows] == ["precompute_ref=False", "precompute_ref=True"]
    assert all(row["tokens_per_s"] > 0 and 0 < row["frac_forward"] < 1 for row in result["rows"])


def test_grpo_mode_times_rollouts_the_step_split_and_a_group_against_one_by_one(capsys):
    result = bench.main(["--mode=grpo", *TINY, "--max_seq_len=64", "--batch_size=2", "--group_size=3",
                         "--max_new_tokens=6", "--steps=1", "--group_repeats=2"])
    (row,) = last_json(capsys)["rows"]
    assert row == json.loads(json.dumps(result["rows"][0]))
    assert 0 < row["rollout_tokens_per_s_median"] <= row["rollout_tokens_per_s"] and row["ms_per_step"] > 0
    assert row["frac_rollout"] + row["frac_reward"] + row["frac_update"] == pytest.approx(1.0)  # every phase
    assert 0 < row["completion_len"] <= 6 and row["mem_gb"] > 0
    assert row["group_tokens"] == row["one_by_one_tokens"] == 3 * 6  # no eos: every completion samples all 6
    assert row["group_tokens_per_s"] > 0 and row["one_by_one_tokens_per_s"] > 0
    assert row["group_speedup_min"] <= row["group_speedup"] <= row["group_speedup_max"]


def test_group_rollouts_take_turns_and_sample_as_many_tokens_either_way(monkeypatch):
    calls, real_rollout = [], bench.rollout

    def rollout(model, prompts, seeds, group_size, new_tokens, *rest):
        calls.append((group_size, new_tokens))
        return real_rollout(model, prompts, seeds, group_size, new_tokens, *rest)

    monkeypatch.setattr(bench, "rollout", rollout)
    cfg = GRPOConfig(group_size=8, max_new_tokens=12)
    measured = bench.group_rollouts(tiny().eval(), [5, 6, 7], cfg, Run(torch.device("cpu"), "float32"), rounds=3)
    assert measured["group_tokens"] == measured["one_by_one_tokens"] == 8 * 12
    # a short warm-up of each way, then together and one by one in turns
    assert calls == [(8, 8)] + [(1, 8)] * 8 + ([(8, 12)] + [(1, 12)] * 8) * 3
    assert measured["group_speedup_min"] <= measured["group_speedup"] <= measured["group_speedup_max"]


def test_data_mode_tokenises_a_file_and_times_the_loader(capsys):
    result = bench.main(["--mode=data", *TINY, "--batch_size=2", "--data_mb=0.05"])
    (row,) = last_json(capsys)["rows"]
    assert row["file_mb"] >= 0.05 and row["tokenise_mb_per_s_1proc"] > 0 and row["tokenise_mb_per_s_2proc"] > 0
    # each tokenisation ran in a process tree of its own: with 1 process that one alone (Python, numpy, the
    # tokenizer: tens of MB), with 2 it and its workers, each of which imports the caller first (more)
    assert 0.02 < row["tokenise_peak_gb_1proc"] < row["tokenise_peak_gb_2proc"] < 2.0
    assert row["loader_tokens_per_s"] == pytest.approx(row["loader_batches_per_s"] * 2 * 32)
    assert result["rows"][0] == row


def test_dpo_mode_fits_its_pairs_to_any_max_seq_len(capsys):
    # max_seq_len 48: train_dpo splits its 49 tokens into 24 for the prompt and 25 for an answer, and the synthetic
    # pairs must neither be cut by the split nor fall far short of it (the bench would time shorter sequences)
    flags = [*TINY, "--max_seq_len=48"]
    cfg, model_cfg = bench.resolve("dpo", flags)
    prompt_limit, completion_limit = 24, 25
    tok = load_tokenizer()
    pairs = [encode_dpo(tok, pair)[0] for pair in bench.Synthetic(tok).stage_data("dpo", cfg, model_cfg, 50)]
    assert all(len(p) <= prompt_limit and max(len(c), len(r)) <= completion_limit for p, c, r in pairs)
    assert max(len(p) + max(len(c), len(r)) for p, c, r in pairs) > 49 / 2
    (row,) = bench.main(["--mode=dpo", *flags, "--batch_size=2", "--steps=1", "--variants", "precompute_ref=True"])["rows"]
    assert row["tokens_per_s"] > 0 and 0 < row["frac_forward"] < 1
    with pytest.raises(ConfigError, match="max_prompt_length"):  # lengths the user sets are checked, not replaced
        bench.main(["--mode=dpo", *flags, "--max_prompt_length=30", "--max_completion_length=30", "--steps=1",
                    "--variants", "precompute_ref=True"])


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench.py", *args], cwd=REPO, capture_output=True, text=True)


def help_flags(text: str) -> set[str]:
    return {line.split()[0] for line in text.splitlines() if line.startswith("  --")}


def test_help_lists_bench_keys_and_the_stage_keys(capsys):
    done = run_script("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python bench.py")
    assert {"--steps=5", "--max_seq_len=512", "--lr=0.0005"} <= help_flags(done.stdout)  # bench's, model's, stage's
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--mode=dpo", "-h"])
    assert stopped.value.code == 0
    assert {"--steps=5", "--lr=5e-06", "--max_prompt_length=None"} <= help_flags(capsys.readouterr().out)


def test_a_user_mistake_is_one_error_line_and_exit_status_2_before_anything_runs(capsys):
    done = run_script("--bogus=1")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ") and "'bogus'" in done.stderr
    assert "Traceback" not in done.stderr
    for args, named in [(["--mode=sft", "--variants", "lr=1e-3", "lrr=2"], "'lrr'"), (["--mode=nope"], "'nope'"),
                        (["--mode=moe"], "n_experts > 0"), (["--mode=sft", "--lengths=skewed"], "'skewed'"),
                        (["--mode=moe", "--n_experts=4", "--variants", "", "n_experts=0"], "variant 'n_experts=0'")]:
        with pytest.raises(ConfigError, match=named):
            bench.main([*args, *TINY])
        assert capsys.readouterr().out == ""  # not even the first variant ran: a typo in the last costs no wait


def test_serve_mode_times_one_client_then_several_together():
    result = bench.main(["--mode=serve", *TINY, "--prompt_tokens=4", "--new_tokens=4", "--rounds=1", "--clients=3"])
    (row,) = result["rows"]
    assert row["clients"] == 3 and row["tokens_per_s_alone"] > 0
    assert row["ratio"] == pytest.approx(row["tokens_per_s_together"] / row["tokens_per_s_alone"])


def test_lora_mode_counts_trainable_parameters_and_sets_up_all_five_runs(monkeypatch, capsys):
    # the five runs are run_stage's (tested above through the real scripts); here: what each is given
    given = []
    monkeypatch.setattr(bench, "run_stage", lambda b, flags, tmp, *_: given.append((b.mode, flags, tmp)) or [
        {"tokens_per_s": 1.0, "tokens_per_s_median": 1.0, "ms_per_step": 1.0, "mem_gb": 1.0}])
    rows = bench.main(["--mode=lora", *TINY, "--batch_size=4", "--lora_rank=2"])["rows"]
    assert [row["run"] for row in rows] == ["sft full", "sft LoRA", "dpo full, reference model",
                                            "dpo LoRA, reference model", "dpo LoRA, adapters-off reference"]
    # TINY_MODEL: dim 32, 2 layers, kv dim 16, ffn 128; rank 2 on wq, wo (32 -> 32), wk, wv (32 -> 16),
    # w1, w3 (32 -> 128), w2 (128 -> 32): 2 * (2 * 64 + 2 * 48 + 3 * 160) per layer, x 2 layers
    assert [row["trainable_params"] for row in rows[1:2] + rows[3:]] == [2 * 2 * (2 * 64 + 2 * 48 + 3 * 160)] * 3
    assert rows[0]["trainable_params"] == rows[2]["trainable_params"] == Transformer(
        bench.resolve("sft", TINY)[1]).num_params()
    assert [mode for mode, _, _ in given] == ["sft", "sft", "dpo", "dpo", "dpo"]
    assert ["--lora_rank=2" in flags for _, flags, _ in given] == [False, True, False, True, True]
    assert all(flags[len(given[0][1])] == "--batch_size=2" for _, flags, _ in given[2:])  # pairs: 4 sequences
    (ref,) = [f for _, flags, _ in given for f in flags if f.startswith("--ref_from=")]  # the 4th run's only
    assert ref == f"--ref_from={given[3][2]}/init.pt" and ref in given[3][1]


def test_a_stage_run_leaves_the_flags_it_was_given_as_they_were(tmp_path):
    """mode=moe gives the same flags to every round: a run that appended its own (its data, its out_dir, the peak
    it logged against) would hand them on to the next."""
    flags = [*TINY, "--batch_size=2"]
    synth = bench.Synthetic(load_tokenizer())
    bench.run_stage(bench.Bench(steps=1), flags, str(tmp_path), synth, lambda *args, **kwargs: 1e12)
    assert flags == [*TINY, "--batch_size=2"]


MOE = ["--n_experts=4", "--experts_per_token=2", "--moe_ffn_dim=48"]


def test_moe_mode_times_the_model_with_experts_and_its_dense_counterpart(capsys):
    result = bench.main(["--mode=moe", *TINY, *MOE, "--batch_size=2", "--steps=1", "--rounds=1"])
    moe, dense = last_json(capsys)["rows"]
    assert (moe["model"], dense["model"]) == ("moe", "dense") and result["rows"] == [moe, dense]
    # the dense counterpart: one SwiGLU of 2 x 48, as wide as a token's two experts together
    assert dense["params"] == dense["active_params"] == Transformer(
        bench.resolve("train", [*TINY, "--ffn_dim=96"])[1]).num_params()
    assert moe["active_params"] == dense["params"] + 2 * 32 * 4  # + each layer's router (dim x n_experts)
    assert moe["params"] == moe["active_params"] + 2 * 2 * 3 * 32 * 48  # + each layer's two idle experts
    assert all(row["tokens_per_s"] > 0 and row["mem_gb"] > 0 for row in (moe, dense))
    # one round: its ratios are the two rows'; MFU counts the experts a token ran (TINY's --peak_flops=1e12)
    assert moe["vs_dense"] == moe["vs_dense_min"] == pytest.approx(moe["tokens_per_s"] / dense["tokens_per_s"])
    assert moe["mem_vs_dense"] == pytest.approx(moe["mem_gb"] / dense["mem_gb"]) and dense["vs_dense"] == 1.0
    flops_per_token = Transformer(bench.resolve("train", [*TINY, *MOE])[1]).flops_per_token(32)
    assert moe["mfu"] == pytest.approx(moe["tokens_per_s"] * flops_per_token / 1e12)


def test_moe_mode_runs_the_two_models_in_turns_and_takes_each_rounds_ratio(monkeypatch):
    speeds, given = iter([30.0, 10.0, 20.0, 10.0, 60.0, 20.0]), []  # (moe, dense) per round: ratios 3, 2, 3

    def run_stage(b, flags, *_):
        given.append((b.mode, flags[len(TINY) + len(MOE):]))
        speed = next(speeds)
        return [{"tokens_per_s": speed, "tokens_per_s_median": speed / 2, "ms_per_step": 1000 / speed,
                 "mfu": speed / 100, "mem_gb": 1.0 + len(given) % 2, "frac_forward": 0.3, "frac_backward": 0.6,
                 "frac_optimizer": 0.1, "device": "cpu", "dtype": "float32", "peak_flops": 1e12, "peak_measured": False}]

    monkeypatch.setattr(bench, "run_stage", run_stage)
    moe, dense = bench.main(["--mode=moe", *TINY, *MOE, "--rounds=3"])["rows"]
    assert given == [("train", []), ("train", ["--n_experts=0", "--ffn_dim=96"])] * 3
    assert (moe["vs_dense"], moe["vs_dense_min"], moe["vs_dense_max"]) == (3.0, 2.0, 3.0)
    assert (moe["tokens_per_s"], moe["ms_per_step"], moe["tokens_per_s_median"]) == (60.0, 1000 / 60, 15.0)
    assert (moe["mfu"], moe["mfu_median"]) == (0.6, pytest.approx(0.15))  # the median's MFU against the same peak
    assert (dense["tokens_per_s"], dense["tokens_per_s_median"], dense["vs_dense_max"]) == (20.0, 5.0, 1.0)
    assert (moe["mem_gb"], dense["mem_gb"], moe["mem_vs_dense"]) == (2.0, 1.0, 2.0) and moe["frac_backward"] == 0.6


def test_lognormal_conversations_are_mostly_short_with_a_tail_and_fill_the_packed_rows_too():
    synth = bench.Synthetic(load_tokenizer())
    assert bench.parse_args(["--mode=pack"])[0].lengths == "lognormal"  # the skew is what packing is measured on
    assert bench.parse_args(["--mode=sft"])[0].lengths == "uniform"  # the other modes' figures stay comparable
    conversations = synth.conversations(129, 100, "lognormal")  # max_seq_len 128
    lengths = [synth.length_of(c) for c in conversations]
    assert lengths == [synth.length_of(c, 129) for c in conversations]  # none too long: train_sft.py cuts none
    assert len(conversations) >= 100 and sum(n - 1 for n in lengths) >= 100 * 128  # they fill 100 packed rows
    assert max(lengths) <= 129 and 0.2 * 129 <= statistics.median(lengths) <= 0.32 * 129  # median ~ a quarter
    assert sum(n > 2 * statistics.median(lengths) for n in lengths) >= 0.1 * len(lengths)  # a long tail


def test_real_tokens_weigh_each_steps_padding_by_the_tokens_it_fed():
    steps = [({"tokens_per_s": 100.0, "pad_frac": 0.5}, 1.0), ({"tokens_per_s": 150.0, "pad_frac": 0.0}, 2.0)]
    measured = bench.real_tokens(steps)
    assert measured["pad_frac"] == pytest.approx(50 / 400) and measured["real_tokens_per_step"] == pytest.approx(175)
    assert (measured["real_tokens_per_s"], measured["real_tokens_per_s_median"]) == (150.0, 50.0)
    assert bench.real_tokens([({"tokens_per_s": 100.0}, 1.0)]) == {}  # a log without padding figures


def test_pack_mode_runs_padded_and_packed_sft_in_turns_on_one_file(capsys):
    result = bench.main(["--mode=pack", *TINY, "--max_seq_len=128", "--batch_size=2", "--steps=1", "--rounds=1"])
    padded, packed = last_json(capsys)["rows"]
    assert (padded["way"], packed["way"]) == ("padded", "packed") and result["rows"] == [padded, packed]
    for row in (padded, packed):  # one timed step: its real tokens/s are its tokens/s less the padding
        assert row["real_tokens_per_s_median"] == pytest.approx(row["tokens_per_s_median"] * (1 - row["pad_frac"]))
    # same batch_size in rows: packed rows of 128 hold several conversations, a padded row one
    assert packed["pad_frac"] < padded["pad_frac"] and packed["real_tokens_per_step"] > padded["real_tokens_per_step"]
    assert padded["vs_padded"] == 1.0 and packed["vs_padded"] == packed["vs_padded_min"] == pytest.approx(
        packed["real_tokens_per_s_median"] / padded["real_tokens_per_s_median"])


def test_the_gpu_check_runs_every_step_at_toy_sizes_and_reports_each(tmp_path):
    # the GPU check is run only when a GPU is lent (minutes, rarely): its steps must not first fail there
    env = {k: v for k, v in os.environ.items() if k != "GPU_BUDGET_S"}
    done = subprocess.run(["bash", ".ci/gpu", str(tmp_path)], cwd=REPO, env={**env, "GPU_DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(s["step"], s["rc"]) for s in report["steps"]] == [
        (name, "0") for name in ("devices", "shapes", "train", "sft", "generate", "serve")]
    assert report["tests"]["passed"] > 0 and not report["tests"]["failed"]
    assert report["shapes"]["decode_gqa_default"]["first_ms"] > 0
    assert [len(report["bench"][name]["rows"]) for name in ("train", "sft", "generate", "serve")] == [2, 2, 2, 1]
    assert "(no figures" not in (tmp_path / "report.md").read_text()


LLAMACPP = [*TINY, "--mode=llamacpp", "--prompt_tokens=4", "--new_tokens=8"]


def test_llamacpp_mode_times_nanomind_and_llama_cpp_in_turns_and_ends_with_the_ratio_line(capsys):
    result = bench.main([*LLAMACPP, "--rounds=2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-2]) == json.loads(json.dumps(result))  # the JSON, then the ratio line
    rows = {(row["engine"], row["streams"]): row for row in result["rows"]}
    assert list(rows) == [(engine, n) for n in (1, 8) for engine in ("nanomind", "llama.cpp float32", "llama.cpp q8_0")]
    for row in rows.values():
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "nanomind_vs"):
            assert 0 < row[f"{name}_min"] <= row[name] <= row[f"{name}_max"]
        assert row["threads"] == torch.get_num_threads() and 0 < row["same_tokens"] <= 1
    assert all(rows["nanomind", n]["nanomind_vs"] == rows["nanomind", n]["same_tokens"] == 1.0 for n in (1, 8))
    # llama.cpp's defaults (a float16 KV cache, flash attention) move the logits by ~5e-3: a near tie may go the
    # other way, and the rest of that stream with it (test_llama_cpp_driver_picks_nanomind_s_greedy_tokens: exactly)
    assert rows["llama.cpp float32", 1]["same_tokens"] >= 0.85 and rows["llama.cpp float32", 8]["same_tokens"] >= 0.85
    ratios = [rows["llama.cpp float32", n]["nanomind_vs"] for n in (1, 8)]
    assert lines[-1] == f"nanomind / llama.cpp decode tokens/s: 1 stream {ratios[0]:.2f}x, 8 streams {ratios[1]:.2f}x"
    assert re.fullmatch(r"nanomind / llama\.cpp decode tokens/s: 1 stream \d+\.\d\dx, 8 streams \d+\.\d\dx", lines[-1])


def test_llama_cpp_driver_picks_nanomind_s_greedy_tokens(tmp_path):
    """The bench's llama.cpp side (its batch of 8 sequences, their positions, the argmax of each) generates exactly
    what engine.generate does on the float32 file, with attention in float32 as nanomind's (exact: a float32 KV cache,
    no flash attention, which round to float16): the two time the same work. 8 random prompts, 12 new tokens each."""
    cfg, model_cfg = bench.resolve("llamacpp", TINY)
    run = setup("cpu", "float32", 0)
    model = llamacpp_bench.random_model(model_cfg)
    path = llamacpp_bench.export_files(model, str(tmp_path))["float32"]
    prompts = torch.randint(model_cfg.vocab_size, (8, 5), generator=torch.Generator().manual_seed(0)).tolist()
    lc = llamacpp_bench.llama_cpp_module()
    with contextlib.ExitStack() as stack:
        stack.enter_context(llamacpp_bench.quiet_llama_cpp())
        llama_model, _ = llamacpp_bench.load_llama_cpp(lc, path, False, stack)
        for n in (1, 8):
            _, _, ours = llamacpp_bench.nanomind_generate(model, run, prompts[:n], 12)
            llama = llamacpp_bench.LlamaCpp(lc, llama_model, n, 5, 17, 2, stack, exact=True)
            for _ in range(2):  # a second run on the same context: the first's sequences are gone
                prefill, decode, theirs = llama.generate(prompts[:n], 12)
                assert theirs == ours and prefill > 0 and decode > 0
    assert len({token for row in ours for token in row}) > 8  # not a model that repeats one token a stream


def test_in_turns_warms_up_then_takes_each_engine_in_turn_each_round():
    calls = []

    def engine(name):
        def generate_fn(prompts, new_tokens):
            calls.append((name, len(prompts), new_tokens))
            return 0.5, 2.0, [[1] * new_tokens for _ in prompts]
        return generate_fn

    engines = {(name, n): engine(name) for n in (1, 3) for name in ("nanomind", "other")}
    timed = llamacpp_bench.in_turns(engines, [[0, 0]] * 3, 9, rounds=2)
    assert calls == [("nanomind", 1, 4), ("other", 1, 4), ("nanomind", 3, 4), ("other", 3, 4)] + [
        ("nanomind", 1, 9), ("other", 1, 9), ("nanomind", 3, 9), ("other", 3, 9)] * 2
    assert timed["other", 3] == [(3 * 2 / 0.5, 3 * 8 / 2.0, [[1] * 9] * 3)] * 2  # prompt tokens/s, new tokens but one/s


def test_with_compile_the_ratios_and_the_last_line_are_the_compiled_engine_s():
    # decode seconds per round: eager 4, compiled 2, llama.cpp 1 (one stream) -> compiled / llama.cpp 0.5x
    timed = {(name, 1): [(1.0, 1 / seconds, [[7, 8]])] * 3 for name, seconds in
             (("nanomind", 4.0), ("nanomind compiled", 2.0), ("llama.cpp float32", 1.0))}
    rows = {row["engine"]: row for row in llamacpp_bench.rows_of(timed, llamacpp_bench.COMPILED)}
    assert rows["nanomind"]["nanomind_vs"] == 2.0 and rows["llama.cpp float32"]["nanomind_vs"] == 0.5
    assert llamacpp_bench.summary(list(rows.values())) == "nanomind compiled / llama.cpp decode tokens/s: 1 stream 0.50x"


@pytest.mark.parametrize("own_by_default", [True, False])
def test_the_other_compiled_engine_takes_the_product_kernels_the_default_does_not(monkeypatch, own_by_default):
    calls = []
    monkeypatch.setattr(llamacpp_bench, "own_kernels_by_default", lambda model: own_by_default)
    monkeypatch.setattr(llamacpp_bench, "compiled", lambda model, **kwargs: calls.append(kwargs) or model)
    other = llamacpp_bench.other_products(tiny())
    # inductor's kernels need frozen weights; the library's run as they are, as engine.compiled's default elsewhere
    expected = ("library", False) if own_by_default else ("inductor", True)
    assert list(other) == [f"nanomind compiled, {expected[0]} products"]
    assert calls == [{"freeze": expected[1], "gemm": expected[1]}]


def test_llamacpp_mode_without_llama_cpp_or_with_too_many_tokens_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed: import raises ImportError
    with pytest.raises(ConfigError, match=r"^mode=llamacpp needs llama-cpp-python .*: pip install llama-cpp-python$"):
        bench.main(LLAMACPP)
    with pytest.raises(ConfigError, match="max_seq_len=32"):  # TINY's
        bench.main([*LLAMACPP, "--new_tokens=40"])
