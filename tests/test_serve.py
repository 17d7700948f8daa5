"""serve.py through the official openai client: answers equal sample.py's and greedy decoding alone, plain and
streamed, stop strings, OpenAI errors for bad requests, concurrent streams, a client that goes away stops its answer."""
import dataclasses
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

import sample
from chat import encode_chat
from checkpoint import load_model
from conftest import REPO, TINY_CONTEXT, greedy_alone, health, start_server, wait_until
from model import ModelConfig, Transformer
from tokenizer import load_tokenizer

KEY = "test-key"
QUESTIONS = ["What is the capital of Kenya?", "Which continent is Peru in?", "What is 3 + 4?", "肯尼亚的首都是哪里？",
             "What is the capital of France? 😀", "秘鲁在哪个洲？", "What is 12 + 5?", "Which continent is Japan in?"]


@pytest.fixture(scope="module")
def server(tiny_sft):
    proc, url, err = start_server(tiny_sft, f"--api_key={KEY}", "--max_batch=8")
    yield url
    proc.terminate()
    proc.wait()
    assert "warning" not in open(err.name).read()  # 127.0.0.1 by default: no warning


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_sft):
    """Greedy answers computed alone (batch 1), for questions asked with max_tokens=40: at most what the context
    leaves."""
    model, _, _ = load_model(str(tiny_sft))
    tokenizer = load_tokenizer()
    answers = {}
    for q in QUESTIONS:
        ids, _ = encode_chat(tokenizer, [{"role": "user", "content": q}])
        new = greedy_alone(model, ids, min(40, model.config.max_seq_len - len(ids)), tokenizer.eos_id)
        answers[q] = {"prompt_tokens": len(ids), "completion_tokens": len(new),
                      "finish_reason": "stop" if new[-1] == tokenizer.eos_id else "length",
                      "content": tokenizer.decode([t for t in new if t != tokenizer.eos_id]).strip(" ")}
    return answers


def ask(client, question, **options):
    options = {"temperature": 0, "max_tokens": 40, **options}
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": question}], **options)


def streamed(client, question, **options):
    """(the streamed chunks' text joined, every chunk)."""
    chunks = list(ask(client, question, stream=True, **options))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_greedy_chat_answers_are_sample_py_s_with_the_tokenizer_s_usage(client, reference, tiny_sft, capsys):
    for q in QUESTIONS[:3]:
        answer = ask(client, q)
        expected = reference[q]
        assert answer.choices[0].message.content == expected["content"]
        assert answer.choices[0].finish_reason == expected["finish_reason"]
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            expected["prompt_tokens"], expected["completion_tokens"])
        assert answer.usage.total_tokens == expected["prompt_tokens"] + expected["completion_tokens"]
        room = str(min(40, TINY_CONTEXT - expected["prompt_tokens"]))  # as the reference: the prompt whole, then what fits
        sample.main([f"--ckpt={tiny_sft}", f"--prompt={q}", "--temperature=0", f"--max_new_tokens={room}"])
        assert capsys.readouterr().out.strip() == expected["content"].strip()  # print ends the line
    assert any(reference[q]["content"] for q in QUESTIONS)  # the tiny model says something


def test_a_streamed_answer_is_the_plain_one_in_chunks(client, reference):
    for q in QUESTIONS[3:6]:  # Chinese and an emoji in the questions
        text, chunks = streamed(client, q, stream_options={"include_usage": True})
        assert chunks[0].choices[0].delta.role == "assistant"
        assert text == reference[q]["content"] and "\ufffd" not in text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference[q]["finish_reason"]
        assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reference[q]["completion_tokens"]
        assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stop_strings_end_the_answer_before_them(client, reference):
    q = max(QUESTIONS, key=lambda q: len(reference[q]["content"]))
    full = reference[q]["content"]
    k = next(k for k in range(2, len(full) - 3) if full[k - 1] != " " != full[k])  # not after a space: it shows
    stop = full[k : k + 3]
    expected = full[: full.index(stop)].rstrip(" ")
    plain = ask(client, q, stop=stop)
    assert plain.choices[0].message.content == expected and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens <= reference[q]["completion_tokens"]
    text, chunks = streamed(client, q, stop=["never there", stop])
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_completions_continue_the_text_as_greedy_decoding_alone_does(client, tiny_sft):
    model, _, _ = load_model(str(tiny_sft))
    tokenizer = load_tokenizer()
    prompt = "The capital of Kenya is"
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    out = greedy_alone(model, ids, 5, tokenizer.eos_id)  # eos last if the model ends the text there
    text = tokenizer.decode([t for t in out if t != tokenizer.eos_id])
    finish = "stop" if out[-1] == tokenizer.eos_id else "length"
    done = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=5,
                                     temperature=0)
    assert done.choices[0].text == text and done.choices[0].finish_reason == finish
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), len(out))
    chunks = list(client.completions.create(model=done.model, prompt=prompt, max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_the_context_running_out_ends_with_length(client, tiny_sft):
    tokenizer = load_tokenizer()
    prompt = " ".join(["Kenya"] * 200)
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    max_seq_len = torch.load(tiny_sft, weights_only=False)["model_config"]["max_seq_len"]
    cut = tokenizer.decode(ids[1 : max_seq_len - 2])  # room for 2 tokens
    assert len(tokenizer.encode(cut)) == max_seq_len - 3
    done = client.completions.create(model=client.models.list().data[0].id, prompt=cut, max_tokens=100,
                                     temperature=0)
    assert done.usage.completion_tokens <= 2 and done.usage.total_tokens <= max_seq_len
    assert done.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=done.model, prompt=prompt, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"


def test_the_same_seed_samples_the_same_answer(client):
    answers = {ask(client, QUESTIONS[0], temperature=1.0, seed=7).choices[0].message.content for _ in range(3)}
    assert len(answers) == 1


def raw(url, path, body: bytes | None = None, headers=None, method=None):
    """(status, parsed JSON body) of one request, whatever the status."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url + path, body, headers, method=method)
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (body, status, param or code the error names)
    (b"{not json", 400, "invalid_json"),
    (b"\xff\xfe{}", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({**CHAT, "messages": "hi"}, 400, "messages"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "temperature": 3}, 400, "temperature"),
    ({**CHAT, "top_p": 0}, 400, "top_p"),
    ({**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({**CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({**CHAT, "max_tokens": True}, 400, "max_tokens"),
    ({**CHAT, "stream": "yes"}, 400, "stream"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({**CHAT, "stop": 5}, 400, "stop"),
    ({**CHAT, "stream_options": []}, 400, "stream_options"),
    ({**CHAT, "seed": 1.5}, 400, "seed"),
    ({**CHAT, "seed": 10**30}, 400, "seed"),
    ({**CHAT, "seed": 2**64}, 400, "seed"),
    ({**CHAT, "temperature": 10**400}, 400, "temperature"),
    ({**CHAT, "top_p": -10**400}, 400, "top_p"),
    pytest.param(json.dumps(CHAT)[:-1].encode() + b', "max_tokens": ' + b"9" * 5000 + b"}", 400, "max_tokens",
                 id="max_tokens-of-5000-digits"),  # beyond Python's 4,300-digit int conversion limit
    pytest.param(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json",
                 id="nested-100000-deep"),  # beyond the parser's recursion limit
    ({**CHAT, "stop": ["x" * 250_000] * 4}, 400, "stop"),
    ({**CHAT, "n": 2}, 400, "n"),
    ({**CHAT, "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({**CHAT, "messages": [{"role": "user", "content": "Kenya " * 200}]}, 400, "context_length_exceeded"),
    ({**CHAT, "model": "gpt-4"}, 404, "model_not_found"),
]


@pytest.mark.parametrize("body, status, named", BAD)
def test_a_bad_request_gets_an_openai_error_naming_it_and_the_next_is_served(server, body, status, named):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, answer = raw(server, "/v1/chat/completions", data, {"Content-Type": "application/json"})
    error = answer["error"]
    assert code == status and named in (error["param"], error["code"]) and error["message"] and error["type"]
    assert raw(server, "/v1/chat/completions", json.dumps(CHAT).encode())[0] == 200


def test_keys_paths_and_body_size(server, client):
    status, body = raw(server, "/v1/models", headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert raw(server, "/v1/nothing")[0] == 404 and raw(server, "/v1/models", b"{}")[0] == 405
    status, body = raw(server, "/v1/chat/completions", b" " * (1024 * 1024 + 1))
    assert status == 413 and body["error"]["code"] == "body_too_large"
    assert raw(server, "/health", headers={"Authorization": ""})[1]["status"] == "ok"  # no key needed
    assert client.models.list().data[0].id == "nanomind-sft"


def test_another_host_than_loopback_is_warned_about(tiny_sft):
    proc, _, err = start_server(tiny_sft, "--host=0.0.0.0")
    proc.terminate()
    proc.wait()
    assert "warning: listening on 0.0.0.0: anyone who can reach" in open(err.name).read()


def test_eight_concurrent_streams_each_get_their_own_answer(client, reference):
    assert_concurrent_answers(client, reference)


def test_a_compiled_server_answers_as_the_eager_one(tiny_sft, reference):
    # serve.py --compile: compiled before it listens, then the same greedy answers (rows joining and leaving)
    proc, url, _ = start_server(tiny_sft, "--compile=True")
    try:
        assert_concurrent_answers(openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), reference)
    finally:
        proc.terminate()
        proc.wait()


def assert_concurrent_answers(client, reference):
    """Every question streamed at once: each answer and its usage are the greedy answer alone."""
    results, start = {}, threading.Barrier(len(QUESTIONS))

    def one(q):
        start.wait()
        results[q] = streamed(client, q, stream_options={"include_usage": True})

    threads = [threading.Thread(target=one, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in QUESTIONS:
        text, chunks = results[q]
        assert text == reference[q]["content"], q
        assert chunks[-1].usage.completion_tokens == reference[q]["completion_tokens"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_generation(long_server, stream):
    before = health(long_server)["generated_tokens"]
    host, port = long_server[len("http://"):].split(":")
    body = json.dumps({"prompt": "The capital of", "stream": stream, "temperature": 0}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    if stream:
        assert sock.recv(100).startswith(b"HTTP/1.0 200")
    while health(long_server)["generated_tokens"] == before:
        time.sleep(0.01)
    assert health(long_server)["running"] == 1
    sock.close()  # walk away mid-answer
    assert wait_until(lambda: health(long_server)["running"] == 0, seconds=30)
    generated = health(long_server)["generated_tokens"] - before
    assert generated < 4000  # the answer had room for ~4090 tokens
    body = json.dumps({"prompt": "The capital of", "max_tokens": 3, "temperature": 0}).encode()
    assert raw(long_server, "/v1/completions", body)[1]["usage"]["completion_tokens"] == 3  # served normally


def test_a_request_samples_with_a_generator_on_the_model_s_device(monkeypatch):
    """torch.multinomial on a GPU takes only a generator of that GPU: a CPU one failed every sampled request there."""
    import openai_api

    asked = []
    real = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda *args, **kw: asked.append((args, kw)) or real())
    openai_api.sampling_options({**CHAT, "temperature": 0.7}, "chat", "tiny", torch.device("cuda", 1))
    assert asked == [((torch.device("cuda", 1),), {})]


def test_a_chatml_checkpoint_is_served_in_its_own_template(tmp_path):
    """A checkpoint trained with MiniMind's tokenizer records it; the server prompts in its ChatML template
    (prompt tokens = apply_chat_template's) and answers what greedy decoding alone gives."""
    from transformers import AutoTokenizer

    minimind = os.path.join(REPO, "vocab", "minimind")
    tokenizer = load_tokenizer(minimind)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=6400, max_seq_len=128))
    ckpt = tmp_path / "chatml.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "stage": "sft",
                "config": {"tokenizer_path": minimind},
                "tokenizer": {"path": minimind, "fingerprint": tokenizer.fingerprint, "chat_template": "chatml"}}, ckpt)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "北京天气？"}]
    ids = AutoTokenizer.from_pretrained(minimind).apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False)
    out = greedy_alone(model.eval(), ids, 12, tokenizer.eos_id)
    out = out[: out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out
    proc, url, _ = start_server(ckpt)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(model="nanomind-sft", messages=messages, temperature=0, max_tokens=12)
    finally:
        proc.terminate()
        proc.wait()
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == tokenizer.decode(out).strip(" ")
