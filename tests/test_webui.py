"""The browser chat page that `npllama serve` answers at `/`.

First its files and headers, over HTTP with the tiny model (content types, caching, the
Content-Security-Policy, the API key, `--no-webui`, the package data). Then the page itself in
a real headless Chromium (Debian's `chromium` and `chromium-driver`, which `make test`
installs), driven by Selenium against two real `npllama serve` processes with the default
model on loopback, one of them with `--api-key`.

Every wait on the page is an explicit WebDriverWait. The servers answer one request before
the browser starts, so that a cold kernel cache is compiled under the fixture's own generous
wait, not under the page's. Each test saves a screenshot under its tmp_path; the README's
(docs/webui.png) is one of them, copied by hand.
"""
from __future__ import annotations

import configparser
import fnmatch
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

import npllama
from npllama.server.run import build

ROOT = Path(__file__).parents[1]
STATIC = ROOT / "npllama" / "server" / "webui" / "static"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "page-key-123"
CTX = 1024  # the main server's context: the over-the-context test sends more
FIRST_ANSWER_S = 120  # kernels are compiled before the browser starts; this is for a slow, busy machine
ANSWER_S = 90
QUESTION = "Write a Python function that checks whether a number is prime, and explain it."
LONG_QUESTION = "Write a very long story about a dragon who learns to cook, with many chapters."

pytestmark = [pytest.mark.timeout(900)]


# ---- the files and headers, without a browser ---------------------------------------------------
class _Server:
    """A server of `model` in a thread (as tests/test_server.py's Running), for HTTP checks only."""

    def __init__(self, model, **options):
        ready = threading.Event()
        self.server = build(model, host="127.0.0.1", port=0, log_level="error", ctx=64, parallel=1,
                            on_ready=lambda url: (setattr(self, "url", url), ready.set()), **options)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the server did not start"

    def get(self, path, **kw):
        return httpx.get(self.url + path, timeout=30, **kw)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert self.server.app.state.internal_errors == []


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path):
    return npllama.Model(tiny_model_path)


def _page_files(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)


def test_page_and_files_have_types_caching_and_a_strict_csp(tiny_model):
    s = _Server(tiny_model)
    try:
        page = s.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
        assert page.headers["cache-control"] == "no-cache" and page.headers["x-content-type-options"] == "nosniff"
        # no inline script or handler for the CSP to refuse: every script is a file, no on* attribute
        html = page.text
        assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="/ui/app.js">']
        assert not re.search(r"\son[a-z]+\s*=", html, re.I) and "<style" not in html and "style=" not in html
        assert '<meta name="npllama-auth" content="none">' in html
        files = _page_files(html)
        assert {"/ui/app.js", "/ui/style.css", "/ui/icon.svg"} <= set(files)
        # the modules and what they import, each served as JavaScript
        modules = ["/ui/app.js"]
        for path in modules:
            r = s.get(path)
            assert r.status_code == 200 and r.headers["content-type"] == "text/javascript; charset=utf-8", path
            assert r.headers["content-security-policy"] == csp
            for name in re.findall(r'^import .* from "\./([^"]+)";$', r.text, re.M):
                if f"/ui/{name}" not in modules:
                    modules.append(f"/ui/{name}")
        assert {"/ui/markdown.js", "/ui/api.js", "/ui/store.js", "/ui/vendor/marked-18.3.0.esm.js",
                "/ui/vendor/purify-3.5.0.es.mjs"} <= set(modules)
        for path in modules:
            vendored = path.startswith("/ui/vendor/")
            assert s.get(path).headers["cache-control"] == ("public, max-age=31536000, immutable" if vendored
                                                            else "no-cache"), path
        css = s.get("/ui/style.css")
        assert css.headers["content-type"] == "text/css; charset=utf-8"
        assert s.get("/ui/icon.svg").headers["content-type"] == "image/svg+xml"
        # a file not changed since the browser's copy: 304 on its ETag, still with the headers
        again = s.get("/ui/style.css", headers={"if-none-match": css.headers["etag"]})
        assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"
        assert s.get("/ui/nothing.js").status_code == 404
        assert s.get("/ui/../app.py").status_code == 404
        # the context size the page shows
        assert s.get("/v1/models").json()["data"][0]["max_model_len"] == 64
    finally:
        s.close()


def test_api_key_guards_the_api_but_not_the_page(tiny_model):
    s = _Server(tiny_model, api_key=KEY)
    try:
        page = s.get("/")
        assert page.status_code == 200 and '<meta name="npllama-auth" content="bearer">' in page.text
        for path in _page_files(page.text) + ["/ui/vendor/purify-3.5.0.es.mjs"]:
            assert s.get(path).status_code == 200, path
        assert s.get("/v1/models").status_code == 401
        assert s.get("/uix").status_code == 401  # only / and /ui/... are public
        assert s.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        s.close()


def test_no_webui_turns_the_page_off(tiny_model_path, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(tmp_path / "stderr", "w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "npllama", "serve", "-m", str(tiny_model_path), "--port", "0",
                              "-c", "64", "--parallel", "1", "--log-level", "warning", "--no-webui"],
                             env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = p.stdout.readline()
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            assert m, (line, err.seek(0), err.read())
            assert "chat in a browser" not in line
            url = m.group(1)
            assert httpx.get(url + "/").status_code == 404
            assert httpx.get(url + "/ui/app.js").status_code == 404
            assert httpx.get(url + "/v1/models").status_code == 200
        finally:
            p.terminate()
            p.wait(30)


def test_package_data_ships_every_page_file():
    """setup.cfg's package_data globs cover every file of static/ (an installed wheel has them)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["npllama.server.webui"].split(",")]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert len(files) >= 10
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert missing == []


# ---- the page in Chromium, against the default model -------------------------------------------
def _start(model_path, log: Path, *args):
    """`npllama serve` in a process of its own, its stderr in `log`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "npllama", "serve", "-m", str(model_path), "--port", "0",
                                 "--parallel", "2", "--log-level", "warning", *args],
                                env=env, stdout=subprocess.PIPE, stderr=err, text=True)


def _ready(p, log: Path, key=None) -> str:
    """The URL of server process `p` once it has answered a request (its kernels compiled)."""
    line = p.stdout.readline()
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    assert m, f"npllama serve did not start (exit {p.poll()}): {line!r}\n{log.read_text()}"
    url = m.group(1)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=600,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
    assert r.status_code == 200, r.text
    return url


@pytest.fixture(scope="module")
def servers(default_model_path, tmp_path_factory):
    """(the plain server's URL, the --api-key server's URL): real `npllama serve` processes."""
    logs = tmp_path_factory.mktemp("serve")
    procs = [_start(default_model_path, logs / "plain.log", "-c", str(CTX)),
             _start(default_model_path, logs / "key.log", "-c", "512", "--api-key", KEY)]
    try:
        yield _ready(procs[0], logs / "plain.log"), _ready(procs[1], logs / "key.log", KEY)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        message = f"{CHROMIUM} or {CHROMEDRIVER} is missing: apt-get install -y chromium chromium-driver"
        if os.environ.get("NPLLAMA_SKIP_BROWSER") == "1":
            pytest.skip(message + " (skipped: NPLLAMA_SKIP_BROWSER=1)")
        pytest.fail(message + " (or set NPLLAMA_SKIP_BROWSER=1 to skip the browser tests)", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1200,820", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    d.set_page_load_timeout(60)
    d.set_script_timeout(60)
    yield d
    d.quit()


def _wait(driver, timeout, poll=0.2):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=poll)


def _by_id(driver, name):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, name)


def _all(driver, css):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, css)


def _open(driver, url):
    """Load the page and wait until it shows the model's name (the logs drained before)."""
    _severe(driver), _requested(driver)
    driver.get(url + "/")
    _wait(driver, 60).until(lambda d: _by_id(d, "model-name").text.startswith("SmolLM2"))


def _severe(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _requested(driver, origin="") -> list[str]:
    """Every URL that documents of `origin` asked the network for since the last call (Chrome's
    performance log; Chrome's own pages, such as the new tab page it starts on, are left out)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent" and msg["params"]["documentURL"].startswith(origin):
            urls.append(msg["params"]["request"]["url"])
    return urls


def _open_settings(driver):
    if not _by_id(driver, "settings").get_attribute("open"):
        _all(driver, "#settings summary")[0].click()


def _set(driver, element_id, value):
    """Type `value` into a setting, opening the settings first as a person would."""
    _open_settings(driver)
    el = _by_id(driver, element_id)
    el.clear()
    if value != "":
        el.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def _choose(driver, element_id, value):
    """Pick the option `value` of a select in the settings."""
    from selenium.webdriver.support.ui import Select
    _open_settings(driver)
    Select(_by_id(driver, element_id)).select_by_value(value)


def _record_requests(driver):
    """From now on the page's fetch bodies collect in window.sent."""
    driver.execute_script("window.sent = []; const f = window.fetch; "
                          "window.fetch = (u, o) => { window.sent.push(o && o.body); return f(u, o); };")


def _ask(driver, text):
    from selenium.webdriver.common.keys import Keys
    box = _by_id(driver, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def _answers(driver):
    return _all(driver, "#messages .message.assistant")


def _wait_answered(driver, n, timeout=ANSWER_S):
    """Wait until the page shows `n` answers and the last one is over (its stats shown)."""
    _wait(driver, timeout).until(lambda d: len(_answers(d)) == n and _by_id(d, "send").is_displayed())
    return _answers(driver)[-1]


def _new_chat(driver):
    n = len(_all(driver, "#conversations li"))
    _by_id(driver, "new-chat").click()
    _wait(driver, 10).until(lambda d: len(_all(d, "#conversations li")) == n + 1 and not _answers(d))


def _metric(url, name) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_chat_streams_stops_keeps_and_reports_errors(driver, servers, tmp_path):
    url = servers[0]
    _open(driver, url)
    # the page loaded without a console error, and asked nothing of another origin
    assert _severe(driver) == []
    requested = _requested(driver, url)
    assert f"{url}/ui/vendor/purify-3.5.0.es.mjs" in requested and f"{url}/v1/models" in requested
    assert [u for u in requested if not u.startswith(url + "/")] == []
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(u.startswith(url + "/") for u in resources)
    assert _by_id(driver, "model-ctx").text == f"{CTX} tokens of context"

    # a question: Enter sends it, and the answer grows over several reads while it streams
    _set(driver, "temperature", 0)
    _set(driver, "max-tokens", 160)
    _ask(driver, QUESTION)
    lengths = []

    def grown(d):
        body = _answers(d)[0].find_element("css selector", ".body") if _answers(d) else None
        if body is not None and body.text and (not lengths or len(body.text) != lengths[-1]):
            lengths.append(len(body.text))
        return _by_id(d, "send").is_displayed() and lengths
    _wait(driver, FIRST_ANSWER_S, poll=0.05).until(grown)
    assert len(lengths) >= 3 and lengths == sorted(lengths), lengths
    first = _answers(driver)[0]
    stats = first.find_element("css selector", ".stats").text
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · first token [\d.]+ s", stats), stats
    assert int(stats.split()[0]) > 20

    # a second turn in the same conversation: the request carries the first turn
    _record_requests(driver)
    _ask(driver, "Summarize that in one sentence.")
    _wait_answered(driver, 2)
    turns = [a.find_element("css selector", ".body").text for a in _answers(driver)]
    assert all(turns)
    kept = driver.execute_script("return JSON.parse(localStorage.getItem('npllama.chats.v1'))")
    chat = kept["conversations"][0]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user", "assistant"]
    body = json.loads(driver.execute_script("return window.sent[0]"))
    assert body["messages"] == [{"role": m["role"], "content": m["content"]} for m in chat["messages"][:3]]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 160
    driver.save_screenshot(str(tmp_path / "webui.png"))
    assert _severe(driver) == []

    # Stop ends an answer mid-stream, and the server lets the request go
    cancelled = _metric(url, "npllama_cancelled_requests_total")
    _new_chat(driver)
    _set(driver, "max-tokens", 900)
    _ask(driver, LONG_QUESTION)
    _wait(driver, ANSWER_S, poll=0.05).until(lambda d: _answers(d) and _answers(d)[0].text)
    _by_id(driver, "stop").click()
    stopped = _wait_answered(driver, 1, 30)
    assert stopped.find_element("css selector", ".stats").text.endswith("stopped")
    partial = stopped.find_element("css selector", ".body").text
    _wait(driver, 30).until(lambda d: _metric(url, "npllama_cancelled_requests_total") == cancelled + 1
                            and _metric(url, "npllama_running_sequences") == 0
                            and _metric(url, "npllama_kv_pages_used") == 0)
    assert _severe(driver) == []

    # a reload keeps both conversations, and the first one's messages
    driver.refresh()
    _wait(driver, 60).until(lambda d: _by_id(d, "model-name").text.startswith("SmolLM2"))
    titles = [b.get_attribute("title") for b in _all(driver, "#conversations li .open")]
    assert titles == [LONG_QUESTION[:48], QUESTION[:48]]  # a chat is named after its first message
    assert _answers(driver)[0].find_element("css selector", ".body").text == partial
    _all(driver, "#conversations li .open")[1].click()
    _wait(driver, 10).until(lambda d: len(_answers(d)) == 2)
    assert [a.find_element("css selector", ".body").text for a in _answers(driver)] == turns

    # a prompt over the context: the server's 400, explained
    _new_chat(driver)
    _set(driver, "max-tokens", "")
    long = "word " * (CTX + 200)
    driver.execute_script("document.getElementById('prompt').value = arguments[0]", long)
    _ask(driver, "!")
    error = _wait_answered(driver, 1).find_element("css selector", ".error")
    assert error.is_displayed()
    assert error.text.startswith(f"This conversation is too long for the model's context of {CTX} tokens")
    refused = httpx.post(url + "/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": long + "!"}], "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert error.text.endswith(f"({refused.json()['error']['message']})")
    logged = _severe(driver)
    assert len(logged) == 1 and "/v1/chat/completions" in logged[0] and "400" in logged[0], logged


# A model's answer that tries to run script, as the page receives it: streamed by the server.
HOSTILE = ("<img src=x onerror=alert(1)>\n\n[click](javascript:alert(2))\n\n<script>alert(3)</script>\n\n"
           "<a href=\"javascript:alert(4)\">link</a> <svg onload=alert(5)></svg>\n\n![pic](http://example.com/p.png)"
           "\n\n```python\nprint('<b>hi</b>')\n```")


def test_a_hostile_answer_runs_no_script(driver, servers):
    """The sanitising, through the page's own path: a stream whose answer is HTML with handlers
    (served by a stand-in for fetch) renders as text, with no handler, no javascript: link, no
    image loaded, and no alert; the renderer alone gives the same on each piece."""
    from selenium.common.exceptions import NoAlertPresentException
    url = servers[0]
    _open(driver, url)
    _new_chat(driver)
    driver.execute_script("""
        window.alerts = 0; window.alert = () => { window.alerts += 1; };
        const chunk = (delta) => `data: ${JSON.stringify({choices: [{index: 0, delta}]})}\n\n`;
        const text = arguments[0], pieces = text.match(/[\\s\\S]{1,7}/g);
        window.fetch = async () => new Response(new ReadableStream({start(c) {
            const enc = new TextEncoder();
            for (const p of pieces) c.enqueue(enc.encode(chunk({content: p})));
            const usage = {choices: [], usage: {completion_tokens: 9}};
            c.enqueue(enc.encode(`data: ${JSON.stringify(usage)}\n\ndata: [DONE]\n\n`));
            c.close();
        }}), {headers: {"content-type": "text/event-stream"}});""", HOSTILE)
    _ask(driver, "Say something dangerous.")
    answer = _wait_answered(driver, 1, 30)
    body = answer.find_element("css selector", ".body")
    assert "<img src=x onerror=alert(1)>" in body.text and "<script>alert(3)</script>" in body.text
    found = driver.execute_script("""
        const body = arguments[0], all = [...body.querySelectorAll("*")];
        return {img: body.querySelectorAll("img, svg, script, iframe").length,
                handlers: all.flatMap(e => [...e.attributes].map(a => a.name)).filter(n => n.startsWith("on")),
                hrefs: [...body.querySelectorAll("a")].map(a => a.getAttribute("href")),
                code: [...body.querySelectorAll(".codeblock pre code")].map(c => c.textContent),
                copy: body.querySelectorAll(".codeblock button.copy").length};""", body)
    assert found["img"] == 0 and found["handlers"] == []
    assert found["hrefs"] == [None, "http://example.com/p.png"]  # the javascript: link lost its href
    assert found["code"] == ["print('<b>hi</b>')\n"] and found["copy"] == 1
    # the renderer alone, on each piece
    pieces = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/markdown.js").then((m) => done(arguments[0].map((t) => {
            const box = document.createElement("div");
            box.append(m.toFragment(t));
            const all = [...box.querySelectorAll("*")];
            return {text: box.textContent, tags: all.map(e => e.tagName),
                    attrs: all.flatMap(e => [...e.attributes].map(a => [a.name, a.value]))};
        })));""", HOSTILE.split("\n\n"))
    for piece in pieces:
        assert not {"IMG", "SCRIPT", "SVG", "IFRAME"} & set(piece["tags"]), piece
        assert not [a for a in piece["attrs"] if a[0].startswith("on") or "javascript:" in a[1]], piece
    assert pieces[0]["text"].strip() == "<img src=x onerror=alert(1)>"
    assert driver.execute_script("return window.alerts") == 0
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text
    assert _severe(driver) == []
    assert [u for u in _requested(driver, url) if not u.startswith(url + "/")] == []  # the image was not fetched


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER = '{"temp_c": 21, "sky": "<b>sunny</b>"}'  # a tool's result, markup included: shown as text


def _kept_chat(driver):
    state = driver.execute_script("return JSON.parse(localStorage.getItem('npllama.chats.v1'))")
    return next(c for c in state["conversations"] if c["id"] == state["current"])


def test_tool_calls_by_hand(driver, servers, tmp_path):
    """With tools in Settings the model's calls show as blocks (the function's name, its arguments
    as pretty-printed JSON), each with a form for its result; once every call has one, the
    conversation goes on, and the calls and results are kept like other messages."""
    url = servers[0]
    _open(driver, url)
    _new_chat(driver)
    try:
        _set(driver, "temperature", 0)
        _set(driver, "max-tokens", 160)
        _set(driver, "tools", json.dumps(WEATHER_TOOLS))
        _choose(driver, "tool-choice", "auto")
        assert _by_id(driver, "settings-error").text == ""
        _record_requests(driver)
        _ask(driver, "What is the weather in Paris?")
        answer = _wait_answered(driver, 1)
        sent = json.loads(driver.execute_script("return window.sent[0]"))
        assert sent["tools"] == WEATHER_TOOLS and sent["tool_choice"] == "auto"
        blocks = answer.find_elements("css selector", ".tool-call")
        assert blocks, answer.text
        assert "tool_calls" not in answer.text and "<tool_call>" not in answer.text  # no raw markup
        shown = []
        for block in blocks:
            assert block.find_element("css selector", ".tool-name code").text == "get_weather"
            args_text = block.find_element("css selector", ".tool-args").text
            args = json.loads(args_text)
            assert isinstance(args["city"], str) and args_text == json.dumps(args, indent=2)
            shown.append(args)
        kept = _kept_chat(driver)["messages"]
        calls = kept[1]["tool_calls"]
        assert kept[1]["content"] == "" and [c["function"]["name"] for c in calls] == ["get_weather"] * len(blocks)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == shown
        ids = [c["id"] for c in calls]
        assert all(ids) and len(set(ids)) == len(ids)

        # a result for each call; the follow-up asks for text (tool choice "none")
        _choose(driver, "tool-choice", "none")
        for i in range(len(blocks)):
            block = _answers(driver)[0].find_elements("css selector", ".tool-call")[i]
            box = block.find_element("css selector", ".tool-result-form textarea")
            label = block.find_element("css selector", f"label[for='{box.get_attribute('id')}']")
            assert label.text == "Result of get_weather"
            box.send_keys(WEATHER)
            block.find_element("css selector", ".tool-result-form button[type=submit]").click()
            if i < len(blocks) - 1:  # calls still unanswered: the result shows, and no request is made
                _wait(driver, 10).until(lambda d: len(_all(d, ".tool-call .tool-result")) == i + 1)
                assert len(_answers(driver)) == 1 and len(_all(driver, ".tool-call form")) == len(blocks) - i - 1
        follow_up = _wait_answered(driver, 2)
        assert follow_up.find_element("css selector", ".body").text
        assert not follow_up.find_elements("css selector", ".tool-call")
        sent = json.loads(driver.execute_script("return window.sent.at(-1)"))
        assert sent["tool_choice"] == "none"
        assert sent["messages"] == [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": i, "content": WEATHER} for i in ids)]
        first = _answers(driver)[0]
        assert [r.text for r in first.find_elements("css selector", ".tool-result")] == [WEATHER] * len(ids)
        assert not first.find_elements("css selector", "form, b")  # answered, and the markup is text

        # kept in localStorage, through export and import, and after a reload
        chat = _kept_chat(driver)
        assert [m["role"] for m in chat["messages"]] == ["user", "assistant", *["tool"] * len(ids), "assistant"]
        assert [m["tool_call_id"] for m in chat["messages"][2:-1]] == ids
        again = driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            import("/ui/store.js").then((s) => done(s.parseExport(s.exportChats(s.loadChats()))
                .find((c) => c.title === arguments[0]).messages));""", chat["title"])
        assert again == chat["messages"]
        driver.save_screenshot(str(tmp_path / "webui-tools.png"))
        driver.refresh()
        _wait(driver, 60).until(lambda d: _by_id(d, "model-name").text.startswith("SmolLM2"))
        first = _answers(driver)[0]
        assert [b.find_element("css selector", ".tool-args").text for b in first.find_elements(
            "css selector", ".tool-call")] == [json.dumps(a, indent=2) for a in shown]
        assert [r.text for r in first.find_elements("css selector", ".tool-result")] == [WEATHER] * len(ids)
        assert _severe(driver) == []
    finally:
        _set(driver, "tools", "")
        _choose(driver, "tool-choice", "auto")


def test_tools_setting_is_checked(driver, servers):
    """A Tools box that is not a JSON array of function tools is explained, and nothing is sent."""
    _open(driver, servers[0])
    _new_chat(driver)
    try:
        for value, message in [("not json", "Tools (JSON) is not valid JSON: "),
                               ('{"type": "function"}', "Tools (JSON) must be an array of tools, each "),
                               ('[{"type": "function", "function": {"name": "f"}}, {"function": {"name": "g"}}]',
                                'Tools (JSON): tool 2 is not {"type": "function", "function": {"name": '),
                               ('[{"type": "function", "function": {}}]', "Tools (JSON): tool 1 is not ")]:
            _set(driver, "tools", value)
            _wait(driver, 10).until(lambda d: _by_id(d, "settings-error").text.startswith(message))
        _ask(driver, "Hi")  # refused: the settings stay open with the message
        assert not _all(driver, "#messages .message") and _by_id(driver, "prompt").get_attribute("value") == "Hi"
        assert _by_id(driver, "settings").get_attribute("open")
        assert _by_id(driver, "settings-error").text.startswith("Tools (JSON): tool 1 is not ")
        _set(driver, "tools", json.dumps(WEATHER_TOOLS))
        _wait(driver, 10).until(lambda d: _by_id(d, "settings-error").text == "")
        _set(driver, "schema", '{"type": "object"}')
        _ask(driver, "")  # Enter sends the "Hi" still in the box
        _wait(driver, 10).until(lambda d: _by_id(d, "settings-error").text.startswith(
            "Tools and a JSON Schema for the answer cannot be used together"))
        assert not _all(driver, "#messages .message")
    finally:
        _set(driver, "schema", "")
        _set(driver, "tools", "")
        _by_id(driver, "prompt").clear()
    assert _by_id(driver, "settings-error").text == ""


def test_streamed_tool_calls_build_by_index_as_text(driver, servers):
    """Calls streamed in interleaved pieces (served by a stand-in for fetch) are put together by
    their index; names and arguments that hold markup show as text; arguments cut short show as
    they are, with a note."""
    _open(driver, servers[0])
    _new_chat(driver)
    driver.execute_script("""
        window.alerts = 0; window.alert = () => { window.alerts += 1; };
        const chunk = (delta, finish) =>
            `data: ${JSON.stringify({choices: [{index: 0, delta, finish_reason: finish || null}]})}\n\n`;
        const call = (index, f) => chunk({tool_calls: [{index, ...f}]});
        const a = '{"q": "<script>alert(2)</script>", "n": [1, 2]}', b = '{"html": "<img src=x onerror=alert(3)>", "cut';
        const parts = [chunk({role: "assistant", content: ""}),
            call(0, {id: "call_a", type: "function", function: {name: "lookup", arguments: ""}}),
            call(1, {id: "call_b", type: "function", function: {name: "<img src=x onerror=alert(1)>", arguments: ""}})];
        for (let i = 0; i < Math.max(a.length, b.length); i += 6) {
            if (i < a.length) parts.push(call(0, {function: {arguments: a.slice(i, i + 6)}}));
            if (i < b.length) parts.push(call(1, {function: {arguments: b.slice(i, i + 6)}}));
        }
        parts.push(chunk({}, "length"), `data: [DONE]\n\n`);
        window.fetch = async () => new Response(new ReadableStream({start(c) {
            const enc = new TextEncoder();
            for (const p of parts) c.enqueue(enc.encode(p));
            c.close();
        }}), {headers: {"content-type": "text/event-stream"}});""")
    _ask(driver, "Look something up.")
    answer = _wait_answered(driver, 1, 30)
    blocks = answer.find_elements("css selector", ".tool-call")
    assert [b.find_element("css selector", ".tool-name code").text for b in blocks] == [
        "lookup", "<img src=x onerror=alert(1)>"]
    assert json.loads(blocks[0].find_element("css selector", ".tool-args").text) == {
        "q": "<script>alert(2)</script>", "n": [1, 2]}
    assert blocks[1].find_element("css selector", ".tool-args").text == '{"html": "<img src=x onerror=alert(3)>", "cut'
    assert blocks[1].find_element("css selector", ".tool-note").text.startswith("The arguments are not complete JSON")
    assert not blocks[0].find_elements("css selector", ".tool-note")
    assert [m["tool_calls"] for m in _kept_chat(driver)["messages"][1:]] == [[
        {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments":
                                                            '{"q": "<script>alert(2)</script>", "n": [1, 2]}'}},
        {"id": "call_b", "type": "function", "function": {"name": "<img src=x onerror=alert(1)>", "arguments":
                                                            '{"html": "<img src=x onerror=alert(3)>", "cut'}}]]
    assert not answer.find_elements("css selector", "img, script, svg")
    assert driver.execute_script("return window.alerts") == 0
    assert _severe(driver) == []


def test_api_key_flow(driver, servers, tmp_path):
    """Under --api-key the page asks for the key before any call, refuses a wrong one, keeps the
    right one in sessionStorage only, and chats with it."""
    url = servers[1]
    assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/v1/models").status_code == 401
    _severe(driver), _requested(driver)
    driver.get(url + "/")
    dialog = _by_id(driver, "key-dialog")
    _wait(driver, 30).until(lambda d: dialog.is_displayed())
    assert _severe(driver) == []  # no call was made without the key
    assert "/v1/models" not in " ".join(_requested(driver, url))
    _by_id(driver, "key").send_keys("wrong-key")
    _by_id(driver, "key-submit").click()
    _wait(driver, 30).until(lambda d: "refused the API key" in _by_id(d, "key-error").text)
    assert dialog.is_displayed()
    _by_id(driver, "key").send_keys(KEY)
    _by_id(driver, "key-submit").click()
    _wait(driver, 30).until(lambda d: not dialog.is_displayed() and _by_id(d, "model-name").text.startswith("SmolLM2"))
    assert _by_id(driver, "model-ctx").text == "512 tokens of context"
    assert driver.execute_script("return sessionStorage.getItem('npllama.apiKey')") == KEY
    stored = driver.execute_script("return Object.keys(localStorage).map(k => localStorage.getItem(k)).join()")
    assert KEY not in stored
    _set(driver, "max-tokens", 24)
    _ask(driver, "Say hello.")
    answer = _wait_answered(driver, 1)
    assert answer.find_element("css selector", ".body").text
    assert "tokens/s" in answer.find_element("css selector", ".stats").text
    driver.save_screenshot(str(tmp_path / "webui-key.png"))


def test_conversations_import_rename_delete_keyboard_and_phone_width(driver, servers, tmp_path):
    from selenium.webdriver.common.keys import Keys
    url = servers[0]
    _open(driver, url)
    export = {"format": "npllama-chats", "version": 1, "conversations": [
        {"title": "Imported one", "system": "Be brief.",
         "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello **there**"}]}]}
    (tmp_path / "chats.json").write_text(json.dumps(export))
    (tmp_path / "other.json").write_text(json.dumps({"conversations": []}))
    n = len(_all(driver, "#conversations li"))
    _by_id(driver, "import").send_keys(str(tmp_path / "chats.json"))
    _wait(driver, 10).until(lambda d: _by_id(d, "status").text == "Imported 1 chat.")
    assert len(_all(driver, "#conversations li")) == n + 1
    assert _all(driver, "#conversations li[aria-current=true] .open")[0].text == "Imported one"
    assert _answers(driver)[0].find_element("css selector", ".body strong").text == "there"
    assert _by_id(driver, "system").get_attribute("value") == "Be brief."
    _by_id(driver, "import").send_keys(str(tmp_path / "other.json"))
    _wait(driver, 10).until(lambda d: _by_id(d, "status").text.startswith("Import failed: the file is not an export"))
    # what Export writes reads back as the same conversations
    titles = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/store.js").then((s) => done(s.parseExport(s.exportChats(s.loadChats())).map((c) => c.title)));""")
    assert titles == [b.get_attribute("title") for b in _all(driver, "#conversations li .open")]

    # rename and delete, through the browser's own prompt and confirm
    _all(driver, "#conversations li[aria-current=true] button[aria-label^=Rename]")[0].click()
    prompt = _wait(driver, 10).until(lambda d: d.switch_to.alert)
    prompt.send_keys("Greetings")
    prompt.accept()
    _wait(driver, 10).until(lambda d: _all(d, "#conversations li[aria-current=true] .open")[0].text == "Greetings")
    _all(driver, "#conversations li[aria-current=true] button[aria-label^=Delete]")[0].click()
    _wait(driver, 10).until(lambda d: d.switch_to.alert).accept()
    _wait(driver, 10).until(lambda d: len(_all(d, "#conversations li")) == n)
    stored = driver.execute_script("return localStorage.getItem('npllama.chats.v1')")
    assert "Greetings" not in stored and "Imported one" not in stored

    # Shift+Enter adds a line and sends nothing
    _new_chat(driver)
    box = _by_id(driver, "prompt")
    box.send_keys("one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "two")
    assert box.get_attribute("value") == "one\ntwo" and not _all(driver, "#messages .message")

    # a phone's width: the conversations fold behind a button, the composer fits
    size = driver.get_window_size()
    try:
        driver.set_window_size(390, 844)
        toggle = _by_id(driver, "toggle-sidebar")
        _wait(driver, 10).until(lambda d: toggle.is_displayed())
        width = driver.execute_script("return document.documentElement.clientWidth")
        assert width <= 400
        _wait(driver, 10).until(lambda d: d.execute_script(  # slid out of view
            "return document.getElementById('sidebar').getBoundingClientRect().right") <= 0)
        assert driver.execute_script("return document.getElementById('send').getBoundingClientRect().right") <= width
        assert driver.execute_script("return document.documentElement.scrollWidth") <= width
        toggle.click()
        _wait(driver, 10).until(lambda d: d.execute_script(
            "return document.getElementById('sidebar').getBoundingClientRect().left") >= 0)
        assert toggle.get_attribute("aria-expanded") == "true"
        driver.save_screenshot(str(tmp_path / "webui-phone.png"))
    finally:
        driver.set_window_size(size["width"], size["height"])
    assert _severe(driver) == []
