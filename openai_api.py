"""
The OpenAI wire format, both ways: a request body checked into plain values (a wrong type or value is an APIError,
a 400 that names the field), and an answer's parts and counts into OpenAI's response objects. No sockets, no threads.
"""
import json
import secrets

import torch

from engine import Sampling
from errors import DataError
from reply import CALL_START, NAME
from tools import check_tools

MAX_STOP_CHARS = 500  # each stop string is matched against the answer's end at every token

class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class OutOfRange:
    """A JSON integer beyond 64 bits: no field takes one, and Python would parse a long one in quadratic time."""

    def __init__(self, digits: str):
        self.digits = digits


def parse_int(digits: str):
    """json.loads's integer parser: an integer no field could take becomes an OutOfRange, for get() to name."""
    value = int(digits) if len(digits) <= 21 else None
    return value if value is not None and -2**63 <= value < 2**64 else OutOfRange(digits)


def parse_body(raw: bytes) -> dict:
    """A request's body -> the JSON object it holds, its integers parsed by parse_int."""
    try:
        body = json.loads(raw, parse_int=parse_int)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:  # not UTF-8, not JSON
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


# -----------------------------------------------------------------------------
# a request's options, checked: a wrong type or value is a 400 that names the field

COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
          "stream_options", "seed", "n", "user"}
THINKING = ("enable_thinking", "open_thinking")  # transformers' and MiniMind's names for one switch
CHAT = {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", *THINKING}
ENDPOINT_FIELDS = {"chat": COMMON | CHAT, "completion": COMMON | {"prompt"}}


KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def get(body: dict, name: str, kind, default=None):
    """body[name] if it is of kind (int, float, bool, str, list, dict, or a tuple of them); absent or null ->
    default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, OutOfRange):
        raise APIError(400, f"'{name}' is out of range (a number of {len(value.digits)} digits)", name, "out_of_range")
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        kinds = " or ".join(KINDS[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        shown = KINDS[type(value)] if isinstance(value, (list, dict)) else json.dumps(value)[:40]  # not a deep dump
        raise APIError(400, f"'{name}' must be {kinds}, got {shown}", name, "invalid_type")
    return value


def sampling_options(body: dict, endpoint: str, model_id: str, device: torch.device) -> dict:
    """The fields every endpoint takes -> {max_tokens, sampling (its generator on device), stop, stream,
    include_usage}; an unknown field, another model or a bad value is an APIError."""
    unknown = sorted(set(body) - ENDPOINT_FIELDS[endpoint])
    if unknown:
        raise APIError(400, f"unsupported parameter '{unknown[0]}' (this server takes: "
                            f"{', '.join(sorted(ENDPOINT_FIELDS[endpoint]))})", unknown[0], "unsupported_parameter")
    if get(body, "model", str, model_id) != model_id:
        raise APIError(404, f"the model '{body['model']}' does not exist; this server serves '{model_id}'",
                       "model", "model_not_found")
    if get(body, "n", int, 1) != 1:
        raise APIError(400, "'n' must be 1: one answer per request", "n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get(body, name, int)
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"'{name}' must be at least 1, got {max_tokens}", name)
    temperature, top_p = get(body, "temperature", float, 1.0), get(body, "top_p", float, 1.0)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    stop = get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of at most 4 "
                            "of them", "stop")
    seed = get(body, "seed", int, secrets.randbits(63))
    stream_options = get(body, "stream_options", dict, {})
    sampling = Sampling(temperature, top_p=top_p, generator=torch.Generator(device).manual_seed(seed))  # where it samples
    return {"max_tokens": max_tokens, "sampling": sampling, "stop": stop, "stream": get(body, "stream", bool, False),
            "include_usage": get(stream_options, "include_usage", bool, False)}


def chat_messages(body: dict) -> list[dict]:
    """OpenAI messages -> the messages chat.encode_chat takes: content given as text parts is joined; an
    assistant's tool_calls and a tool message's tool_call_id are checked (the call it answers came before)."""
    messages = get(body, "messages", list)
    if not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        m = {k: v for k, v in m.items() if k != "name"} | {"content": content}
        if m.get("tool_calls") == []:  # some clients send an empty list on every assistant message
            del m["tool_calls"]
        if m.get("tool_calls") is not None:
            m["tool_calls"] = tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            call_ids |= {call["id"] for call in m["tool_calls"]}
        given = m.get("tool_call_id")
        if m.get("role") == "tool" and not (isinstance(given, str) and given in call_ids):
            raise APIError(400, f"messages[{i}].tool_call_id must be the id of a call an earlier assistant message "
                                f"made; got {json.dumps(given)[:40] if given is not None else 'none'}", "messages")
        out.append(m)
    return out


def tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, OpenAI's [{id, type: function, function: {name, arguments: a JSON
    object as a string}}], checked: the template writes the arguments string as it is."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of {{id, type: function, function: {{name, arguments}}}}",
                       "messages")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise APIError(400, f"{at} must be {{id, type: function, function: {{name, arguments}}}}", "messages")
        if not isinstance(call.get("id"), str):
            raise APIError(400, f"{at}.id must be a string (a tool message names it in tool_call_id)", "messages")
        if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise APIError(400, f"{at}.function.name must be 1-64 letters, digits, _ or -", "messages")
        try:
            arguments = json.loads(fn.get("arguments")) if isinstance(fn.get("arguments"), str) else None
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{at}.function.arguments is not a JSON object (a string holding one, as this API "
                                "returns it)", "messages")
    return [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]}} for c in calls]


def tool_options(body: dict) -> tuple[list | None, bool, str]:
    """tools and tool_choice -> (the tools to show, whether a reply's calls become tool_calls, the opening of a
    call that tool_choice forces: the prompt ends with it, so the model can only go on with the call)."""
    tools = get(body, "tools", list) or None
    try:
        functions = check_tools(tools, "tools") if tools else {}
    except DataError as e:
        raise APIError(400, str(e), "tools") from None

    def out_of_range(value: OutOfRange):  # the template writes the tools with json.dumps
        raise APIError(400, f"'tools' holds an integer of {len(value.digits)} digits", "tools", "out_of_range")

    try:
        json.dumps(tools, default=out_of_range)
    except RecursionError:
        raise APIError(400, "'tools' is nested too deeply", "tools") from None
    get(body, "parallel_tool_calls", bool)  # taken, not enforced: a turn may make one call or several
    choice = get(body, "tool_choice", (str, dict), "auto")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            choice = None  # the error below
        elif name not in functions:
            raise APIError(400, f"'tool_choice' names the function {json.dumps(name)[:70]}, which is not among "
                                f"'tools' ({', '.join(functions) or 'none given'})", "tool_choice")
    if choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise APIError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice == "required" and not functions:
        raise APIError(400, "'tool_choice' \"required\" needs 'tools'", "tool_choice")
    # a named call's opening ends at "arguments": where the template's text splits into the same tokens
    opening = {"required": f"{CALL_START}\n"}.get(choice, "") if isinstance(choice, str) else \
        f'{CALL_START}\n{{"name": "{choice["function"]["name"]}", "arguments":'
    return tools, bool(functions) and choice != "none", opening


def thinking_option(body: dict) -> tuple[bool, str]:
    """enable_thinking, open_thinking or chat_template_kwargs' either: any true opens the think block -> (on,
    the field that says so)."""
    kwargs = get(body, "chat_template_kwargs", dict, {})
    for key, value in kwargs.items():
        if key not in THINKING or not isinstance(value, bool):
            raise APIError(400, f"'chat_template_kwargs.{key[:40]}': this server takes enable_thinking and "
                                "open_thinking there, each true or false", "chat_template_kwargs")
    on = [name for name in THINKING if get(body, name, bool, False)] + ["chat_template_kwargs"] * any(kwargs.values())
    return bool(on), on[0] if on else ""


# -----------------------------------------------------------------------------
# an answer, in OpenAI's objects

def chat_message(parts: list[tuple], thinking: bool) -> dict:
    """A whole answer's parts -> OpenAI's assistant message: content (null beside calls when empty),
    reasoning_content (thinking on), tool_calls."""
    text = {kind: "".join(v for k, v in parts if k == kind) for kind in ("reasoning", "content")}
    calls = [v for k, v in parts if k == "call"]
    message = {"role": "assistant", "content": text["content"] or (None if calls else "")}
    if thinking:
        message["reasoning_content"] = text["reasoning"]
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return message


def chat_deltas(parts: list[tuple]) -> list[dict]:
    """Parts -> OpenAI's chunk deltas; a call goes out as its index, id and name, then its arguments."""
    deltas = []
    for kind, value in parts:
        if kind == "call":
            deltas += [{"tool_calls": [{"index": value["index"], "id": value["id"], "type": "function",
                                        "function": {"name": value["name"], "arguments": ""}}]},
                       {"tool_calls": [{"index": value["index"], "function": {"arguments": value["arguments"]}}]}]
        else:
            deltas.append({"reasoning_content" if kind == "reasoning" else "content": value})
    return deltas


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """Token counts: the prompt as encoded, and every token generated, the end-of-turn token included."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
