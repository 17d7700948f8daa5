"""The chat page in a real headless browser: Debian's chromium (apt-get install chromium) driven by playwright.
Skips only when no chromium is installed."""
import json
import os
import shutil
import urllib.request

import pytest
from playwright.sync_api import sync_playwright

from conftest import health, start_server, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = os.environ.get("CHAT_PAGE_SCREENSHOT")  # a path: also save the page's picture there (docs/)
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_sft):
    proc, url, _ = start_server(tiny_sft)
    yield url
    proc.terminate()
    proc.wait()


def api_answer(url, messages) -> tuple[str, str]:
    """The API's greedy answer and its finish_reason."""
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    page.goto(url + "/")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    # count the answer's updates as they arrive: a streamed answer shows up in several steps
    page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    return page


def send(page, text: str) -> tuple[str, bool]:
    """Type text, press Enter, wait until the page marks the answer done (its stream ended); the answer's text, and
    whether the page noted under it that it was cut."""
    n = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").nth(n)
    answer.and_(page.locator("[data-done='1']")).wait_for(timeout=60_000)
    shown, cut = answer.evaluate("""d => [[...d.childNodes].filter(c => c.nodeType === Node.TEXT_NODE)
        .map(c => c.data).join(""), d.querySelector(".note") !== null]""")
    return shown, cut


def test_a_multi_turn_chat_streams_the_api_s_answers_in_chinese_and_emoji(browser, server):
    page = open_page(browser, server)
    # the tiny model ends some answers at once: take a system prompt and question it answers in several characters
    candidates = [(s, q) for s in ("Answer briefly. 🌍", "你是一个助手。", "Be helpful.")
                  for q in ("What is the capital of Kenya? 😀", "肯尼亚的首都是哪里？😀", "What is 3 + 4? 你好")]
    system, first = next((s, q) for s, q in candidates if len(api_answer(
        server, [{"role": "system", "content": s}, {"role": "user", "content": q}])[0].strip()) > 3)
    second = "肯尼亚在哪个洲？"
    page.fill("#system", system)
    answer1, cut1 = send(page, first)
    assert page.locator(".msg.user").nth(0).inner_text() == first  # the user's text, emoji and Chinese intact
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    content, finish = api_answer(server, messages)
    assert (answer1, cut1) == (content, finish == "length")  # an answer cut at max_tokens is marked so
    assert page.evaluate("window.updates") >= 3  # the bubbles, then the answer in pieces
    answer2, cut2 = send(page, second)  # the second turn carries the first
    messages += [{"role": "assistant", "content": answer1}, {"role": "user", "content": second}]
    content, finish = api_answer(server, messages)
    assert (answer2, cut2) == (content, finish == "length")
    assert page.locator(".msg.error").count() == 0 and not page.locator("#send").is_disabled()
    if SCREENSHOT:
        page.screenshot(path=SCREENSHOT)


def test_the_stop_button_ends_the_answer_and_its_generation(browser, long_server):
    page = browser.new_page()
    page.goto(long_server + "/")
    page.fill("#max-tokens", "4000")
    page.fill("#temperature", "0")  # greedy, the random model repeats one token to the end; sampled, it may end early
    page.fill("#input", "Tell me a long story")
    page.press("#input", "Enter")
    page.locator(".msg.assistant.streaming").wait_for()
    before = health(long_server)["generated_tokens"]
    assert wait_until(lambda: health(long_server)["generated_tokens"] >= before + 20)
    assert health(long_server)["running"] == 1
    page.click("#stop")
    page.locator(".msg.assistant[data-done='1']").wait_for()
    assert "(stopped)" in page.locator(".msg.assistant").inner_text()
    page.wait_for_function("!document.getElementById('send').disabled")
    # the server stopped generating for nobody: a loaded machine may take a while to notice the closed connection
    assert wait_until(lambda: health(long_server)["running"] == 0)

