"""
Load on serve.py over HTTP, as bench.py measures it: serve.py in a subprocess on a free port, streaming greedy
/v1/completions clients, and the aggregate tokens/s of many of them at once; a flood of idle and trickling
connections, and how long a request takes meanwhile.
"""
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager

from runtime import allow_open_files

REPO = os.path.dirname(os.path.abspath(__file__))


@contextmanager
def running_server(ckpt: str, *flags: str):
    """with running_server(ckpt, "--key=value", ...) as url: serve.py serving ckpt on a free port until the block
    ends; url is its base, http://host:port."""
    server = subprocess.Popen([sys.executable, "serve.py", f"--ckpt={ckpt}", "--port=0", *flags], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if "http://" not in line:
            raise RuntimeError(f"serve.py did not start (exit status {server.wait()})")
        yield "http://" + line.split("http://", 1)[1].split("/", 1)[0]
    finally:
        server.terminate()
        server.wait()


def stream_completion(url: str, prompt: str, new_tokens: int) -> int:
    """One streamed greedy /v1/completions request; the tokens it generated (its usage)."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    return events[-1]["usage"]["completion_tokens"]


def timed_clients(url: str, prompts: list[str], new_tokens: int) -> float:
    """Aggregate tokens/s of one streaming client per prompt, all started together: every token over the time
    from the start to the last client's end."""
    counts = [0] * len(prompts)
    start = threading.Barrier(len(prompts) + 1)

    def client(i: int):
        start.wait()
        counts[i] = stream_completion(url, prompts[i], new_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


class Flood:
    """`n` connections held open on a server, as an attacker holds them: half idle, half sending a request a byte
    every half second. Each one the server closes (its timeout) is opened again. Use as `with Flood(url, n):`."""

    def __init__(self, url: str, n: int):
        parts = urllib.parse.urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.data = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        self.socks, self.sent, self.n, self.stop = [], [], n, threading.Event()
        self.reopened = 0  # connections the server closed, opened again

    def __enter__(self):
        allow_open_files(self.n + 256)  # the flood's sockets and the rest of this process's files
        for i in range(self.n):
            self.socks.append(socket.create_connection(self.address))
            self.sent.append(0)
        self.thread = threading.Thread(target=self.trickle, daemon=True)
        self.thread.start()
        return self

    def trickle(self):
        while not self.stop.wait(0.5):
            poll = select.poll()  # not select.select: it takes no descriptor past 1023
            for sock in self.socks:
                poll.register(sock, select.POLLIN)
            readable = {fd for fd, _ in poll.poll(0)}
            for i, sock in enumerate(self.socks):
                try:
                    if sock.fileno() in readable:  # answered (408) or closed by the server: open another
                        sock.close()
                        self.socks[i], self.sent[i] = socket.create_connection(self.address), 0
                        self.reopened += 1
                    elif i % 2 and self.sent[i] < len(self.data):
                        sock.sendall(self.data[self.sent[i] : self.sent[i] + 1])
                        self.sent[i] += 1
                except OSError:
                    pass

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for sock in self.socks:
            sock.close()


def request_seconds(url: str) -> float:
    """Seconds from sending a one-token /v1/completions request to its whole answer."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    t0 = time.perf_counter()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        response.read()
    return time.perf_counter() - t0
