"""One command-line convention for every script: `python X.py [words] [--key=value ...]`, --help lists the keys
and exits 0, a mistake (an unknown key, a key and its value as two words) is one `error:` line and exit status 2."""
import glob
import os

import pytest

import convert
import eval_demo
import plot
import prepare_demo
import sample
import serve
import train_tokenizer
from conftest import REPO, run_script
from errors import ConfigError

SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*.py"))
                 if 'if __name__ == "__main__"' in open(p, encoding="utf-8").read())


def test_the_scripts_are_found():
    assert {"train_pretrain.py", "train_grpo.py", "train_ppo.py", "sample.py", "serve.py", "convert.py", "plot.py",
            "prepare_demo.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS + ["vocab/nanomind/make_corpus.py"])
def test_every_script_answers_help_and_an_unknown_key_is_one_error_line(script):
    shown = run_script(script, "--help")
    assert shown.returncode == 0 and "--" in shown.stdout and "Traceback" not in shown.stderr, shown.stderr[-2000:]
    wrong = run_script(script, "--nope=1")
    assert wrong.returncode == 2, wrong.stderr[-2000:]
    (line,) = wrong.stderr.strip().splitlines()
    assert line.startswith("error:"), line


@pytest.mark.parametrize("main, argv", [
    (plot.main, ["out/run", "--out", "plots"]),
    (eval_demo.main, ["a.pt", "--show", "5"]),
    (prepare_demo.main, ["--out_dir", "data/x"]),
    (train_tokenizer.main, ["a.txt", "--out", "tok"]),
    (sample.main, ["--ckpt", "a.pt"]),
    (serve.main, ["--ckpt", "a.pt"]),
    (convert.main, ["export", "a.pt", "hf/", "--dtype", "float16"]),
])
def test_a_key_and_its_value_as_two_words_says_to_write_key_equals_value(main, argv):
    key = next(a for a in argv if a.startswith("--"))
    with pytest.raises(ConfigError, match=f"^expected --key=value, got '{key}': write {key}=VALUE"):
        main(argv)


@pytest.mark.parametrize("main, argv, message", [
    (plot.main, ["--out=plots"], "usage: python .* RUN... .*: name at least one run"),
    (eval_demo.main, [], "name at least one checkpoint"),
    (train_tokenizer.main, ["a.txt"], "--out=DIR"),
    (sample.main, ["--prompt=hi"], "needs --ckpt=PATH"),
    (serve.main, ["--port=0"], "needs --ckpt=PATH"),
    (convert.main, ["export", "a.pt"], r"\{import\|export\|merge\} SRC OUT .*; got export a.pt"),
    (convert.main, ["merge", "a.pt", "b.pt", "--force"], "merge takes no --force"),
    (convert.main, ["export", "a.pt", "hf/", "--n_heads=8"], "export takes no --n_heads"),
    (convert.main, ["import", "a.pth", "b.pt", "--stage=rl"], "config key 'stage' must be pretrain, sft or dpo"),
    (sample.main, ["--ckpt=a.pt", "--dtype=float8"], "config key 'dtype' must be auto"),
    (serve.main, ["--ckpt=a.pt", "--max_batch=0"], "--max_batch, --max_body_kb and --max_connections"),
])
def test_missing_words_or_keys_and_keys_of_another_command_are_config_errors(main, argv, message):
    with pytest.raises(ConfigError, match=message):
        main(argv)


def test_serve_takes_allowed_hosts_as_a_list_and_text_for_a_str_key():
    args = serve.parse_args(["--ckpt=a.pt", "--allowed_hosts=myhost.lan,other.lan", "--api_key=12345"])
    assert args.allowed_hosts == ["myhost.lan", "other.lan"] and args.api_key == "12345"
    assert serve.parse_args(["--ckpt=a.pt"]).allowed_hosts == []
