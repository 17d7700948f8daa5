"""serve.py against clients that misbehave, on its default configuration: each request here goes through a raw
socket, so the test sees exactly what the server sends (or that it sends nothing)."""
import json
import os
import select
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from conftest import greedy_alone, start_server, wait_until
from engine import Sampling, TextStream
from model import ModelConfig, Transformer
from openai_api import MAX_STOP_CHARS
from scheduler import Job, Scheduler
from serve_load import Flood
from tokenizer import load_tokenizer

CHAT = {"messages": [{"role": "user", "content": "What is the capital of Kenya?"}], "max_tokens": 8}
WAIT = 60  # seconds: generous, for a machine whose cores are busy elsewhere


@pytest.fixture(scope="module")
def served(tiny_sft):
    """(process, port) of serve.py with its defaults: no key, 127.0.0.1."""
    proc, url, _ = start_server(tiny_sft)
    yield proc, int(url.rsplit(":", 1)[1])
    proc.terminate()
    proc.wait()


@pytest.fixture(scope="module")
def port(served):
    return served[1]


def request(method="POST", path="/v1/chat/completions", body=None, headers=None) -> bytes:
    """An HTTP/1.1 request's bytes; a JSON body with its Content-Type and Content-Length unless headers say else."""
    data = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(data)),
              **(headers or {})}
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + data


def exchange(port: int, data: bytes, half_close=False) -> tuple[int | None, dict, bytes]:
    """Send data, read until the server closes -> (status, headers, body); status None: nothing came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)  # done sending, still reading
        out = b""
        try:
            while chunk := sock.recv(1 << 16):
                out += chunk
        except ConnectionResetError:
            pass
    if not out:
        return None, {}, b""
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def error(status, headers, body) -> dict:
    """The OpenAI-shaped error of a JSON error response (asserted)."""
    assert headers.get("content-type") == "application/json", (status, headers, body[:200])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    return err


def answer(port, **options) -> str:
    status, _, body = exchange(port, request(body={**CHAT, **options}))
    assert status == 200, body[:300]
    return json.loads(body)["choices"][0]["message"]["content"]


def stream_ok(port, results: list, **options):
    """A streamed answer from a raw socket: appended to results as (status, whether it ended with [DONE])."""
    status, _, body = exchange(port, request(body={**CHAT, "stream": True, **options}))
    results.append((status, body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body))


# -----------------------------------------------------------------------------
# a failure of one row fails only that row


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_a_temperature_too_small_to_divide_by_is_greedy_and_harms_no_other_stream(port, temperature):
    greedy = answer(port, temperature=0)
    results = []
    streams = [threading.Thread(target=stream_ok, args=(port, results), kwargs={"max_tokens": 24}) for _ in range(4)]
    for t in streams:
        t.start()
    assert answer(port, temperature=temperature) == greedy
    for t in streams:
        t.join()
    assert results == [(200, True)] * 4


def test_a_job_whose_sampling_fails_gets_an_error_event_and_the_others_their_answers():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)).eval()
    scheduler, tokenizer = Scheduler(model, max_batch=3), load_tokenizer()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    # the middle job samples with something that is no generator: torch.multinomial raises for it alone
    samplings = [Sampling(0.0), Sampling(1.0, generator="not a generator"), Sampling(0.0)]
    jobs = [Job(p, 6, s, -1, TextStream(tokenizer, [], strip=False)) for p, s in zip(prompts, samplings)]
    for job in jobs:
        scheduler.submit(job)
    for _ in range(20):  # bounded: 6 tokens each
        if all(job.done for job in jobs):
            break
        scheduler.step()
    assert jobs[1].finish_reason == "error" and ("", "error") in [jobs[1].events.get() for _ in range(jobs[1].events.qsize())]
    for job in (jobs[0], jobs[2]):
        assert job.tokens == greedy_alone(model, job.prompt, 6) and job.finish_reason == "length"


# -----------------------------------------------------------------------------
# stop strings: bounded, and checked in time linear in their length


def test_stop_strings_are_bounded_and_one_at_the_bound_is_served(port):
    n = MAX_STOP_CHARS
    err = error(*exchange(port, request(body={**CHAT, "stop": ["x" * (n + 1)]})))
    assert err["param"] == "stop" and str(n) in err["message"]
    err = error(*exchange(port, request(body={**CHAT, "stop": ["x"] * 5})))
    assert err["param"] == "stop"
    assert isinstance(answer(port, stop=["x" * n, "y" * n, "xy" * (n // 2), "z" * n], max_tokens=5), str)


# -----------------------------------------------------------------------------
# framing and connections


def test_a_client_that_half_closes_after_its_request_still_gets_its_answer(port):
    greedy = answer(port, temperature=0)
    status, _, body = exchange(port, request(body={**CHAT, "temperature": 0}), half_close=True)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == greedy
    status, _, body = exchange(port, request(body={**CHAT, "temperature": 0, "stream": True}), half_close=True)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == greedy
    status, _, body = exchange(port, request(body=b'{"messages": []', headers={"Content-Length": "100"}),
                               half_close=True)  # the body ends before its length: said at once
    assert status == 400 and error(status, {"content-type": "application/json"}, body)["param"] == "Content-Length"


def test_stalled_idle_and_slow_requests_are_cut_off(port):
    status, headers, body = exchange(port, request(body=CHAT, headers={"Content-Length": "-1"}))
    assert status == 400 and error(status, headers, body)["param"] == "Content-Length"
    stalled = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    stalled.sendall(request(body=CHAT, headers={"Content-Length": "1000"}))  # fewer bytes than it says
    idle = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    slow = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    trickle = request(body=CHAT)
    for i in range(min(len(trickle), 2 * WAIT)):  # a byte every half second: never done within the timeout
        if select.select([slow], [], [], 0)[0]:  # answered or closed
            break
        slow.sendall(trickle[i : i + 1])
        time.sleep(0.5)
    else:
        pytest.fail("a request trickled in a byte at a time was never cut off")
    out = b""
    while chunk := _recv(stalled):
        out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 408 ") and json.loads(body)["error"]["code"] == "timeout"
    assert _recv(idle) == b""  # closed without an answer: nothing was asked
    for sock in (stalled, idle, slow):
        sock.close()


def _recv(sock) -> bytes:
    try:
        return sock.recv(1 << 16)
    except ConnectionResetError:
        return b""


def test_a_thousand_idle_and_trickling_connections_hold_no_slot_and_are_closed_after_the_timeout(served, port):
    proc, _ = served
    with Flood(f"http://127.0.0.1:{port}", 1000) as flood:  # half idle, half sending a request a byte at a time
        answer(port, max_tokens=4)  # answered (200, not 503) while the thousand hold their sockets
        assert len(os.listdir(f"/proc/{proc.pid}/task")) <= 64  # no thread per connection
        # every one of them is closed by the server once its --timeout (10 s) has passed, and opened again
        assert wait_until(lambda: flood.reopened >= 1000, WAIT), flood.reopened
        answer(port, max_tokens=4)


def test_connections_past_max_connections_get_503(tiny_sft):
    proc, url, _ = start_server(tiny_sft, "--max_connections=16")
    port = int(url.rsplit(":", 1)[1])
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(20)]
        status, headers, body = exchange(port, request(body=CHAT))
        assert status == 503 and error(status, headers, body)["code"] == "server_busy"
        assert headers["retry-after"] == "1"
        for sock in idle:
            sock.close()
        assert wait_until(lambda: exchange(port, request("GET", "/health"))[0] == 200)  # their handlers end
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.skipif(shutil.which("ss") is None, reason="no ss (iproute2) to read the listen backlog")
def test_the_listen_backlog_holds_clients_arriving_together(port):
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    assert int(out.split()[2]) >= 128  # a listening socket's Send-Q is its backlog (http.server's default: 5)


# -----------------------------------------------------------------------------
# JSON errors everywhere


@pytest.mark.parametrize("method, path, status, allow", [
    ("PUT", "/v1/chat/completions", 405, "POST"), ("DELETE", "/v1/completions", 405, "POST"),
    ("OPTIONS", "/v1/chat/completions", 405, "POST"), ("PATCH", "/health", 405, "GET, HEAD"),
    ("GET", "/v1/chat/completions", 405, "POST"), ("DELETE", "/nowhere", 404, None), ("BREW", "/", 501, None)])
def test_a_wrong_method_gets_a_json_error_and_405_says_what_is_allowed(port, method, path, status, allow):
    got, headers, body = exchange(port, request(method, path, headers={"Origin": "http://evil.example"}))
    assert got == status and error(got, headers, body)
    assert headers.get("allow") == allow
    assert not any(k.startswith("access-control-") for k in headers)  # no CORS: another origin's page may not read


def test_head_gets_the_headers_alone(port):
    status, headers, body = exchange(port, request("HEAD", "/health"))
    assert status == 200 and headers["content-type"] == "application/json" and body == b""
    status, headers, body = exchange(port, request("HEAD", "/v1/completions"))
    assert status == 405 and headers["allow"] == "POST" and body == b""


@pytest.mark.parametrize("data, status", [
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nX-A: " + b"b" * 70_000 + b"\r\n\r\n", 431),
    (b"NONSENSE\r\n\r\n", 400),
    (b"GET / HTTP/9.0\r\n\r\n", 505)], ids=["long-url", "many-headers", "long-header", "no-version", "http-9"])
def test_a_malformed_request_gets_a_json_error(port, data, status):
    got, headers, body = exchange(port, data)
    assert got == status and error(got, headers, body)


# -----------------------------------------------------------------------------
# web pages may not drive a server on a loopback address


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:80"])
def test_a_host_that_is_not_a_loopback_name_is_refused(port, host):
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/")]:
        status, headers, body = exchange(port, request(method, path, CHAT if method == "POST" else None,
                                                       {"Host": host}))
        assert status == 403 and error(status, headers, body)["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]", "[::1]:8000"])
def test_loopback_names_are_served(port, host):
    assert exchange(port, request(body=CHAT, headers={"Host": host}))[0] == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_post_that_is_not_json_gets_415(port, content_type):
    status, headers, body = exchange(port, request(body=CHAT, headers={"Content-Type": content_type}))
    assert status == 415 and error(status, headers, body)["param"] == "Content-Type"
    assert exchange(port, request(body=CHAT, headers={"Content-Type": "application/json; charset=utf-8"}))[0] == 200


def test_health_names_the_model_not_the_checkpoint_s_path(port, tiny_sft):
    status, _, body = exchange(port, request("GET", "/health"))
    health = json.loads(body)
    assert status == 200 and health["model"] == "nanomind-sft"
    assert str(tiny_sft) not in body.decode() and os.path.basename(os.path.dirname(tiny_sft)) not in body.decode()


def test_allowed_hosts_names_more_hosts(tiny_sft):
    proc, url, _ = start_server(tiny_sft, "--allowed_hosts=myhost.lan,other.lan")
    try:
        port = int(url.rsplit(":", 1)[1])
        assert exchange(port, request("GET", "/health", headers={"Host": "myhost.lan:8000"}))[0] == 200
        assert exchange(port, request("GET", "/health", headers={"Host": "localhost"}))[0] == 200
        assert exchange(port, request("GET", "/health", headers={"Host": "evil.example"}))[0] == 403
    finally:
        proc.terminate()
        proc.wait()


# -----------------------------------------------------------------------------
# the server keeps serving everyone else

BAD = [  # raw requests that each get a JSON 4xx
    request(body=b"{not json"),
    request(body={**CHAT, "temperature": 10**400}),
    request(body={**CHAT, "seed": 10**30}),
    request(body=b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    request(body={**CHAT, "stop": ["x" * 100_000] * 4}),
    request(body=CHAT, headers={"Host": "evil.example"}),
    request(body=CHAT, headers={"Content-Type": "text/plain"}),
    request(body=CHAT, headers={"Content-Length": "-5"}),
    request("PUT", body=CHAT),
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
]


def test_bad_requests_get_json_errors_while_32_streams_run(port):
    results, bad, start = [], [], threading.Barrier(33)

    def one():
        start.wait()
        stream_ok(port, results, max_tokens=16, temperature=0.8)

    streams = [threading.Thread(target=one) for _ in range(32)]
    for t in streams:
        t.start()
    start.wait()  # 32 connections arrive together: the listen backlog holds them
    for _ in range(3):
        for data in BAD:
            status, headers, body = exchange(port, data)
            bad.append(400 <= (status or 0) < 500 and bool(error(status, headers, body)))
    for t in streams:
        t.join()
    assert results == [(200, True)] * 32
    assert bad == [True] * len(BAD) * 3
