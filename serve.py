"""
Serve a trained model: an OpenAI-compatible HTTP API and a chat page, on the standard library alone.

    python serve.py --ckpt=out/dpo/best.pt                        # then open http://127.0.0.1:8000
    python serve.py --ckpt=out/dpo/best.pt --host=0.0.0.0 --api_key=SECRET

    POST /v1/chat/completions   messages in the checkpoint's chat template; stream, stop, seed, max_tokens, ...
                                tools and thinking (ChatML checkpoints): OpenAI's tool_calls, reasoning_content
    POST /v1/completions        a plain continuation of `prompt`
    GET  /v1/models, /health, / (the chat page, chat.html)

Requests that overlap in time are decoded together. One engine thread owns the model and a batch of up to
max_batch rows in one KV cache: a request's prompt is prefilled alone, then it joins the batch, where every row
decodes one token per step at its own position; it leaves when it ends, meets a stop string or its client goes
away, while the others go on. The HTTP side is one event loop (asyncio): a connection costs no thread, so a
thousand idle or trickling clients hold nothing a request needs; it parses, checks and writes what the engine
sends.
"""
import asyncio
import dataclasses
import email.utils
import hmac
import http
import http.client
import io
import json
import os
import re
import sys
import time
import traceback
import uuid

from chat import encode_pieces, markup
from checkpoint import load_model
from config import check_device_and_dtype, load_config
from engine import Row, TextStream, compiled, decode, prompt_ids
from errors import ConfigError, DataError, cli
from openai_api import (APIError, chat_deltas, chat_message, chat_messages, get, parse_body, sampling_options,
                        thinking_option, tool_options, usage)
from reply import ReplyStream
from runtime import allow_open_files, open_device
from scheduler import Job, QueueFull, Scheduler

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_LINE, MAX_HEADERS = 65536, 100  # a request line or header line's bytes, and header lines: http.server's bounds
LINGER = 1.0  # seconds a closing connection waits for the client to stop sending


# -----------------------------------------------------------------------------
# HTTP

def warmed_up(model, autocast):
    """The compiled model after one call of each kind a batch makes (prefills, rows in lockstep, rows at their own
    positions, one and several), so that no request waits for a compile."""
    with autocast():
        decode(model, [Row([1] * 4, 3), Row([1] * 4, 3)])
        decode(model, [Row([1] * 3, 4), Row([1] * 5, 2)])
    return model


class App:
    """What every request handler shares: the tokenizer, the engine, the key, the limits, the page."""

    def __init__(self, args):
        run = open_device(args.device, args.dtype)
        # the checkpoint's tokenizer and its template
        model, self.tokenizer, state = load_model(args.ckpt, run.device, args.tokenizer_path, args.yarn)
        if args.compile:
            model = warmed_up(compiled(model), run.autocast)
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

    def submit(self, endpoint: str, raw: bytes, events) -> tuple[Job, dict]:
        """Check a request's body, build its prompt (chat: the chat template, the format training used; completion:
        <s> and the text, as sample.py continues it) and queue its job, which tells `events` how it goes."""
        body = parse_body(raw)
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
                  TextStream(self.tokenizer, options["stop"], strip=endpoint == "chat"), events)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy ({e.waiting} requests are waiting); try again later",
                           code="server_busy") from None
        return job, options


class Closed(Exception):
    """The connection ends without an answer: nothing was asked, or the client went away."""


class Events:
    """A job's events, handed from the engine's thread to the event loop (the job's `events`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: tuple):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is exiting
            pass


class Connection:
    """One connection, one request (HTTP/1.0), served on the event loop: a connection costs no thread, so clients
    that idle or trickle hold nothing another request needs. Every answer, errors in the request's framing
    included, is JSON but the page."""
    ROUTES = {("GET", "/"): "page", ("GET", "/health"): "health", ("GET", "/v1/models"): "models",
              ("POST", "/v1/chat/completions"): "chat", ("POST", "/v1/completions"): "completion"}
    METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")  # others: 501

    def __init__(self, app: "App", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.app, self.reader, self.writer = app, reader, writer
        self.method, self.headers, self.job = "GET", None, None
        self.started = False  # a byte of the request has come
        self.unread = True  # the request may have bytes not read yet: closing would reset the connection
        self.committed = False  # the status line has gone out
        self.filler = b" "  # what a probe of a half-closed client writes: whitespace before JSON, or an SSE comment

    async def serve(self):
        try:
            await self.answer()
        except (Closed, ConnectionError, TimeoutError):  # nothing asked; the client left or stopped reading
            pass
        finally:
            if self.job is not None and not self.job.done:
                self.job.cancelled = True  # its row leaves the batch at the engine's next step
            await self.close()

    async def answer(self):
        try:
            try:
                path, raw = await asyncio.wait_for(self.read_request(), self.app.timeout)
            except TimeoutError:
                if not self.started:
                    raise Closed from None  # an idle connection: closed without an answer
                raise APIError(408, f"the request was not sent within {self.app.timeout} s", code="timeout") from None
            await self.route(path, raw)
        except APIError as e:
            await self.send_json(e.status, e.body(), e.headers)
        except (Closed, ConnectionError, TimeoutError):
            raise
        except Exception:  # a bug: the client still gets an answer, the log the traceback
            traceback.print_exc()
            await self.send_json(500, APIError(500, "internal error; the server's log has the traceback").body())

    # --- the request

    async def read_request(self) -> tuple[str, bytes]:
        """(path, body): the request line (as http.server parses it), the headers, the body."""
        first = await self.reader.read(1)
        if not first:
            raise Closed
        self.started = True
        line = first if first == b"\n" else first + await self.readline(414, "the request line")
        words = line.decode("latin-1").rstrip("\r\n").split()
        if len(words) == 3:
            version = re.fullmatch(r"HTTP/(\d{1,10})\.(\d{1,10})", words[2])
            if version is None:
                raise APIError(400, f"bad HTTP version {words[2][:20]!r}")
            if (int(version[1]), int(version[2])) >= (2, 0):
                raise APIError(505, f"HTTP version {words[2]} is not supported: this server speaks HTTP/1.0 and 1.1")
        elif len(words) != 2 or words[0] != "GET":  # two words: an HTTP/0.9 GET, answered as HTTP/1.0
            raise APIError(400, f"bad request line {line[:100].decode('latin-1')!r}")
        self.method, path = words[0], words[1].split("?", 1)[0]
        lines = []
        while (header := await self.readline(431, "a header line")) not in (b"\r\n", b"\n", b""):
            lines.append(header)
            if len(lines) > MAX_HEADERS:
                raise APIError(431, f"the request has more than {MAX_HEADERS} header lines")
        try:
            self.headers = http.client.parse_headers(io.BytesIO(b"".join(lines) + b"\r\n"))
        except http.client.HTTPException as e:
            raise APIError(431, f"bad headers: {e}") from None
        if self.method not in self.METHODS:
            raise APIError(501, f"method {self.method[:20]!r} is not supported")
        return path, await self.read_body()

    async def readline(self, status: int, what: str) -> bytes:
        """A line to its newline, or to the end of the input; over MAX_LINE bytes: status (414 or 431)."""
        try:
            return await self.reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            return e.partial
        except asyncio.LimitOverrunError:
            raise APIError(status, f"{what} is over this server's limit of {MAX_LINE} bytes") from None

    async def read_body(self) -> bytes:
        length = self.headers.get("Content-Length", "0").strip()
        if not (length.isascii() and length.isdigit() and len(length) < 16):
            raise APIError(400, f"Content-Length must be a number of bytes, got {length[:20]!r}", "Content-Length")
        n = int(length)
        if n > self.app.max_body:
            while n > 0 and (chunk := await self.reader.read(min(n, 1 << 16))):  # drained: the client reads the 413
                n -= len(chunk)
            self.unread = n > 0
            raise APIError(413, f"the body is over this server's limit of {self.app.max_body} bytes "
                                "(--max_body_kb)", code="body_too_large")
        try:
            raw = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as e:  # the client stopped sending: a half-close
            raise APIError(400, f"the body ended after {len(e.partial)} of its Content-Length {n} bytes",
                           "Content-Length") from None
        self.unread = False
        return raw

    def check_host(self):
        hosts, host = self.app.hosts, self.headers.get("Host")
        if hosts is None or host is None:
            return
        name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]  # without the port
        if name.lower() not in hosts:
            raise APIError(403, f"Host {host[:100]!r} is not allowed: this server answers to {', '.join(sorted(hosts))}"
                                " (--allowed_hosts adds names)", "Host", "host_not_allowed")

    def authenticate(self):
        key = self.app.api_key
        given = self.headers.get("Authorization", "")
        if key is not None and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    # --- the answer

    async def route(self, path: str, raw: bytes):
        app, method = self.app, self.method
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
            await self.send(200, app.page, "text/html; charset=utf-8")
        elif name == "health":
            await self.send_json(200, {"status": "ok", "model": app.model_id, **app.scheduler.load()})
        elif name == "models":
            await self.send_json(200, {"object": "list", "data": [{"id": app.model_id, "object": "model",
                                                                   "created": app.created, "owned_by": "nanomind"}]})
        else:
            if self.headers.get_content_type() != "application/json":  # a browser's form or text/plain POST
                raise APIError(415, "the body must be JSON sent with 'Content-Type: application/json'",
                               "Content-Type", "unsupported_media_type")
            await self.complete(name, raw)

    async def complete(self, endpoint: str, raw: bytes):
        loop = asyncio.get_running_loop()
        # parsing and tokenizing a large body takes a while: off the loop, which serves everyone else meanwhile
        job, options = await loop.run_in_executor(None, self.app.submit, endpoint, raw, Events(loop))
        self.job = job
        chat = endpoint == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.app.model_id}
        if options["stream"]:
            return await self.stream(job, head, options.get("reply"), options["include_usage"])
        pieces, finish = [], None
        async for text, finish in self.events(job):
            pieces.append(text)
        answer = "".join(pieces)
        if chat:
            reply = options["reply"]
            choice = {"message": chat_message(reply.feed(answer) + reply.finish(), reply.thinking)}
            finish = reply.finish_reason(finish)
        else:
            choice = {"text": answer}
        await self.send_json(200, {**head, "choices": [{"index": 0, **choice, "logprobs": None,
                                                        "finish_reason": finish}],
                                   "usage": usage(len(job.prompt), len(job.tokens))})

    async def stream(self, job: Job, head: dict, reply: ReplyStream | None, include_usage: bool):
        """Server-sent events: chunks of the answer as it grows (a chat answer's taken apart by reply), one with
        finish_reason, [DONE]."""
        self.send_head(200, "text/event-stream; charset=utf-8", {"Cache-Control": "no-cache"})
        self.filler = b":\n\n"
        chat = reply is not None
        head = {**head, "object": head["object"] + ".chunk" if chat else head["object"]}

        async def chunk(delta: dict | str, finish: str | None = None):  # a chat delta, or a completion's text
            choice = {"delta": delta} if chat else {"text": delta}
            await self.event({**head, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}]})

        try:
            if chat:
                await chunk({"role": "assistant"})
            async for text, finish in self.events(job):
                if chat:
                    for delta in chat_deltas(reply.feed(text) + (reply.finish() if finish else [])):
                        await chunk(delta)
                elif text:
                    await chunk(text)
                if finish:
                    await chunk({} if chat else "", reply.finish_reason(finish) if chat else finish)
            if include_usage:
                await self.event({**head, "choices": [], "usage": usage(len(job.prompt), len(job.tokens))})
            self.writer.write(b"data: [DONE]\n\n")
            await self.drain()
        except APIError as e:  # the status line has gone out: the error goes as an event
            await self.event(e.body())

    async def events(self, job: Job):
        """The job's (text, finish_reason) events as they come. A client that has gone away ends the connection
        (and so cancels the job)."""
        while True:
            try:
                text, finish = await asyncio.wait_for(job.events.queue.get(), 0.2)
            except TimeoutError:
                text, finish = None, None
            if await self.client_gone():
                raise Closed
            if finish == "error":
                raise APIError(500, "generation failed; the server's log has the traceback")
            if text is not None:
                yield text, finish
            if finish:
                return

    async def client_gone(self) -> bool:
        """The client closed its socket. End-of-file alone may be a half-close (a client done sending, still
        reading): a write tells them apart, as a closed socket answers it with a reset that the next write meets."""
        if self.reader.at_eof() and not self.writer.is_closing():
            if not self.committed:  # a plain answer: its status and headers go now, its JSON after whitespace
                self.send_head(200, "application/json")
            self.writer.write(self.filler)
            try:
                await self.drain()
            except ConnectionError:
                return True
        return self.writer.is_closing()

    async def event(self, obj: dict):
        self.writer.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())
        await self.drain()

    async def send_json(self, status: int, obj: dict, headers: dict | None = None):
        await self.send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    async def send(self, status: int, data: bytes, content_type: str, headers: dict | None = None):
        if not self.committed:
            self.send_head(status, content_type, {"Content-Length": str(len(data)), **(headers or {})})
        if self.method != "HEAD":
            self.writer.write(data)
        await self.drain()

    def send_head(self, status: int, content_type: str, headers: dict | None = None):
        lines = [f"HTTP/1.0 {status} {http.HTTPStatus(status).phrase}", "Server: nanomind",
                 f"Date: {email.utils.formatdate(usegmt=True)}", f"Content-Type: {content_type}",
                 *(f"{key}: {value}" for key, value in (headers or {}).items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        self.committed = True

    async def drain(self):
        """Wait until the client has taken what was written; stalled for --timeout: TimeoutError."""
        await asyncio.wait_for(self.writer.drain(), self.app.timeout)

    async def close(self):
        """End the connection. Request bytes not read yet are read first (for a second at most): closing a socket
        with unread input resets the connection, and the client could lose the answer before reading it."""
        try:
            if self.unread and self.started and not self.writer.is_closing():
                self.writer.write_eof()
                await asyncio.wait_for(self.discard(), LINGER)
        except (OSError, TimeoutError):
            pass
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), LINGER)
        except (OSError, TimeoutError):
            pass

    async def discard(self):
        while await self.reader.read(1 << 16):
            pass

    async def refuse(self, limit: int):
        """A 503 and the close: --max_connections connections are open already."""
        self.started = True
        await self.send_json(503, APIError(503, f"the server has {limit} connections open (--max_connections); try "
                                                "again later", code="server_busy").body(), {"Retry-After": "1"})


class Server:
    """Accepts connections on the event loop, up to --max_connections at once; past that a 503 and the close."""

    def __init__(self, app: "App"):
        self.app, self.open = app, 0

    async def connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        connection = Connection(self.app, reader, writer)
        if self.open >= self.app.max_connections:
            try:
                await connection.refuse(self.app.max_connections)
            except (ConnectionError, TimeoutError):
                pass
            return await connection.close()
        self.open += 1
        try:
            await connection.serve()
        finally:
            self.open -= 1

    async def start(self, host: str, port: int) -> asyncio.Server:
        # the listen backlog: clients arriving together wait in it rather than being reset
        return await asyncio.start_server(self.connect, host, port, backlog=1024, limit=MAX_LINE)


@dataclasses.dataclass
class Config:
    # --- the model
    ckpt: str | None = None  # required: a checkpoint written by train_pretrain/sft/dpo.py
    model_name: str | None = None  # the model's id in the API; None: nanomind-<the checkpoint's stage>
    tokenizer_path: str | None = None  # None: the checkpoint's
    yarn: float | None = None  # FACTOR: a context FACTOR times the trained one, by YaRN rope scaling
    # --- HTTP
    host: str = "127.0.0.1"  # another address than this machine's own lets others in
    port: int = 8000  # 0: any free port (printed)
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1/; None: no key
    allowed_hosts: str = ""  # Host header names besides the loopback ones, comma-separated: myhost.lan,myhost.lan.
    # --- limits
    max_batch: int = 8  # requests decoded together; more wait for a row
    max_body_kb: int = 1024  # larger request bodies get 413
    max_connections: int = 4096  # connections open at once; more get 503
    timeout: float = 10.0  # seconds a client has to send its request, and the longest a send or receive may stall
    # --- system
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # autocast: auto is what the device runs well (float32 on a CPU); float32 forces it
    compile: bool = False  # torch.compile the forward before serving (minutes); 26m then decodes 1.4-2.2x faster


def parse_args(argv: list[str]) -> Config:
    """The command line's Config, checked, allowed_hosts as a list of names (App's Host check takes them so)."""
    (args,) = load_config(argv, Config)
    check_device_and_dtype(args.device, args.dtype)
    if args.ckpt is None:
        raise ConfigError("serve.py needs --ckpt=PATH: the checkpoint to serve")
    if min(args.max_batch, args.max_body_kb, args.max_connections) < 1 or not args.timeout > 0:
        raise ConfigError("--max_batch, --max_body_kb and --max_connections must be at least 1, --timeout positive")
    return dataclasses.replace(args, allowed_hosts=[h for h in args.allowed_hosts.split(",") if h])


async def serve(app: App, args: Config):
    try:
        listener = await Server(app).start(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    host, port = listener.sockets[0].getsockname()[:2]
    if args.host not in LOOPBACK:
        print(f"warning: listening on {args.host}: anyone who can reach this machine on port {port} can use the "
              "model" + ("" if args.api_key else "; set --api_key to require a key"), file=sys.stderr, flush=True)
    host = f"[{host}]" if ":" in host else host
    print(f"serving {args.ckpt} ({app.stage} checkpoint) as '{app.model_id}' at http://{host}:{port}/ (the chat page; "
          "the API under /v1)", flush=True)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str]):
    args = parse_args(argv)
    app = App(args)
    fit = max(1, allow_open_files(args.max_connections + 64) - 64)  # 64: the model's files, the listening sockets
    if fit < args.max_connections:
        print(f"warning: the limit on open files (ulimit -n) fits {fit} connections: --max_connections "
              f"{args.max_connections} lowered to {fit}", file=sys.stderr, flush=True)
        app.max_connections = fit
    try:
        asyncio.run(serve(app, args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    cli(main)
