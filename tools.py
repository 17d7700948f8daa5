"""
Tool use: the tools that answer the calls a model writes (reply.py parses them), and the one loop that runs them
between turns -- a turn, its calls run, their results appended, the next turn.

    toolbox = load_toolbox("builtin")      # calculate_math, unit_converter, get_current_time; or a file.py / module
    toolbox.run("calculate_math", {"expression": "37*48"})    # -> '{"result": 1776}'
    converse(model, tokenizer, [(ids, messages, sampling)], toolbox, max_turns=3, max_new_tokens=64)
    take_turns(chats, toolbox, max_turns, side)     # the loop itself: converse's, and sample.py's chat

The calculator parses arithmetic with ast and evaluates the tree itself: numbers, + - * / // % **, parentheses
-- never eval, so nothing but arithmetic ever runs.
"""
import ast
import dataclasses
import datetime
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import traceback
import zoneinfo

from chat import tool_results_ids
from engine import Row, Sampling, answer_text, decode
from errors import ConfigError, DataError
from reply import NAME, Reply, parse_reply

# -----------------------------------------------------------------------------
# tool descriptions (OpenAI's function schema)

JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict, "array": list}


def check_tools(tools, where: str = "tools") -> dict[str, dict]:
    """OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}] -> {name: function};
    anything else is a DataError naming the entry and field."""
    if not isinstance(tools, list):
        raise DataError(f"{where} must be a list of {{type: function, function: {{name, parameters}}}}")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise DataError(f"{where}[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise DataError(f"{where}[{i}].function.name must be 1-64 letters, digits, _ or -; got {name!r}")
        if name in functions:
            raise DataError(f"{where}[{i}]: a second function named {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object" or \
                not isinstance(params.get("properties", {}), dict) or not isinstance(params.get("required", []), list):
            raise DataError(f"{where}[{i}].function.parameters must be a JSON schema of type object "
                            "(properties an object, required a list)")
        functions[name] = fn
    return functions


def call_problem(call: dict, functions: dict[str, dict]) -> str | None:
    """Why a parsed call does not fit the functions offered (unknown name, a required argument missing, an
    argument of the wrong JSON type), or None when it fits."""
    fn = functions.get(call["name"])
    if fn is None:
        return f"unknown function {call['name']!r}"
    params = fn.get("parameters") or {}
    missing = [k for k in params.get("required", []) if k not in call["arguments"]]
    if missing:
        return f"{call['name']}: missing argument {missing[0]!r}"
    for key, value in call["arguments"].items():
        kind = JSON_TYPES.get((params.get("properties", {}).get(key) or {}).get("type"))
        if kind and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            return f"{call['name']}: argument {key!r} is not of type {params['properties'][key]['type']}"
    return None


# -----------------------------------------------------------------------------
# built-in tools, with MiniMind's names and arguments (its tool-calling data and models use them)

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_MAGNITUDE = 1e100  # beyond this an answer is no use, and 9**9**9 would take the process's memory
MAX_DEPTH = 100  # operators nested deeper are refused by rule, not by whatever recursion limit the process has set
WRITTEN = {"×": "*", "÷": "/", "−": "-", "^": "**", "（": "(", "）": ")", "，": ","}  # how people write it


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; anything else (names, calls, attributes, strings) is a ValueError."""
    if len(expression) > 1000:
        raise ValueError("the expression is over 1000 characters")
    for written, python in WRITTEN.items():
        expression = expression.replace(written, python)
    expression = expression.strip()
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node, depth=0):
        if depth > MAX_DEPTH:
            raise ValueError(f"the expression nests operators over {MAX_DEPTH} deep")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if not abs(node.value) <= MAX_MAGNITUDE:  # 1e999 is inf (and inf - inf is nan): no answer, nor JSON
                written = ast.get_source_segment(expression, node) or ""
                raise ValueError(f"the number {written[:20]}{'...' * (len(written) > 20)} is too large (over 1e100)")
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
            return SIGNS[type(node.op)](value(node.operand, depth + 1))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left, depth + 1), value(node.right, depth + 1)
            # |left ** right| = 2 ** (right * log2|left|): only that exponent tells a huge power (9**9**9, 0.5**-2000)
            # from a tiny one (10**-400 is 0.0); 0 ** right is 0, 1 or a ZeroDivisionError
            if isinstance(node.op, ast.Pow) and left != 0 and right * math.log2(abs(left)) > 340:  # > 2**340
                raise ValueError("the result is too large")
            result = OPERATORS[type(node.op)](left, right)  # ZeroDivisionError is the caller's to report
            if isinstance(result, complex) or not abs(result) <= MAX_MAGNITUDE:  # not <=: NaN too
                raise ValueError("the result is too large or not a real number")
            return result
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")

    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() and abs(result) < 2**53 else result


def calculate_math(expression: str) -> dict:
    """Calculate an arithmetic expression, e.g. 37*48 or (2+3)**2.

    Numbers, + - * / // % ** and parentheses."""
    return {"result": calculate(expression)}


UNITS = {  # unit -> (kind, its size in the kind's base unit)
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mm": ("length", 0.001),
    "miles": ("length", 1609.344), "feet": ("length", 0.3048), "inches": ("length", 0.0254), "yards": ("length", 0.9144),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "pounds": ("mass", 0.45359237), "ounces": ("mass", 0.028349523125),
    "liters": ("volume", 1.0), "ml": ("volume", 0.001), "gallons": ("volume", 3.785411784),
}
UNIT_NAMES = {"mile": "miles", "mi": "miles", "foot": "feet", "ft": "feet", "inch": "inches", "in": "inches",
              "yard": "yards", "yd": "yards", "meter": "m", "meters": "m", "kilometer": "km", "kilometers": "km",
              "lb": "pounds", "lbs": "pounds", "pound": "pounds", "oz": "ounces", "ounce": "ounces", "l": "liters",
              "liter": "liters", "gallon": "gallons", "c": "celsius", "°c": "celsius", "f": "fahrenheit",
              "°f": "fahrenheit", "k": "kelvin", "公里": "km", "千米": "km", "米": "m", "厘米": "cm", "英里": "miles",
              "千克": "kg", "公斤": "kg", "克": "g", "磅": "pounds", "摄氏度": "celsius", "华氏度": "fahrenheit"}
TO_KELVIN = {"celsius": (1.0, 273.15), "fahrenheit": (5 / 9, 459.67 * 5 / 9), "kelvin": (1.0, 0.0)}  # k = a*x + b


def unit_converter(value: float, from_unit: str, to_unit: str) -> dict:
    """Convert a value from one unit to another, e.g. km to miles.

    Length (km, m, cm, mm, miles, feet, inches, yards), mass (kg, g, pounds, ounces), volume (liters, ml, gallons),
    temperature (celsius, fahrenheit, kelvin)."""
    a, b = (UNIT_NAMES.get(u.strip().lower(), u.strip().lower()) for u in (from_unit, to_unit))
    if a in TO_KELVIN and b in TO_KELVIN:
        (sa, oa), (sb, ob) = TO_KELVIN[a], TO_KELVIN[b]
        result = ((sa * value + oa) - ob) / sb
    elif a in UNITS and b in UNITS and UNITS[a][0] == UNITS[b][0]:
        result = value * UNITS[a][1] / UNITS[b][1]
    else:
        raise ValueError(f"cannot convert {from_unit!r} to {to_unit!r}")
    return {"result": round(result, 6), "unit": b}


def get_current_time(timezone: str = "UTC") -> dict:
    """The current date and time in a time zone, e.g. Asia/Shanghai (default UTC)."""
    try:
        now = datetime.datetime.now(zoneinfo.ZoneInfo(timezone))
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {timezone!r}") from None
    return {"datetime": now.strftime("%Y-%m-%d %H:%M:%S"), "weekday": now.strftime("%A"), "timezone": timezone}


BUILT_IN = [calculate_math, unit_converter, get_current_time]


# -----------------------------------------------------------------------------
# a toolbox: functions by name, with their descriptions

PYTHON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def schema_of(fn) -> dict:
    """A Python function -> its OpenAI description: the name, the docstring's first paragraph, and a parameter per
    argument (its annotation's JSON type; required when it has no default)."""
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(f"tool {fn.__name__}: *args and **kwargs cannot be described to a model")
        properties[p.name] = {"type": PYTHON_TYPES.get(p.annotation, "string")}
        if p.default is p.empty:
            required.append(p.name)
    description = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


class Toolbox:
    """Tools a model may call: {name: Python function}, each described by schema_of (or by the schema given)."""

    def __init__(self, functions: list, schemas: list[dict] | None = None):
        self.functions = {fn.__name__: fn for fn in functions}
        self.schemas = schemas if schemas is not None else [schema_of(fn) for fn in functions]
        described = check_tools(self.schemas, "the toolbox's tools")
        if set(described) != set(self.functions):
            raise ConfigError(f"the tools described ({', '.join(described)}) are not the functions given "
                              f"({', '.join(self.functions)})")

    def run(self, name: str, arguments: dict) -> str:
        """A call's result as the text the model reads (JSON): the function's return value, or {"error": ...}
        when the tool is unknown, its arguments do not fit, or it raises."""
        fn = self.functions.get(name)
        if fn is None:
            result = {"error": f"unknown tool {name!r}; the tools are {', '.join(self.functions)}"}
        else:
            try:
                result = fn(**arguments)
            except Exception as e:  # the model's mistake (a bad argument): it reads the error and may try again
                result = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(result, str):
            return result
        try:  # strict JSON: NaN and Infinity are not JSON, and OpenAI clients' parsers refuse them
            return json.dumps(result, ensure_ascii=False, allow_nan=False)
        except ValueError as e:
            why = "a number that is not finite (NaN or infinity)" if "Out of range float" in str(e) else str(e)
        except (TypeError, RecursionError) as e:  # a set, an object, nested too deeply
            why = str(e)
        return json.dumps({"error": f"{name} returned what JSON cannot carry: {why}"}, ensure_ascii=False)


def user_module(name: str):
    """'path/to/file.py' or an importable 'package.module' -> the module (a user's tools or rewards). One that is
    not there is an ImportError or OSError; one that fails as it runs (a syntax error, any exception) is a
    ConfigError naming the file and line where it failed."""
    try:
        if not name.endswith(".py"):
            return importlib.import_module(name)
        spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as e:
        where = failed_at(e)
        if where is None:  # nothing of the user's ran: the file or module is not there
            raise
        message = e.msg if isinstance(e, SyntaxError) else str(e)
        raise ConfigError(f"importing {name} failed at {where}: {type(e).__name__}: {message}") from None


def failed_at(e: Exception) -> str | None:
    """'file:line' where the user's code raised e as it was imported (for a syntax error, the line it is on), or
    None when no code of the user's ran."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f"{e.filename}:{e.lineno}"
    machinery = os.path.dirname(importlib.__file__)
    for frame in traceback.extract_tb(e.__traceback__):
        if not frame.filename.startswith(("<", machinery)) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno}"
    return None


def load_toolbox(spec: str) -> Toolbox:
    """'builtin' (all three), built-in names (calculate_math,unit_converter), a file.py or an importable module:
    its TOOLS list (functions) if it has one, else every public function it defines."""
    built_in = {fn.__name__: fn for fn in BUILT_IN}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    names = list(dict.fromkeys(b for n in names for b in (built_in if n == "builtin" else [n])))
    if all(n in built_in for n in names) and names:
        return Toolbox([built_in[n] for n in names])
    if len(names) != 1:
        unknown = next((n for n in names if n not in built_in), spec)
        raise ConfigError(f"tools: unknown tool {unknown!r}; choose from builtin, {', '.join(built_in)}, or a "
                          "file.py / module of your own functions")
    try:
        module = user_module(spec)
    except (ImportError, OSError) as e:
        raise ConfigError(f"tools: cannot import {spec} ({e}); built-in tools are {', '.join(built_in)}") from None
    except ConfigError as e:
        raise ConfigError(f"tools: {e}") from None
    functions = getattr(module, "TOOLS", None)
    if functions is None:
        functions = [f for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_")
                     and f.__module__ == module.__name__]
    if not functions or not all(callable(f) for f in functions):
        raise ConfigError(f"tools: {spec} defines no functions (or its TOOLS list holds something else)")
    return Toolbox(list(functions))


# -----------------------------------------------------------------------------
# the tool loop: a turn, its calls run, their results appended, the next turn, ...

def take_turns(chats: list, toolbox: Toolbox, max_turns: int, side) -> None:
    """Carry conversations on with tools, all at once, up to max_turns turns each. side says what a turn is and
    what each step leaves:
        side.write(chats) -> [(text, finish reason)]   a turn of every chat going on, generated together
        side.wrote(chat, text, reply)                   each turn, taken apart (reply.parse_reply)
        side.read(chat, reply, results) -> bool         the calls' results, in order: False when no room is left
        side.end(chat, reason, reply)                   "stop" or "length" (the turn's own, or no room left), or
                                                        "turns" (the last turn still calling; its calls never run)
    A turn that stops with calls has them run (toolbox.run, in order) and the chat goes on from their results."""
    for turn in range(max_turns):
        if not chats:
            break
        going_on = []
        for chat, (text, finish) in zip(chats, side.write(chats)):
            reply = parse_reply(text)
            side.wrote(chat, text, reply)
            if finish != "stop" or not reply.calls:
                side.end(chat, finish, reply)
            elif turn + 1 == max_turns:
                side.end(chat, "turns", reply)
            elif side.read(chat, reply, [toolbox.run(call["name"], call["arguments"]) for call in reply.calls]):
                going_on.append(chat)
            else:
                side.end(chat, "length", reply)
        chats = going_on


@dataclasses.dataclass
class Trajectory:
    """One conversation's turns after its prompt. ids alternate what the model wrote (a turn, its end-of-turn
    token included) and what it read (the tool results and the next generation prompt): generated marks which."""
    prompt: list[int]
    messages: list[dict]  # the prompt's messages, then each earlier turn (assistant + tool_calls) and its results
    ids: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)  # 1 on ids the model wrote, 0 on tool results
    text: str = ""  # the last turn's text: the answer, or calls the turns ran out for
    calls: int = 0  # calls run
    malformed: int = 0  # <tool_call> blocks over all turns that were not calls
    turns: int = 0
    finish_reason: str | None = None  # "stop" (answered), "length" (a turn or the context ran out), "turns"
    sampling: Sampling | None = dataclasses.field(default=None, repr=False, compare=False)  # how its turns draw


class DecodedTurns:
    """converse's side of take_turns: Trajectory chats, each turn decoded with the others' (engine.decode) and
    the results appended as ids, so the ids are the ones the model wrote and read."""

    def __init__(self, model, tokenizer, max_new_tokens: int, thinking: bool):
        self.model, self.tokenizer, self.max_new_tokens, self.thinking = model, tokenizer, max_new_tokens, thinking
        self.max_len = model.config.max_seq_len

    def write(self, chats: list[Trajectory]) -> list[tuple[str, str]]:
        rows = []
        for t in chats:
            context = t.prompt + t.ids
            rows.append(Row(context, min(self.max_new_tokens, self.max_len - len(context)), t.sampling,
                            self.tokenizer.eos_id))
        decode(self.model, rows)
        for t, row in zip(chats, rows):
            t.ids += row.tokens
            t.generated += [1] * len(row.tokens)
            t.turns += 1
        return [(answer_text(self.tokenizer, row), row.finish_reason) for row in rows]

    def wrote(self, t: Trajectory, text: str, reply: Reply):
        t.text = text
        t.malformed += reply.malformed

    def read(self, t: Trajectory, reply: Reply, results: list[str]) -> bool:
        more = tool_results_ids(self.tokenizer, results, self.thinking)
        if len(t.prompt) + len(t.ids) + len(more) >= self.max_len:  # no room left to answer
            return False
        t.messages += [reply.as_message()] + [{"role": "tool", "content": r} for r in results]
        t.ids += more
        t.generated += [0] * len(more)
        t.calls += len(reply.calls)
        return True

    def end(self, t: Trajectory, reason: str, reply: Reply):
        t.finish_reason = reason


def converse(model, tokenizer, prompts: list[tuple], toolbox: Toolbox, max_turns: int, max_new_tokens: int,
             thinking: bool = False) -> list[Trajectory]:
    """prompts: [(ids, messages, sampling)] -> a Trajectory each. Every conversation's turn decodes together with
    the others' (engine.decode); a turn that ends by calling tools gets their results (toolbox.run) and goes on,
    up to max_turns turns, each of at most max_new_tokens within the model's context. Rows that share a Sampling
    draw in a fixed order of their own (prompt length, then place), whatever else decodes beside them."""
    trajectories = [Trajectory(list(ids), list(messages), sampling=sampling) for ids, messages, sampling in prompts]
    for t in trajectories:
        if len(t.prompt) >= model.config.max_seq_len:
            t.finish_reason = "length"
    chats = [t for t in trajectories if t.finish_reason is None]
    take_turns(chats, toolbox, max_turns, DecodedTurns(model, tokenizer, max_new_tokens, thinking))
    return trajectories
