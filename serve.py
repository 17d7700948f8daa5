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
away, while the others go on. HTTP threads only parse, validate and write what the engine sends them.
"""
import dataclasses
import hmac
import json
import math
import os
import queue
import select
import socket
import sys
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from chat import encode_pieces, markup
from checkpoint import load_model
from config import check_device_and_dtype, load_config
from engine import TextStream, prompt_ids
from errors import ConfigError, DataError, cli
from openai_api import (APIError, chat_deltas, chat_message, chat_messages, get, parse_body, sampling_options,
                        thinking_option, tool_options, usage)
from reply import ReplyStream
from runtime import open_device
from scheduler import Job, QueueFull, Scheduler

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy ({e.waiting} requests are waiting); try again later",
                           code="server_busy") from None
        return job, options


class Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0). Every answer, errors from http.server's own parsing included, is
    JSON but the page."""
    server_version = "nanomind"
    default_request_version = "HTTP/1.0"  # a request line without a version still gets a status line and headers
    ROUTES = {("GET", "/"): "page", ("GET", "/health"): "health", ("GET", "/v1/models"): "models",
              ("POST", "/v1/chat/completions"): "chat", ("POST", "/v1/completions"): "completion"}

    def setup(self):
        self.timeout = self.server.app.timeout  # a send or receive stalled this long drops the connection
        self.committed = False  # the status line has gone out
        self.filler = b" "  # what a probe of a half-closed client writes: whitespace before JSON, or an SSE comment
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
                self.send_json(200, {"status": "ok", "model": app.model_id, **app.scheduler.load()})
            elif name == "models":
                self.send_json(200, {"object": "list", "data": [{"id": app.model_id, "object": "model",
                                                                 "created": app.created, "owned_by": "nanomind"}]})
            else:
                if self.headers.get_content_type() != "application/json":  # a browser's form or text/plain POST
                    raise APIError(415, "the body must be JSON sent with 'Content-Type: application/json'",
                                   "Content-Type", "unsupported_media_type")
                self.complete(name, parse_body(raw))
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
                             "usage": usage(len(job.prompt), len(job.tokens))})

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
                self.event({**head, "choices": [], "usage": usage(len(job.prompt), len(job.tokens))})
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
    max_connections: int = 128  # connections open at once; more get 503
    timeout: float = 10.0  # seconds a client has to send its request, and the longest a send or receive may stall
    # --- system
    device: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # autocast: auto is what the device runs well (float32 on a CPU); float32 forces it


def parse_args(argv: list[str]) -> Config:
    """The command line's Config, checked, allowed_hosts as a list of names (App's Host check takes them so)."""
    (args,) = load_config(argv, Config)
    check_device_and_dtype(args.device, args.dtype)
    if args.ckpt is None:
        raise ConfigError("serve.py needs --ckpt=PATH: the checkpoint to serve")
    if min(args.max_batch, args.max_body_kb, args.max_connections) < 1 or not args.timeout > 0:
        raise ConfigError("--max_batch, --max_body_kb and --max_connections must be at least 1, --timeout positive")
    return dataclasses.replace(args, allowed_hosts=[h for h in args.allowed_hosts.split(",") if h])


def main(argv: list[str]):
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
