"""
Load on serve.py over HTTP, as bench.py measures it: serve.py in a subprocess on a free port, streaming greedy
/v1/completions clients, and the aggregate tokens/s of many of them at once.
"""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

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
