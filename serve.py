"""
Serve a trained model: an OpenAI-compatible HTTP API and a chat page, on the standard library alone.

    python serve.py --ckpt out/dpo/best.pt                        # then open http://127.0.0.1:8000
    python serve.py --ckpt out/dpo/best.pt --host 0.0.0.0 --api_key SECRET

    POST /v1/chat/completions   messages in the checkpoint's chat template; stream, stop, seed, max_tokens, ...
                                tools and thinking (ChatML checkpoints): OpenAI's tool_calls, reasoning_content
    POST /v1/completions        a plain continuation of `prompt`
    GET  /v1/models, /health, / (the chat page, chat.html)

Requests that overlap in time are decoded together. One engine thread owns the model and a batch of up to
max_batch rows in one KV cache: a request's prompt is prefilled alone, then it joins the batch, where every row
decodes one token per step at its own position; it leaves when it ends, meets a stop string or its client goes
away, while the others go on. HTTP threads only parse, validate and write what the engine sends them.
"""
import argparse
import hmac
import json
import math
import os
import queue
import secrets
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from chat import encode_pieces, markup
from checkpoint import load_model
from engine import Engine, Row, Sampling, TextStream, borders, overlap, prompt_ids
from errors import ConfigError, DataError, cli
from runtime import DTYPES, open_device
from tools import NAME, check_tools, parse_call

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_WAITING = 64  # requests queued for a row beyond this get 503: a client should back off rather than time out
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
    opening = {"required": "<tool_call>\n"}.get(choice, "") if isinstance(choice, str) else \
        f'<tool_call>\n{{"name": "{choice["function"]["name"]}", "arguments":'
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
# generation: a job per request, one engine thread that decodes every job in one batch

class Job(Row):
    """One request's row in the engine. The HTTP thread reads `events`: (text, None) as the answer grows, then
    (text, finish_reason); ("", "error") when generation failed. Setting `cancelled` takes it out of the batch."""

    def __init__(self, prompt: list[int], max_new: int, sampling: Sampling, eos_id: int, text: TextStream):
        super().__init__(prompt, max_new, sampling, eos_id)
        self.text = text
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def append(self, token: int):
        """Record the next token and tell the client what it adds; a stop string ends the row."""
        super().append(token)
        if token == self.eos_id:
            self.events.put((self.text.finish(), "stop"))
            return
        new = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif self.finish_reason == "length":
            new += self.text.finish()
        self.events.put((new, self.finish_reason))

    def fail(self, error: Exception):
        super().fail(error)
        traceback.print_exception(error)
        self.events.put(("", "error"))


class Scheduler:
    """The engine's thread. Each round it admits the waiting jobs there is room for (each prefilled alone: one
    prompt length), decodes one token for every row of the batch, and lets the rows that are done, or whose
    client left, go."""

    def __init__(self, model, max_batch: int, autocast=nullcontext):
        self.engine, self.autocast = Engine(model, max_batch), autocast
        self.waiting: queue.Queue = queue.Queue()
        self.generated = 0  # tokens generated since the start, for /health

    def start(self):
        threading.Thread(target=self.loop, name="engine", daemon=True).start()

    def submit(self, job: Job):
        if self.waiting.qsize() >= MAX_WAITING:
            raise APIError(503, f"the server is busy ({MAX_WAITING} requests are waiting); try again later",
                           code="server_busy")
        self.waiting.put(job)

    def loop(self):
        while True:
            try:
                with self.autocast():
                    self.step()
            except Exception as e:  # a bug: fail the jobs in flight, keep serving the next ones
                traceback.print_exc()
                for job in self.engine.rows:
                    job.fail(e)
                self.engine.rows = []

    def step(self):
        while len(self.engine.rows) < self.engine.max_batch:
            try:
                job = self.waiting.get(block=not self.engine.rows)  # idle: sleep until a request comes
            except queue.Empty:
                break
            if not job.cancelled:
                self.engine.add([job])
                self.generated += 1
        self.engine.drop_done()  # the jobs cancelled meanwhile
        self.generated += len(self.engine.rows)
        self.engine.step()


# -----------------------------------------------------------------------------
# a chat answer taken apart as it grows: reasoning, content, tool calls

class Trimmed:
    """Text sent in pieces as if stripped of chars at both ends (None: whitespace, "": nothing): the leading ones
    dropped, trailing ones held until more text follows them."""

    def __init__(self, chars: str | None):
        self.chars, self.started, self.held = chars, False, ""

    def add(self, text: str) -> str:
        text = self.held + text if self.started else text.lstrip(self.chars)
        body = text.rstrip(self.chars)
        self.held, self.started = text[len(body):], self.started or bool(body)
        return body


class ReplyStream:
    """A chat answer's text pieces -> its parts as soon as they are certain: ("reasoning", text) before </think>
    (thinking on: the prompt opened the block), ("content", text), and ("call", {index, id, name, arguments}) for
    each <tool_call> block that is a call (calls on; tools.parse_call's rule: a broken one stays content).
    Text that may still become </think> or a call is held back. The parts join to what tools.parse_reply makes
    of the whole text (with one think block); a plain answer is taken apart here too, so it is its stream's."""

    THINK_END, OPEN, CLOSE = "</think>", "<tool_call>", "</tool_call>"
    BORDERS = {THINK_END: borders(THINK_END), OPEN: borders(OPEN)}

    def __init__(self, thinking: bool = False, calls: bool = False, opening: str = ""):
        self.thinking, self.calls = thinking, calls
        self.in_think = thinking
        self.pending = opening  # text not yet sent: a forced call's opening (the prompt ends with it) comes first
        # taken apart, content is stripped (as parse_reply strips it); otherwise it is the text as generated
        self.trimmed = {"reasoning": Trimmed("\n"), "content": Trimmed(None if thinking or calls else "")}
        self.n_calls = 0

    def feed(self, text: str) -> list[tuple[str, str | dict]]:
        self.pending += text
        parts = []
        if self.in_think:
            end = self.pending.find(self.THINK_END)
            if end < 0:
                return self.send("reasoning", len(self.pending) - self.may_begin(self.THINK_END))
            parts += self.send("reasoning", end)
            self.pending, self.in_think = self.pending[len(self.THINK_END):], False
        while self.calls and (start := self.pending.find(self.OPEN)) >= 0:
            parts += self.send("content", start)
            end = self.pending.find(self.CLOSE)  # the first one after the opening, as parse_reply's regex matches
            if end < 0:
                return parts  # held until its </tool_call> comes
            block, self.pending = self.pending[: end + len(self.CLOSE)], self.pending[end + len(self.CLOSE):]
            try:
                call = parse_call(block[len(self.OPEN) : -len(self.CLOSE)].strip())
            except (ValueError, RecursionError):  # a number past int's digit limit, JSON nested too deep
                call = None
            if call is None:
                parts += self.trim("content", block)
                continue
            self.n_calls += 1
            parts.append(("call", {"index": self.n_calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}",
                                   "name": call["name"],
                                   "arguments": json.dumps(call["arguments"], ensure_ascii=False)}))
        return parts + self.send("content", len(self.pending) - (self.may_begin(self.OPEN) if self.calls else 0))

    def finish(self) -> list[tuple[str, str]]:
        """What is left when the answer ends: an unclosed think block is reasoning, an unclosed call content."""
        return self.send("reasoning" if self.in_think else "content", len(self.pending))

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.n_calls and finish == "stop" else finish

    def may_begin(self, marker: str) -> int:
        """The length of the pending text's end that may be the beginning of marker."""
        return overlap(self.pending, marker, self.BORDERS[marker])

    def send(self, kind: str, n: int) -> list[tuple[str, str]]:
        text, self.pending = self.pending[:n], self.pending[n:]
        return self.trim(kind, text)

    def trim(self, kind: str, text: str) -> list[tuple[str, str]]:
        text = self.trimmed[kind].add(text)
        return [(kind, text)] if text else []


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


# -----------------------------------------------------------------------------
# HTTP

class App:
    """What every request handler shares: the tokenizer, the engine, the key, the limits, the page."""

    def __init__(self, args):
        run = open_device(args.device, args.dtype)
        # the checkpoint's tokenizer and its template
        model, self.tokenizer, state = load_model(args.ckpt, run.device, args.tokenizer_path, args.yarn)
        self.device = run.device
        self.stage = state["stage"]
        self.max_seq_len = model.config.max_seq_len
        # a name, not the checkpoint's path: /health answers anyone
        self.model_id, self.created = args.model_name or f"nanomind-{self.stage}", int(os.path.getmtime(args.ckpt))
        self.api_key, self.max_body = args.api_key, args.max_body_kb * 1024
        self.timeout, self.max_connections = args.timeout, args.max_connections
        # on a loopback address only loopback names: a web page whose name rebinds to 127.0.0.1 sends its own name
        checked = args.host in LOOPBACK or args.allowed_hosts
        self.hosts = {h.lower() for h in (*LOOPBACK, *args.allowed_hosts)} if checked else None
        self.scheduler = Scheduler(model, args.max_batch, run.autocast)
        self.scheduler.start()
        with open(PAGE, "rb") as f:
            self.page = f.read()

    def submit(self, endpoint: str, body: dict) -> tuple[Job, dict]:
        """Check a request, build its prompt (chat: the chat template, the format training used; completion: <s>
        and the text, as sample.py continues it) and queue its job."""
        options = sampling_options(body, endpoint, self.model_id, self.device)
        if endpoint == "chat":
            param, messages = "messages", chat_messages(body)
            tools, calls, opening = tool_options(body)
            thinking, thinking_field = thinking_option(body)
            if self.tokenizer.chat_template != "chatml" and (tools or thinking):
                what, field = ("tools", "tools") if tools else ("thinking", thinking_field)
                raise APIError(400, f"this model's chat template cannot express {what} (it is not MiniMind's "
                                    "ChatML)", field)
            thinking = thinking and not opening  # a forced call opens right after the closed think block
            try:
                prompt = prompt_ids(self.tokenizer, messages, tools=tools, thinking=thinking)
            except DataError as e:
                raise APIError(400, f"messages: {e}", param) from None
            except RecursionError:  # json.dumps of the tools, a frame or two deeper than the check
                raise APIError(400, "'tools' is nested too deeply", "tools") from None
            if opening:
                prompt += encode_pieces(self.tokenizer, [markup(opening)])[0]  # <tool_call> as its added token
            options["reply"] = ReplyStream(thinking, calls, opening)
        else:
            param, text = "prompt", get(body, "prompt", str)
            if text is None:
                raise APIError(400, "'prompt' (a string) is required", param)
            prompt = prompt_ids(self.tokenizer, text)
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt is {len(prompt)} tokens, and this model's context is {self.max_seq_len} "
                                "tokens including the answer", param, "context_length_exceeded")
        max_new = min(options["max_tokens"] or room, room)  # the context running out ends it with "length"
        job = Job(prompt, max_new, options["sampling"], self.tokenizer.eos_id,
                  TextStream(self.tokenizer, options["stop"], strip=endpoint == "chat"))
        self.scheduler.submit(job)
        return job, options


class Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0). Every answer, errors from http.server's own parsing included, is
    JSON but the page."""
    server_version = "nanomind"
    default_request_version = "HTTP/1.0"  # a request line without a version still gets a status line and headers
    ROUTES = {("GET", "/"): "page", ("GET", "/health"): "health", ("GET", "/v1/models"): "models",
              ("POST", "/v1/chat/completions"): "chat", ("POST", "/v1/completions"): "completion"}
    committed = False  # the status line has gone out
    filler = b" "  # what a probe of a half-closed client writes: whitespace before JSON, or an SSE comment

    def setup(self):
        self.timeout = self.server.app.timeout  # a send or receive stalled this long drops the connection
        super().setup()

    def do_GET(self):
        self.route()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET  # other methods: 501 (send_error)

    def route(self):
        app, path, method = self.server.app, self.path.split("?", 1)[0], self.command
        try:
            raw = self.read_body()  # read first: an unread body would reset the socket
            self.check_host()
            name = self.ROUTES.get(("GET" if method == "HEAD" else method, path))
            if name is None:
                allowed = [m for m, p in self.ROUTES if p == path]
                allowed += ["HEAD"] * ("GET" in allowed)
                if allowed:
                    raise APIError(405, f"{path} takes {' or '.join(allowed)}, not {method}",
                                   headers={"Allow": ", ".join(allowed)})
                raise APIError(404, f"no such endpoint: {method} {path}", code="unknown_url")
            if path.startswith("/v1/"):
                self.authenticate()
            if name == "page":
                self.send(200, app.page, "text/html; charset=utf-8")
            elif name == "health":
                scheduler = app.scheduler
                self.send_json(200, {"status": "ok", "model": app.model_id, "running": len(scheduler.engine.rows),
                                     "waiting": scheduler.waiting.qsize(), "generated_tokens": scheduler.generated})
            elif name == "models":
                self.send_json(200, {"object": "list", "data": [{"id": app.model_id, "object": "model",
                                                                 "created": app.created, "owned_by": "nanomind"}]})
            else:
                if self.headers.get_content_type() != "application/json":  # a browser's form or text/plain POST
                    raise APIError(415, "the body must be JSON sent with 'Content-Type: application/json'",
                                   "Content-Type", "unsupported_media_type")
                self.complete(name, self.parse(raw))
        except APIError as e:
            self.send_json(e.status, e.body(), e.headers)
        except OSError:  # the client went away while we wrote to it
            pass
        except Exception:  # a bug: the client still gets an answer, the log the traceback
            traceback.print_exc()
            self.send_json(500, APIError(500, "internal error; the server's log has the traceback").body())

    def read_body(self) -> bytes:
        length = self.headers.get("Content-Length", "0").strip()
        if not (length.isascii() and length.isdigit() and len(length) < 16):
            raise APIError(400, f"Content-Length must be a number of bytes, got {length[:20]!r}", "Content-Length")
        n = int(length)
        if n > self.server.app.max_body:
            while n > 0 and (chunk := self.rfile.read(min(n, 1 << 16))):  # drained, so the client reads the 413
                n -= len(chunk)
            raise APIError(413, f"the body is over this server's limit of {self.server.app.max_body} bytes "
                                "(--max_body_kb)", code="body_too_large")
        try:
            raw = self.rfile.read(n)
            late = self.server.open[self.connection] < time.monotonic()  # then Server shut our reading end
        except TimeoutError:
            raw, late = b"", True
        if len(raw) < n:  # the client stopped sending: a half-close, or too late
            if late:
                raise APIError(408, f"the request was not sent within {self.server.app.timeout} s", code="timeout")
            raise APIError(400, f"the body ended after {len(raw)} of its Content-Length {n} bytes", "Content-Length")
        self.server.open[self.connection] = math.inf  # read: the answer may take as long as it takes
        return raw

    def check_host(self):
        hosts, host = self.server.app.hosts, self.headers.get("Host")
        if hosts is None or host is None:
            return
        name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]  # without the port
        if name.lower() not in hosts:
            raise APIError(403, f"Host {host[:100]!r} is not allowed: this server answers to {', '.join(sorted(hosts))}"
                                " (--allowed_hosts adds names)", "Host", "host_not_allowed")

    def authenticate(self):
        key = self.server.app.api_key
        given = self.headers.get("Authorization", "")
        if key is not None and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @staticmethod
    def parse(raw: bytes) -> dict:
        try:
            body = json.loads(raw, parse_int=parse_int)
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply", code="invalid_json") from None
        except ValueError as e:  # not UTF-8, not JSON
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def complete(self, endpoint: str, body: dict):
        job, options = self.server.app.submit(endpoint, body)
        chat = endpoint == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.server.app.model_id}
        if options["stream"]:
            return self.stream(job, head, options.get("reply"), options["include_usage"])
        pieces, finish = [], None
        for text, finish in self.events(job):
            pieces.append(text)
        if job.cancelled:
            return
        answer = "".join(pieces)
        if chat:
            reply = options["reply"]
            choice = {"message": chat_message(reply.feed(answer) + reply.finish(), reply.thinking)}
            finish = reply.finish_reason(finish)
        else:
            choice = {"text": answer}
        self.send_json(200, {**head, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}],
                             "usage": usage(job)})

    def stream(self, job: Job, head: dict, reply: ReplyStream | None, include_usage: bool):
        """Server-sent events: chunks of the answer as it grows (a chat answer's taken apart by reply), one with
        finish_reason, [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.committed, self.filler = True, b":\n\n"
        chat = reply is not None
        head = {**head, "object": head["object"] + ".chunk" if chat else head["object"]}

        def chunk(delta: dict | str, finish: str | None = None):  # a chat delta, or a completion's text
            choice = {"delta": delta} if chat else {"text": delta}
            self.event({**head, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}]})

        try:
            if chat:
                chunk({"role": "assistant"})
            for text, finish in self.events(job):
                if chat:
                    for delta in chat_deltas(reply.feed(text) + (reply.finish() if finish else [])):
                        chunk(delta)
                elif text:
                    chunk(text)
                if finish:
                    chunk({} if chat else "", reply.finish_reason(finish) if chat else finish)
            if job.cancelled:
                return
            if include_usage:
                self.event({**head, "choices": [], "usage": usage(job)})
            self.wfile.write(b"data: [DONE]\n\n")
        except APIError as e:  # the status line has gone out: the error goes as an event
            self.event(e.body())
        except OSError:  # the client went away: its row leaves the batch at the engine's next step
            job.cancelled = True

    def events(self, job: Job):
        """The job's (text, finish_reason) events as they come. A client that has gone away cancels the job."""
        while True:
            try:
                text, finish = job.events.get(timeout=0.2)
            except queue.Empty:
                text, finish = None, None
            if self.client_gone():
                job.cancelled = True
                return
            if finish == "error":
                raise APIError(500, "generation failed; the server's log has the traceback")
            if text is not None:
                yield text, finish
            if finish:
                return

    def client_gone(self) -> bool:
        """The client closed its socket. End-of-file alone may be a half-close (a client done sending, still
        reading): a write tells them apart, as a closed socket answers it with a reset that the next check reads."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if ready and self.connection.recv(1, socket.MSG_PEEK) == b"":
                if not self.committed:  # a plain answer: its status and headers go now, its JSON after whitespace
                    self.send_head(200, "application/json")
                self.wfile.write(self.filler)
            return False
        except OSError:
            return True

    def event(self, obj: dict):
        self.wfile.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """http.server's own errors (a malformed request line, headers too long, an unknown method) as JSON."""
        self.close_connection = True
        if code == 400 and self.server.open.get(self.connection, math.inf) < time.monotonic():
            code, message = 408, f"the request was not sent within {self.server.app.timeout} s"  # cut short by it
        self.send_json(code, APIError(code, message or self.responses.get(code, ("error",))[0]).body())

    def send_json(self, status: int, obj: dict, headers: dict | None = None):
        self.send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def send(self, status: int, data: bytes, content_type: str, headers: dict | None = None):
        if not self.committed:
            self.send_head(status, content_type, {"Content-Length": str(len(data)), **(headers or {})})
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_head(self, status: int, content_type: str, headers: dict | None = None):
        self.send_response(status)
        for key, value in {"Content-Type": content_type, **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.committed = True


def usage(job: Job) -> dict:
    """Token counts: the prompt as encoded, and every token generated, the end-of-turn token included."""
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
            "total_tokens": len(job.prompt) + len(job.tokens)}


class Server(ThreadingHTTPServer):
    """A thread per connection, up to --max_connections; past that a 503 straight from the accepting thread. A
    request not read within --timeout of its connection is cut off (its socket shut for reading)."""
    daemon_threads = True  # a stuck client does not keep the process alive at exit
    request_queue_size = 1024  # the listen backlog: clients arriving together wait in it rather than being reset

    def __init__(self, address: tuple[str, int], app: App):
        self.app = app
        self.open: dict[socket.socket, float] = {}  # each connection -> by when its request must be read
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    def process_request(self, request, client_address):
        if len(self.open) >= self.app.max_connections:
            return self.refuse(request)
        self.open[request] = time.monotonic() + self.app.timeout
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            del self.open[request]

    def service_actions(self):  # serve_forever calls it every half second
        now = time.monotonic()
        for sock, deadline in list(self.open.items()):
            if deadline < now:
                try:
                    sock.shutdown(socket.SHUT_RD)  # the handler's read ends; it can still write its 408
                except OSError:
                    pass

    def refuse(self, sock: socket.socket):
        body = json.dumps(APIError(503, f"the server has {self.app.max_connections} connections open "
                                        "(--max_connections); try again later", code="server_busy").body()).encode()
        try:
            sock.setblocking(False)  # the few bytes fit the socket's buffer; never wait on this client
            sock.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nRetry-After: 1\r\n\r\n" + body)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1 << 16)  # what the request sent so far: unread, closing would reset the connection
        except OSError:
            pass
        self.shutdown_request(sock)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint written by train_pretrain/sft/dpo.py")
    p.add_argument("--host", default="127.0.0.1", help="another address than this machine's own lets others in")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--api_key", help="require 'Authorization: Bearer KEY' on /v1/ (default: no key)")
    p.add_argument("--allowed_hosts", type=lambda s: [h for h in s.split(",") if h], default=[],
                   help="names a client may put in its Host header besides 127.0.0.1, localhost and [::1] "
                        "(checked on a loopback --host, or whenever given), e.g. myhost.lan,myhost.lan.")
    p.add_argument("--model_name", help="the model's id in the API (default: nanomind-<the checkpoint's stage>)")
    p.add_argument("--tokenizer_path", help="default: the checkpoint's")
    p.add_argument("--yarn", type=float, help="FACTOR: a context FACTOR times the trained one, by YaRN rope scaling")
    p.add_argument("--max_batch", type=int, default=8, help="requests decoded together; more wait for a row")
    p.add_argument("--max_body_kb", type=int, default=1024, help="larger request bodies get 413")
    p.add_argument("--max_connections", type=int, default=128, help="connections open at once; more get 503")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds a client has to send its request, and the longest a send or receive may stall")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="autocast: auto is what the device runs well (float32 on a CPU); float32 forces it")
    args = p.parse_args(argv)
    if min(args.max_batch, args.max_body_kb, args.max_connections) < 1 or not args.timeout > 0:
        raise ConfigError("--max_batch, --max_body_kb and --max_connections must be at least 1, --timeout positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    app = App(args)
    try:
        server = Server((args.host, args.port), app)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    if args.host not in LOOPBACK:
        print(f"warning: listening on {args.host}: anyone who can reach this machine on port "
              f"{server.server_address[1]} can use the model" + ("" if args.api_key else "; set --api_key to require a key"),
              file=sys.stderr, flush=True)
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"serving {args.ckpt} ({app.stage} checkpoint) as '{app.model_id}' at http://{host}:{port}/ (the chat page; "
          "the API under /v1)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    cli(main)
