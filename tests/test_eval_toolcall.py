"""eval.py toolcall: its figures equal a hand count over conversations whose every turn is scripted (a fake model
behind the real tools.converse); a list gt needs every item in the answer; a record offering a tool that --tools
cannot run is one error line, and a user's tools module runs it."""
import dataclasses
import json
import re

import pytest
import torch

import eval as ev
import tokenizer as tk
import tools
from chat import encode_pieces, markup
from conftest import run_script
from errors import ConfigError
from model import ModelConfig, Transformer
from tasks import toolcall
from tokenizer import load_tokenizer

CPU = ["--device=cpu", "--dtype=float32"]


def function(name: str, **types) -> dict:
    """A tool description as MiniMind's data writes it: every argument required."""
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in types.items()}, "required": list(types)}}}


CALC = function("calculate_math", expression="string")
UNITS = function("unit_converter", value="number", from_unit="string", to_unit="string")


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# question -> (the tools offered, the reference, the model's turns: the last one repeats)
SCRIPT = {
    "What is 6 times 7?": ([CALC], {"gt": "42"}, [call("calculate_math", expression="6*7"), "6 times 7 is 42."]),
    "Weather in Paris?": ([CALC], {"answer": "sunny"}, [call("weather", city="Paris"), "I cannot tell."]),
    "What is 5 plus 7?": ([CALC], {"gt": ["12"]}, ["It is 12."]),
    "What is 2 plus 3?": (json.dumps([CALC]), {"gt": "5"},  # tools as a JSON string, as MiniMind stores them
                          ['<tool_call>\n{"name": "calculate_math", "arguments": \n</tool_call>']),
    "What is 1 plus 1?": ([CALC], {"gt": "2"}, [call("calculate_math", expr="1+1")]),
    "5 km in m, and where is the Louvre?": ([CALC, UNITS], {"gt": ["5000", "paris"]},
                                            [call("unit_converter", value="5", from_unit="km", to_unit="m"),
                                             "5,000 m; the Louvre is in PARIS."]),
    "What are 2+3 and 4*5?": ([CALC], {"gt": ["5", "20"]},
                              [call("calculate_math", expression="2+3") + "\n" + call("calculate_math",
                                                                                      expression="4*5"),
                               "They are 5 and 20."]),
    "What are 1+4 and 4*5 again?": ([CALC], {"gt": [5, 20]}, ["It is 5."]),
}


def record(question: str, tools_offered, reference: dict, answer: str | None = None) -> dict:
    conversations = [{"role": "system", "content": "You can use tools.", "tools": tools_offered},
                     {"role": "user", "content": question}]
    return {"conversations": conversations + ([{"role": "assistant", "content": answer}] if answer else [])} | reference


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return str(path)


def save_checkpoint(path, max_seq_len: int = 1024, tokenizer_path=None) -> str:
    """A random chat model's checkpoint, as far as eval.py reads one (the scripted model stands in for it)."""
    tok = load_tokenizer(tokenizer_path)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len,
                                    vocab_size=tok.vocab_size))
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "stage": "sft",
                "step": 0, "config": {"tokenizer_path": tokenizer_path, "batch_size": 1, "accum_steps": 1},
                "rng": [None], "tokenizer": {"path": tokenizer_path, "fingerprint": tok.fingerprint,
                                             "chat_template": tok.chat_template}}, path)
    return str(path)


def scripted_model(monkeypatch, script: dict) -> list[str]:
    """tools.converse's decoding replaced by a model that answers each question with its scripted turns (which
    turn: how many assistant turns its context holds); returns every context it read, as text."""
    tok = load_tokenizer()
    contexts = []

    def decode(model, rows):
        for row in rows:
            text = tok.decode(row.prompt)
            contexts.append(text)
            question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            turns = script[question][-1]
            reply = turns[min(text.count("<|im_start|>assistant"), len(turns)) - 1]
            row.tokens = encode_pieces(tok, [markup(reply)])[0] + [tok.eos_id]
            assert len(row.tokens) <= row.max_new
            row.finish_reason = "stop"
        return rows

    monkeypatch.setattr(tools, "decode", decode)
    return contexts


def test_the_figures_equal_a_hand_count(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "tool_eval.jsonl", [record(q, offered, ref, answer="dropped" if i == 2 else None)
                                                      for i, (q, (offered, ref, _)) in enumerate(SCRIPT.items())])
    contexts = scripted_model(monkeypatch, SCRIPT)
    section = ev.main(["toolcall", f"--ckpt={save_checkpoint(tmp_path / 'chat.pt')}", f"--data_path={data}", *CPU,
                       "--max_turns=3", "--max_new_tokens=96", "--batch_size=3", f"--out={tmp_path}"])
    # by hand, per question in SCRIPT's order:
    #   right:  6x7 yes, weather no, 5+7 yes, malformed no, 1+1 (out of turns) no, Louvre yes, 2+3/4*5 yes, 5 only no
    #   calls written (fitting): 1 (1), 1 (0: unknown name), 0, 0 + 1 malformed, 3 (0: 'expression' missing),
    #   1 (0: value is a string), 2 (2), 0
    #   turns: 2, 2, 1, 1, 3, 2, 2, 1
    assert section["records"] == 8
    assert section["answer_acc"] == 4 / 8
    assert section["called"] == 5 / 8
    assert (section["calls"], section["malformed"]) == (8, 1) and section["call_fit"] == 3 / 9
    assert section["mean_turns"] == 14 / 8
    assert section["unfinished"] == 1 / 8 and section["finish_reasons"] == {"stop": 7, "turns": 1}
    # the calls were run and their results read back
    assert any(f"<tool_response>\n{json.dumps({'result': 6 * 7})}\n</tool_response>" in c for c in contexts)
    assert any("<tool_response>\n{\"error\": \"unknown tool 'weather'" in c for c in contexts)
    assert section["samples"][0]["steps"] == [["call", 'calculate_math({"expression": "6*7"})'],
                                              ["result", '{"result": 42}'], ["answer", "6 times 7 is 42."]]
    assert section["samples"][2]["steps"] == [["answer", "It is 12."]]  # the record's own answer is not the prompt
    report = json.load(open(tmp_path / "report.json", encoding="utf-8"))
    assert report["sections"]["toolcall"]["answer_acc"] == 0.5
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Tool calling" in markdown and "| 50.0% |" in markdown and "*call:* calculate_math" in markdown


def test_a_list_gt_needs_every_item_a_number_by_value_and_text_ignoring_case():
    assert toolcall.answer_right("They are 5 and 20.", {"gt": ["5", "20"]})
    assert toolcall.answer_right("20.0, then 5", {"gt": [5, 20]})
    assert not toolcall.answer_right("It is 5.", {"gt": ["5", "20"]})
    assert not toolcall.answer_right("It is 205.", {"gt": ["5", "20"]})  # numbers, not digits
    assert toolcall.answer_right("<think>\nsunny?\n</think>\n\nBeijing: 1,000 km", {"gt": ["beijing", "1000"]})
    assert not toolcall.answer_right("<think>\nbeijing\n</think>\n\n1000 km", {"gt": ["beijing", "1000"]})
    assert toolcall.answer_right("The product is 1776.", {"answer": "1776"})


def test_a_tool_the_toolbox_cannot_run_is_one_error_line_unless_a_user_module_has_it(tmp_path, monkeypatch):
    weather = function("get_weather", city="string")
    data = write_jsonl(tmp_path / "tool_eval.jsonl", [record("What is 6 times 7?", [CALC], {"gt": "42"}),
                                                      record("Weather in Oslo?", [weather], {"gt": "rain"})])
    ckpt = save_checkpoint(tmp_path / "chat.pt")
    result = run_script("eval.py", "toolcall", f"--ckpt={ckpt}", f"--data_path={data}", *CPU)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {data}:2: the record offers the tool 'get_weather'")

    module = tmp_path / "my_tools.py"
    module.write_text("def get_weather(city: str) -> dict:\n    \"\"\"The weather in a city.\"\"\"\n"
                      "    return {'city': city, 'weather': 'rain'}\n", encoding="utf-8")
    contexts = scripted_model(monkeypatch, {"Weather in Oslo?": ([weather], {}, [call("get_weather", city="Oslo"),
                                                                                "Rain in Oslo."])})
    data = write_jsonl(tmp_path / "weather.jsonl", [record("Weather in Oslo?", [weather], {"gt": "rain in oslo"})])
    section = ev.main(["toolcall", f"--ckpt={ckpt}", f"--data_path={data}", f"--tools={module}", *CPU])
    assert '{"city": "Oslo", "weather": "rain"}' in contexts[-1]  # the user's function ran
    assert section["answer_acc"] == 1.0 and section["call_fit"] == 1.0


def test_an_inst_checkpoint_is_an_error(tmp_path):
    ckpt = save_checkpoint(tmp_path / "inst.pt", tokenizer_path=str(tk.NANOMIND_DIR))
    data = write_jsonl(tmp_path / "tool_eval.jsonl", [record("What is 6 times 7?", [CALC], {"gt": "42"})])
    with pytest.raises(ConfigError, match="cannot show tools"):
        ev.main(["toolcall", f"--ckpt={ckpt}", f"--data_path={data}", *CPU, f"--out={tmp_path}"])


def test_the_tiny_tool_model_on_its_own_questions_counted_by_hand(tiny_tools, demo_dir, tmp_path):
    """End to end on a model trained on the demo's calculator conversations, asked 8 of their questions: every call
    it writes is run by the calculator, and the figures are what its trajectories show."""
    with open(demo_dir / "tools_sft.jsonl", encoding="utf-8") as f:
        known = [json.loads(line) for line in list(f)[:8]]  # among the 64 it was trained on
    products = [tuple(map(int, re.findall(r"\d+", r["conversations"][1]["content"]))) for r in known]
    records = [{"conversations": r["conversations"][:2], "answer": str(a * b)} for r, (a, b) in zip(known, products)]
    data = write_jsonl(tmp_path / "tools_eval.jsonl", records)
    section = ev.main(["toolcall", f"--ckpt={tiny_tools}", f"--data_path={data}", "--max_new_tokens=48",
                       "--samples=8", *CPU, f"--out={tmp_path}"])
    right = called = 0
    for (a, b), sample in zip(products, section["samples"]):
        steps = dict(sample["steps"][:2])
        made = re.fullmatch(r'calculate_math\(\{"expression": "(\d+) ?\* ?(\d+)"\}\)', steps.get("call", ""))
        if made:  # the calculator ran on the numbers the model wrote
            called += 1
            assert steps["result"] == json.dumps({"result": int(made[1]) * int(made[2])})
        kind, last = sample["steps"][-1]
        numbers = re.findall(r"\d+(?:\.\d+)?", last.replace(",", ""))
        right += kind == "answer" and bool(numbers) and float(numbers[-1]) == a * b  # its last number, by value
    assert section["answer_acc"] == right / 8 and section["called"] >= called / 8
    assert called >= 6 and right >= 4  # it learned the task (the fixture's own bar: 12 of 16 right)
