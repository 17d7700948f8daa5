"""Records of any wrong shape: valid SFT, DPO (both formats) and RL prompt records with a random JSON value in one
field, in both chat templates, are either encoded or a BadRecord -- never another exception -- through the real
readers (the tokenising worker processes, read_prompts): with skip_bad the good ones are kept and the bad ones
counted, without it the first bad one names its file:line; a training script says so in one `error:` line."""
import copy
import dataclasses
import json
import random
import re

import pytest
import torch

import tokenizer as tk
from chat import encode_chat
from conftest import TINY_RUN, run_script
from data import prompt_of, read_prompts
from errors import BadRecord
from model import ModelConfig, Transformer
from token_cache import ENCODERS, parse_line, tokenize_file
from tokenizer import load_tokenizer

# --- valid records, each template's own -------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 6 times 7?"}
ANSWER = {"role": "assistant", "content": "It is 42."}
OTHER = {"role": "assistant", "content": "It is 41."}
TOOL = {"type": "function", "function": {"name": "calculate_math", "description": "Arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALL = {"name": "calculate_math", "arguments": {"expression": "6*7"}}
TOOL_TURNS = [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": '{"result": 42}'},
              {"role": "assistant", "content": "42.", "reasoning_content": "The tool said so."}]


def valid_records(kind: str, template: str) -> list[dict]:
    """Records that encode in the template: every field that a mutation may break is in one of them. JSON
    round-tripped: no two places share an object, as in a record read from a file."""
    return [json.loads(json.dumps(r)) for r in python_records(kind, template)]


def python_records(kind: str, template: str) -> list[dict]:
    chatml = template == "chatml"
    if kind == "sft":
        records = [{"conversations": [USER, ANSWER]}, {"conversations": [USER, ANSWER], "system": "Be brief."},
                   {"conversations": [SYSTEM, USER, ANSWER, {"role": "user", "content": "和7呢？"}, OTHER]}]
        if chatml:  # MiniMind's tool layout: tools on the system message, as values and as JSON text
            records += [{"conversations": [SYSTEM | {"tools": [TOOL]}, USER, *TOOL_TURNS]},
                        {"conversations": [SYSTEM | {"tools": json.dumps([TOOL])}, USER,
                                           TOOL_TURNS[0] | {"tool_calls": json.dumps([{"function": CALL}])},
                                           *TOOL_TURNS[1:]]}]
        return records
    if kind == "dpo":
        again = [USER, ANSWER, {"role": "user", "content": "和7呢？"}]
        records = [{"prompt": "What is 6 times 7?", "chosen": "42.", "rejected": "41."},
                   {"prompt": "What is 6 times 7?", "chosen": "42.", "rejected": "41.", "system": "Be brief."},
                   {"chosen": [SYSTEM, USER, ANSWER], "rejected": [SYSTEM, USER, OTHER]},
                   {"chosen": again + [ANSWER], "rejected": again + [OTHER], "system": "Be brief."}]
        if chatml:
            called = [SYSTEM | {"tools": [TOOL]}, USER, *TOOL_TURNS[:2]]
            records.append({"chosen": called + [ANSWER], "rejected": called + [OTHER]})
        return records
    records = [{"conversations": [USER, {"role": "assistant", "content": ""}], "gt": 42},  # MiniMind's rlaif.jsonl
               {"conversations": [SYSTEM, USER, ANSWER, USER], "answer": "42"},
               {"conversations": [USER], "answer": ["42", 6], "system": "Be brief."}]
    if chatml:
        records.append({"conversations": [SYSTEM | {"tools": [TOOL]}, USER], "answer": "42"})
    return records


# --- random JSON values, and records with one of them in one place -----------------------------------

STRINGS = ["", " ", "user", "assistant", "system", "tool", "function", "calculate_math", "hi", "中文", "<|im_end|>",
           "[INST]", "</s>", "{}", "[]", "null", "not json", "[[", '{"name": "f", "arguments": {}}', "[1, 2]",
           '[{"type": "function"}]', "6*7", "\ud800", "word " * 60]
NUMBERS = [0, 1, -1, 7, 2**70, 0.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf")]
KEYS = ["role", "content", "reasoning_content", "tool_calls", "tools", "name", "arguments", "function", "type",
        "parameters", "system", "x"]
MESSAGES = [SYSTEM, USER, ANSWER, SYSTEM | {"tools": [TOOL]}, *TOOL_TURNS]


def random_json(rng: random.Random, depth: int = 0):
    """A JSON value of any type: scalars, lists, objects, messages with one field wrong, lists of them, JSON text."""
    kind = rng.randrange(10 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(STRINGS)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return json.dumps(random_json(rng, depth + 1))  # JSON text: tools and tool_calls may be given so
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 5:
        return {rng.choice(KEYS): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind in (6, 7):
        return near_message(rng, depth)
    messages = [copy.deepcopy(rng.choice(MESSAGES)) for _ in range(rng.randint(1, 4))]
    messages[rng.randrange(len(messages))] = near_message(rng, depth) if rng.random() < 0.7 else random_json(rng, 3)
    return messages


def near_message(rng: random.Random, depth: int) -> dict:
    """A valid message with one field of the wrong type, missing, or added."""
    message = copy.deepcopy(rng.choice(MESSAGES))
    key = rng.choice([*message, *KEYS])
    if key in message and rng.random() < 0.2:
        del message[key]
    else:
        message[key] = random_json(rng, depth + 1)
    return message


def paths(value, at=()):
    """Every place in a JSON value: () is the value itself, then each key or index, recursively."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for k, v in items:
        yield from paths(v, at + (k,))


def put(record: dict, at: tuple, value, delete: bool = False) -> dict:
    """A copy of record with value at the place `at` (a key or an index), or with that key or element deleted."""
    record = copy.deepcopy(record)
    parent = record
    for k in at[:-1]:
        parent = parent[k]
    if delete:
        del parent[at[-1]]
    else:
        parent[at[-1]] = value
    return record


def mutants(kind: str, template: str, per_place: int, seed: int) -> list[dict]:
    """Each valid record with a random value in each of its places (per_place draws), the place deleted, or a key
    added to it where it is an object; JSON round-tripped, as a reader sees them. A DPO pair's shared prompt
    messages change alike in 'chosen' and 'rejected', so that the change reaches the chat template."""
    rng, out = random.Random(seed), []
    for record in valid_records(kind, template):
        for at in list(paths(record))[1:]:
            shared = at[0] == "chosen" and len(at) > 1 and isinstance(record["chosen"], list) \
                and at[1] < len(record["chosen"]) - 1
            places = [at, ("rejected", *at[1:])] if shared else [at]

            def change(value=None, delete=False, key=()):
                changed = record
                for place in places:
                    changed = put(changed, place + key, value, delete)
                return changed

            out += [change(random_json(rng)) for _ in range(per_place)]
            out.append(change(delete=True))
            target = record
            for k in at:
                target = target[k]
            if isinstance(target, dict):
                out.append(change(random_json(rng), key=(rng.choice(KEYS),)))
        out += [put(record, (rng.choice(KEYS),), random_json(rng)) for _ in range(per_place)]
    return [json.loads(json.dumps(r)) for r in out]


# --- one record at a time, then the real readers --------------------------------------------------

TEMPLATES = {"llama2": tk.NANOMIND_DIR, "chatml": tk.DEFAULT_DIR}
OPTIONS = {"sft": {"max_len": 512}, "dpo": {"max_prompt_length": 256, "max_completion_length": 256}}
RL_MAX_PROMPT = 512


def encoder(kind: str, tok):
    if kind == "rl":
        return lambda record: prompt_of(record, tok, RL_MAX_PROMPT, True, "here").ids
    return lambda record: ENCODERS[kind](tok, record, **OPTIONS[kind])[0]


def outcomes(kind: str, tok, records: list[dict]) -> list:
    """Each record's arrays (None: encoded, but nothing to learn fits) or its BadRecord; anything else fails the test
    naming the record."""
    encode, out = encoder(kind, tok), []
    for record in records:
        try:
            out.append(encode(record))
        except BadRecord as e:
            out.append(e)
        except Exception as e:  # noqa: BLE001 -- the property: nothing but BadRecord
            pytest.fail(f"{type(e).__name__}: {e} on the record {json.dumps(record)[:400]}")
    return out


def write_lines(path, records: list[dict]) -> str:
    """records as JSONL, ASCII-escaped (a lone surrogate is a valid JSON escape, not UTF-8)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("kind", ["sft", "dpo", "rl"])
def test_a_record_of_any_shape_encodes_or_is_a_bad_record_skipped_and_counted(kind, template, tmp_path, capsys):
    tok = load_tokenizer(TEMPLATES[template])
    good = outcomes(kind, tok, valid_records(kind, template))
    assert not [r for r in good if isinstance(r, BadRecord) or r is None], good  # the starting points are valid
    records = mutants(kind, template, per_place=8, seed=sum(map(ord, kind + template)))
    results = outcomes(kind, tok, records)
    bad = [i for i, r in enumerate(results) if isinstance(r, BadRecord)]
    kept = [r for r in results if not isinstance(r, BadRecord) and r is not None]
    assert len(records) > 300 and 0.1 < len(bad) / len(records) < 0.95  # both outcomes are well exercised

    # the real reader, skipping: the records that encoded, exactly as one at a time; the rest counted
    path = write_lines(tmp_path / "mixed.jsonl", records)
    if kind == "rl":
        prompts = read_prompts(path, tok, RL_MAX_PROMPT, need_reference=True, skip_bad=True)
        assert [p.ids for p in prompts] == kept
        skipped = re.findall(r"; skipped (\d+) x ", capsys.readouterr().out)
    else:
        cached = tokenize_file(path, tok, kind, skip_bad=True, processes=2, **OPTIONS[kind])
        assert [[a.tolist() for a in cached[i]] for i in range(len(cached))] == [[a.tolist() for a in r] for r in kept]
        skipped = re.findall(r"; (\d+) x skipped: ", capsys.readouterr().err)
    assert sum(map(int, skipped)) == len(records) - len(kept)

    # not skipping: the first bad record stops the reader, named by file:line and its reason
    first = bad[0]
    expected = rf"^{re.escape(path)}:{first + 1}: {re.escape(str(results[first]))}$"
    with pytest.raises(BadRecord, match=expected):
        if kind == "rl":
            read_prompts(path, tok, RL_MAX_PROMPT, need_reference=True, verbose=False)
        else:
            tokenize_file(path, tok, kind, processes=2, verbose=False, **OPTIONS[kind])


@pytest.mark.parametrize("line, reason", [
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="nested"),
    pytest.param('{"text": ' + "9" * 5000 + "}", "over 4300 digits", id="long_number"),
    pytest.param('{"tools": "' + "[" * 100_000 + '"}', None, id="nested_text")])
def test_json_that_python_cannot_read_is_a_bad_record(line, reason):
    if reason is not None:
        with pytest.raises(BadRecord, match=reason):
            parse_line(line.encode())
        return
    messages = [{"role": "system", "content": "s", "tools": parse_line(line.encode())["tools"]},
                {"role": "user", "content": "q"}]
    with pytest.raises(BadRecord, match="'tools' is not valid JSON"):
        encode_chat(load_tokenizer(tk.DEFAULT_DIR), messages)


# --- a training script -------------------------------------------------------------------------------

def tiny_checkpoint(path) -> str:
    """A random tiny model that names no tokenizer: it fine-tunes with nanomind's own ([INST] template)."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      vocab_size=load_tokenizer(tk.NANOMIND_DIR).vocab_size, max_seq_len=64)
    torch.save({"model": Transformer(cfg).state_dict(), "model_config": dataclasses.asdict(cfg),
                "config": {"tokenizer_path": None}, "stage": "pretrain"}, path)
    return str(path)


def test_train_sft_names_the_bad_line_in_one_error_line_or_skips_and_counts_it(tmp_path):
    good = [{"conversations": [{"role": "user", "content": f"What is {a} plus 1?"},
                               {"role": "assistant", "content": f"It is {a + 1}."}]} for a in range(40)]
    bad = [{"conversations": "hello"}, {"conversations": {"role": "user"}}, {"conversations": ["hi", "there"]},
           {"conversations": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
           {"conversations": [{"role": ["user"], "content": "q"}, {"role": "assistant", "content": "x"}]}]
    path = write_lines(tmp_path / "bad.jsonl", good[:7] + bad + good[7:])
    argv = ["train_sft.py", f"--init_from={tiny_checkpoint(tmp_path / 'tiny.pt')}", f"--data_path={path}",
            *TINY_RUN, "--max_steps=1", "--max_seq_len=64", "--batch_size=4"]
    failed = run_script(*argv, f"--out_dir={tmp_path / 'a'}")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {path}:8: 'conversations' must be a non-empty list of {{role, content}} messages, "
                      "got a string"], failed.stderr[-3000:]

    skipped = run_script(*argv, f"--out_dir={tmp_path / 'b'}", "--skip_bad=True")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    counts = re.findall(r"; (\d+) x skipped: ", skipped.stderr)
    assert f"{path}: 40 records" in skipped.stderr and sum(map(int, counts)) == 5, skipped.stderr[-3000:]
