"""tools.py: the calculator gives Python's own arithmetic and refuses anything else; replies are taken apart into
think block, calls and the rest, broken calls counted; tool descriptions are checked and calls fitted to them; a
toolbox runs calls, errors as {"error"}, from the built-in tools or a user's file of typed functions."""
import dataclasses
import json
import re
import sys
import textwrap

import pytest
import torch

import tools
from conftest import run_script
from errors import ConfigError, DataError
from model import ModelConfig, Transformer
from reply import call_text, parse_reply
from tokenizer import load_tokenizer
from tools import calculate, call_problem, check_tools, load_toolbox

# -----------------------------------------------------------------------------
# the calculator

ARITHMETIC = ["1 + 2 * 3", "(1 + 2) * 3", "2 ** 3 ** 2", "-2 ** 2", "(-2) ** 2", "7 / 2", "7 // 2", "-7 // 2",
              "7 % 3", "-7 % 3", "7.5 % 2", "2 ** -1", "10 - 4 - 3", "100 / 10 / 5", "2 * 3 ** 2 // 4 % 5",
              "+3 - -4", "0.1 + 0.2", "1.5e3 * 2", "37 * 48", "(((1)))", "123456789 * 987654321", "2 ** 0.5",
              "8 // 3 * 3 + 8 % 3", "1 - 2 * (3 + 4) / 5 ** 2"]


@pytest.mark.parametrize("expression", ARITHMETIC)
def test_the_calculator_gives_pythons_arithmetic(expression):
    expected = eval(expression, {"__builtins__": {}})  # the oracle: Python on our own literal arithmetic
    assert calculate(expression) == expected
    assert tools.calculate_math(expression) == {"result": expected}


def test_the_calculator_reads_how_people_write_arithmetic():
    assert calculate("6×7") == 42 and calculate("9÷3") == 3 and calculate("2^10") == 2 ** 10
    assert calculate("（1+2）×3") == 9 and calculate("5−2") == 3


@pytest.mark.parametrize("expression", [
    "__import__('os')", "__import__('os').system('echo hi')", "os", "x + 1", "abs(-1)", "(1).real", "(1).__class__",
    "lambda: 1", "'a' * 3", "b'a'", "[1, 2]", "(1, 2)", "{1: 2}", "1 if 1 else 2", "1 < 2", "not 1", "~1", "1 & 3",
    "1 << 2", "True + 1", "1j", "(-8) ** 0.5", "f'{1}'", "1; 2", "x = 1", "", "1 +",
    "9**9**9", "10 ** 101", "2 ** 10000", "9" * 60 + " * " + "9" * 60, "1e308 * 10", "2**" * 300 + "1",
    "(" * 300 + "1" + ")" * 300, "-" * 999 + "1", "1 + " * 300 + "1"])
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_the_nesting_bound_is_the_calculators_own_not_the_recursion_limit():
    # torch.compile raises the process's recursion limit to 2000: a refusal that came from RecursionError went with it
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(ValueError, match="over 100 deep"):
            calculate("-" * 999 + "1")
    finally:
        sys.setrecursionlimit(limit)
    assert calculate("-" * 100 + "1") == 1 and calculate("2 + " * 100 + "2") == 202


def test_a_division_by_zero_is_the_callers_to_report():
    with pytest.raises(ZeroDivisionError):
        calculate("1 / (2 - 2)")
    assert json.loads(load_toolbox("calculate_math").run("calculate_math", {"expression": "1 % 0"})) == \
        {"error": "ZeroDivisionError: integer modulo by zero"}


def test_unit_conversion_and_time():
    run = load_toolbox("builtin").run
    assert json.loads(run("unit_converter", {"value": 5, "from_unit": "km", "to_unit": "m"}))["result"] == 5000
    assert json.loads(run("unit_converter", {"value": 212, "from_unit": "°F", "to_unit": "celsius"}))["result"] == 100
    assert json.loads(run("unit_converter", {"value": 0, "from_unit": "c", "to_unit": "k"}))["result"] == 273.15
    assert json.loads(run("unit_converter", {"value": 1, "from_unit": "mile", "to_unit": "feet"}))["result"] == 5280
    assert json.loads(run("unit_converter", {"value": 2, "from_unit": "磅", "to_unit": "kg"}))["result"] == 0.907185
    assert "error" in json.loads(run("unit_converter", {"value": 1, "from_unit": "km", "to_unit": "kg"}))
    now = json.loads(run("get_current_time", {}))
    assert now["timezone"] == "UTC" and len(now["datetime"]) == len("2024-01-01 00:00:00")
    assert "error" in json.loads(run("get_current_time", {"timezone": "Mars/Olympus"}))


# -----------------------------------------------------------------------------
# replies: think block, calls, the rest

CALC = {"name": "calculate_math", "arguments": {"expression": "37*48"}}


def test_a_well_formed_call_is_taken_out_of_the_content():
    reply = parse_reply(f"Let me compute.\n{call_text(CALC)}")
    assert reply.calls == [CALC] and reply.content == "Let me compute." and reply.malformed == 0
    assert reply.reasoning is None
    assert parse_reply('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').calls == \
        [{"name": "f", "arguments": {"x": 1}}]  # arguments as a JSON string, OpenAI's wire format
    assert parse_reply('<tool_call>{"name": "f"}</tool_call>').calls == [{"name": "f", "arguments": {}}]


def test_several_calls_come_in_the_order_written():
    second = {"name": "unit_converter", "arguments": {"value": 1, "from_unit": "km", "to_unit": "m"}}
    reply = parse_reply(f"{call_text(CALC)}\n{call_text(second)}\n{call_text(CALC)}")
    assert reply.calls == [CALC, second, CALC] and reply.content == "" and reply.malformed == 0


@pytest.mark.parametrize("block", [
    '{"name": "calculate_math", "arguments": ', "not json", '["calculate_math"]', '{"arguments": {}}',
    '{"name": "no spaces allowed", "arguments": {}}', '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": "{broken"}', '{"name": 7, "arguments": {}}'])
def test_a_block_that_is_not_a_call_stays_in_the_content_and_is_counted(block):
    text = f"Before <tool_call>\n{block}\n</tool_call> after"
    reply = parse_reply(text)
    assert reply.calls == [] and reply.malformed == 1 and reply.content == text


def test_an_unclosed_call_is_malformed_and_good_calls_beside_bad_ones_still_count():
    reply = parse_reply(f'{call_text(CALC)}\n<tool_call>\n{{"name": "calculate_math", "argum')
    assert reply.calls == [CALC] and reply.malformed == 1 and reply.content.startswith("<tool_call>")
    reply = parse_reply(f"<tool_call>oops</tool_call>{call_text(CALC)}")
    assert reply.calls == [CALC] and reply.malformed == 1 and reply.content == "<tool_call>oops</tool_call>"


def test_the_think_block_is_the_reasoning_and_its_calls_are_not_calls():
    reply = parse_reply(f"<think>\nI should multiply.\n</think>\n\n{call_text(CALC)}")
    assert reply.reasoning == "I should multiply." and reply.calls == [CALC] and reply.content == ""
    reply = parse_reply("It is 1776, I think.\n</think>\n\n1776")  # the generation prompt opened the block
    assert reply.reasoning == "It is 1776, I think." and reply.content == "1776" and reply.calls == []
    reply = parse_reply(f"<think>\nmaybe {call_text(CALC)}\n</think>\n\nNo call.")
    assert reply.calls == [] and reply.content == "No call." and reply.malformed == 0


# -----------------------------------------------------------------------------
# descriptions and how calls fit them

def described(name="f", **properties) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in properties.items()}, "required": list(properties)}}}


@pytest.mark.parametrize("tools_given, message", [
    ({"type": "function"}, "must be a list"),
    (["f"], r"tools\[0\] must be"),
    ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\] must be"),
    ([described(), {"type": "function", "function": {"name": "a b"}}], r"tools\[1\]\.function\.name"),
    ([described(), described()], r"tools\[1\]: a second function named 'f'"),
    ([{"function": {"name": "f", "parameters": {"type": "array"}}}], r"tools\[0\]\.function\.param"),
    ([{"function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}], r"tools\[0\]\.function\.param")])
def test_bad_descriptions_are_a_data_error_naming_the_entry(tools_given, message):
    with pytest.raises(DataError, match=message):
        check_tools(tools_given)


def test_a_call_fits_when_its_name_is_offered_and_its_arguments_have_the_types_described():
    functions = check_tools([described("calc", expression="string"),
                             described("convert", value="number", times="integer", exact="boolean")])
    assert call_problem({"name": "calc", "arguments": {"expression": "1+1"}}, functions) is None
    assert call_problem({"name": "convert", "arguments": {"value": 1, "times": 2, "exact": True}}, functions) is None
    assert call_problem({"name": "convert", "arguments": {"value": 1.5, "times": 2, "exact": False}}, functions) is None
    assert "unknown function 'web'" in call_problem({"name": "web", "arguments": {}}, functions)
    assert "missing argument 'expression'" in call_problem({"name": "calc", "arguments": {"expr": "1"}}, functions)
    for bad in ({"value": "1", "times": 2, "exact": True}, {"value": True, "times": 2, "exact": True},
                {"value": 1, "times": 2.5, "exact": True}, {"value": 1, "times": 2, "exact": 1}):
        assert "is not of type" in call_problem({"name": "convert", "arguments": bad}, functions)


# -----------------------------------------------------------------------------
# toolboxes

def test_the_built_in_toolboxes_and_unknown_names():
    assert list(load_toolbox("builtin").functions) == ["calculate_math", "unit_converter", "get_current_time"]
    toolbox = load_toolbox("unit_converter, calculate_math")
    assert list(toolbox.functions) == ["unit_converter", "calculate_math"]
    assert [s["function"]["name"] for s in toolbox.schemas] == list(toolbox.functions)
    for spec in ("calculate_math,web_search", "web_search, unit_converter"):
        with pytest.raises(ConfigError, match="unknown tool 'web_search'; choose from builtin, calculate_math"):
            load_toolbox(spec)
    with pytest.raises(ConfigError, match="cannot import web_search .* built-in tools are calculate_math"):
        load_toolbox("web_search")  # one name may be a module of the user's


def test_a_toolbox_reports_every_failure_as_an_error_object():
    run = load_toolbox("builtin").run
    for name, arguments in [("web_search", {"q": "x"}), ("calculate_math", {}), ("calculate_math", {"expr": "1"}),
                            ("calculate_math", {"expression": "__import__('os')"}),
                            ("unit_converter", {"value": "5", "from_unit": "km", "to_unit": "m"})]:
        result = json.loads(run(name, arguments))
        assert list(result) == ["error"] and isinstance(result["error"], str)


def test_a_users_file_of_typed_functions_is_a_toolbox(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        import os.path
        from os.path import join

        def lookup(city: str, days: int, metric: bool = True, scale: float = 1.0, tags: list = None) -> dict:
            """The weather in a city.

            A second paragraph the model does not need."""
            return {"city": city, "days": days, "metric": metric}

        def shout(text):
            return text.upper()

        def _helper():
            pass
        '''), encoding="utf-8")
    toolbox = load_toolbox(str(path))
    assert list(toolbox.functions) == ["lookup", "shout"]  # not _helper, not what it imports
    lookup = toolbox.schemas[0]["function"]
    assert lookup["description"] == "The weather in a city."
    assert lookup["parameters"] == {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "tags": {"type": "array"}}}
    assert toolbox.schemas[1]["function"]["parameters"]["properties"] == {"text": {"type": "string"}}
    assert json.loads(toolbox.run("lookup", {"city": "Oslo", "days": 2})) == {"city": "Oslo", "days": 2, "metric": True}
    assert toolbox.run("shout", {"text": "hi"}) == "HI"  # a string result is the text itself
    assert list(json.loads(toolbox.run("lookup", {"city": "Oslo"}))) == ["error"]


def test_a_users_tools_list_and_what_cannot_be_a_tool(tmp_path):
    listed = tmp_path / "listed.py"
    listed.write_text("def a(x: int):\n    return x\n\ndef b(y: str):\n    return y\n\nTOOLS = [b]\n", encoding="utf-8")
    assert list(load_toolbox(str(listed)).functions) == ["b"]
    variadic = tmp_path / "variadic.py"
    variadic.write_text("def f(*args):\n    return args\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"\*args"):
        load_toolbox(str(variadic))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="defines no functions"):
        load_toolbox(str(empty))
    with pytest.raises(ConfigError, match="cannot import"):
        load_toolbox(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="not the functions given"):
        tools.Toolbox([tools.calculate_math], [described("other", x="string")])


# -----------------------------------------------------------------------------
# numbers JSON cannot carry, powers by the size of their result, a tools file that fails as it is imported

def strict_json(text: str):
    """json.loads as a strict client parses: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("expression", ["1e999", "-1e999", "1e999 - 1e999", "1e999 * 0", "0 * 1e400", "1e101",
                                        "9" * 400 + " ** -1", "9" * 400 + " / 3"], ids=lambda e: e[:16])
def test_numbers_too_large_or_not_finite_are_refused(expression):
    with pytest.raises(ValueError, match="too large"):
        calculate(expression)
    result = strict_json(load_toolbox("calculate_math").run("calculate_math", {"expression": expression}))
    assert list(result) == ["error"] and "too large" in result["error"]


@pytest.mark.parametrize("expression", ["10 ** -400", "2 ** -1074", "2 ** -1075", "0.5 ** 2000", "10 ** -5",
                                        "(-2) ** -3", "(-10) ** -401", "0.1 ** 400", "1 ** 1000000", "(-1) ** 1000001",
                                        "0 ** 0", "0 ** 5", "10 ** 100", "2 ** 332", "1.5 ** -1000"])
def test_a_power_is_refused_only_when_its_result_is_large(expression):
    expected = eval(expression, {"__builtins__": {}})  # the oracle: Python on our own literal arithmetic
    assert calculate(expression) == expected and abs(expected) <= tools.MAX_MAGNITUDE
    assert strict_json(tools.Toolbox([tools.calculate_math]).run("calculate_math", {"expression": expression})) == \
        {"result": expected}


@pytest.mark.parametrize("expression", ["0.5 ** -2000", "(-0.5) ** -2001", "10 ** 400", "2 ** 333", "1.0000001 ** 1e20",
                                        "0.001 ** -34", "9 ** 9 ** 9"])
def test_a_power_whose_result_is_large_is_refused(expression):
    with pytest.raises(ValueError, match="too large"):
        calculate(expression)


def test_zero_to_a_negative_power_is_a_division_by_zero_reported_as_ever():
    for expression in ("0 ** -1", "0.0 ** -0.5", "(1 - 1) ** -2"):
        with pytest.raises(ZeroDivisionError):
            calculate(expression)
    assert strict_json(load_toolbox("calculate_math").run("calculate_math", {"expression": "0 ** -1"})) == \
        {"error": "ZeroDivisionError: 0.0 cannot be raised to a negative power"}


def test_a_tool_result_json_cannot_carry_is_an_error_object_in_strict_json():
    def nan() -> float:
        return float("nan")

    def infinite() -> dict:
        return {"result": [1.0, float("-inf")]}

    def a_set() -> dict:
        return {"result": {1, 2}}

    def fine() -> dict:
        return {"result": 0.5, "text": "中文"}

    toolbox = tools.Toolbox([nan, infinite, a_set, fine])
    for name, why in [("nan", "not finite"), ("infinite", "not finite"), ("a_set", "set is not JSON serializable")]:
        result = strict_json(toolbox.run(name, {}))
        assert list(result) == ["error"] and name in result["error"] and why in result["error"]
    assert toolbox.run("fine", {}) == '{"result": 0.5, "text": "中文"}'


@pytest.mark.parametrize("source, line, error", [
    ("def f(x: int):\n    return x\n\ndef g(:\n    pass\n", 4, "SyntaxError"),
    ("import os\nVALUE = undefined_name\n", 2, "NameError: name 'undefined_name' is not defined"),
    ("import os\nimport no_such_module_here\n", 2, "ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("x = 1\nraise RuntimeError('not configured')\n", 2, "RuntimeError: not configured")],
    ids=["syntax", "name", "import", "raise"])
def test_a_tools_file_that_fails_as_it_is_imported_is_a_config_error_naming_file_and_line(tmp_path, source, line,
                                                                                          error):
    path = tmp_path / "my_tools.py"
    path.write_text(source, encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"tools: importing {path} failed at {path}:{line}: {error}")):
        load_toolbox(str(path))


def test_sample_with_a_tools_file_that_does_not_parse_is_one_error_line(tmp_path):
    tok = load_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=512,
                                    vocab_size=tok.vocab_size))
    ckpt = tmp_path / "chat.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "stage": "sft",
                "config": {"tokenizer_path": None}, "tokenizer": {"fingerprint": tok.fingerprint}}, ckpt)
    broken = tmp_path / "broken_tools.py"
    broken.write_text("def add(a: int, b: int):\n    return a + b\n\ndef oops(\n", encoding="utf-8")
    result = run_script("sample.py", f"--ckpt={ckpt}", f"--tools={broken}", "--prompt=hi", "--device=cpu",
                        "--max_new_tokens=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: tools: importing {broken} failed at {broken}:4: SyntaxError: '(' was never closed"]
