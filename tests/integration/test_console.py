"""The console at /ui, in a real browser (Debian's headless Chromium driven by
Playwright), against the real stack: a real swapper (Docker, the test bed's CPU
llama-server and SmolLM2), the real proxy (gunicorn + gevent) in front of it.

A screenshot of each state goes to the test's tmp_path."""
from __future__ import annotations

import json
import threading

import pytest
import requests
from playwright import sync_api

from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess, stack_containers

CHROMIUM = "/usr/bin/chromium"
KEY = "console-test-key-3f9a"
WAIT_MS = 90_000            # a CPU load on 2 shared cores, with room


@pytest.fixture(scope="module")
def swapper():
    import docker
    client = docker.from_env()
    client.ping()
    with SwapperProcess() as sw:
        yield sw
    assert stack_containers(client, sw.stack) == [], "a backend container leaked"


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0") as p:
        yield p


@pytest.fixture(scope="module")
def keyed_proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0", API_KEY=KEY) as p:
        yield p


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 1100})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.requests_seen = []
    pg.on("request", lambda r: pg.requests_seen.append(r))
    yield pg
    ctx.close()
    assert errors == [], f"the page raised: {errors}"


def status_of(page, model: str) -> str:
    return page.locator(f'#models tr[data-model="{model}"] td.status .value').inner_text()


def wait_status(page, model: str, value: str, timeout=WAIT_MS):
    page.wait_for_function(
        """([m, v]) => { const e = document.querySelector(
             `#models tr[data-model="${m}"] td.status`); return e && e.dataset.value === v; }""",
        arg=[model, value], timeout=timeout)


def test_models_load_activity_log_unload(page, proxy, swapper, tmp_path):
    page.goto(proxy.url + "/ui")
    ids = [m["id"] for m in requests.get(proxy.url + "/v1/models", timeout=10).json()["data"]]
    page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)
    shown = page.eval_on_selector_all("#models tbody tr", "rows => rows.map(r => r.dataset.model)")
    assert shown == ids
    row = page.locator('#models tr[data-model="tiny-a"]')
    assert "a" in row.locator("td").nth(1).inner_text()          # its alias
    assert row.locator("td").nth(2).inner_text() == "llamacpp"
    assert row.locator("td").nth(4).inner_text() == "1024"       # context_length
    for m in ids:
        assert status_of(page, m) in ("unloaded", "failed")
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                           timeout=10_000)
    page.screenshot(path=str(tmp_path / "1-unloaded.png"), full_page=True)

    # Load from the page; a chat request sent meanwhile joins that load.
    row.locator("button.load").click()
    wait_status(page, "tiny-a", "loading", timeout=10_000)
    answer = {}

    def chat():
        r = requests.post(proxy.url + "/v1/chat/completions", timeout=WAIT_MS / 1000, json={
            "model": "tiny-a", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hi."}]})
        answer["status"], answer["body"] = r.status_code, r.text

    t = threading.Thread(target=chat)
    t.start()
    page.screenshot(path=str(tmp_path / "2-loading.png"), full_page=True)
    page.wait_for_function(       # the elapsed time of the load, counting
        """() => /\\d s|\\d ms/.test(document.querySelector(
             '#models tr[data-model="tiny-a"] td.status .detail').textContent)""",
        timeout=10_000)
    wait_status(page, "tiny-a", "loaded")
    t.join(WAIT_MS / 1000)
    assert answer.get("status") == 200, answer

    # The request is in the activity list with its TTFT and tokens.
    page.wait_for_function(
        """() => [...document.querySelectorAll('#activity tbody tr')].some(tr =>
             tr.querySelector('.model').textContent === 'tiny-a'
             && tr.querySelector('.ttft').textContent !== '–'
             && /^\\d+$/.test(tr.querySelector('.tokens-in').textContent)
             && /^\\d+$/.test(tr.querySelector('.tokens-out').textContent))""",
        timeout=15_000)
    first = page.locator("#activity tbody tr").first
    assert first.locator(".dialect").inner_text() == "chat (stream)"
    assert first.locator(".status").inner_text() == "200"
    assert int(first.locator(".tokens-out").inner_text()) >= 1
    # The same ring as JSON for scripts.
    data = requests.get(proxy.url + "/ui/activity", timeout=10).json()["data"]
    rec = [d for d in data if d["dialect"] == "chat"][-1]
    assert rec["model"] == "tiny-a" and rec["status"] == 200 and rec["ttft"] > 0
    assert rec["prompt_tokens"] > 0 and rec["completion_tokens"] >= 1

    # The log pane follows the backend: llama-server's own lines.
    page.wait_for_function(
        "() => /llama|server|slot/.test(document.getElementById('log').textContent)", timeout=15_000)
    assert page.locator("#r-model").inner_text() == "tiny-a"
    assert page.locator("#r-phase").inner_text() == "ready"
    assert page.locator("#r-lastload").inner_text() != "–"
    page.wait_for_timeout(2500)          # a chart sample or two
    page.screenshot(path=str(tmp_path / "3-loaded.png"), full_page=True)

    # Unload: every model back to unloaded.
    row.locator("button.unload").click()
    page.wait_for_function(
        """() => [...document.querySelectorAll('#models td.status')].every(td =>
             td.dataset.value === 'unloaded' || td.dataset.value === 'failed')""",
        timeout=WAIT_MS)
    assert status_of(page, "tiny-a") == "unloaded"
    page.screenshot(path=str(tmp_path / "4-unloaded-again.png"), full_page=True)

    # The swapper restarts: the page says so, then follows the new one.
    swapper.stop()
    page.wait_for_function("() => document.getElementById('conn').textContent === 'reconnecting'",
                           timeout=20_000)
    page.wait_for_function("() => document.getElementById('health').dataset.state === 'unreachable'",
                           timeout=10_000)
    page.screenshot(path=str(tmp_path / "5-reconnecting.png"), full_page=True)
    swapper.start()
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                           timeout=30_000)
    page.wait_for_function("() => document.getElementById('health').dataset.state === 'ok'",
                           timeout=10_000)
    row.locator("button.load").click()               # and it still steers
    wait_status(page, "tiny-a", "loaded")
    row.locator("button.unload").click()
    wait_status(page, "tiny-a", "unloaded")


def test_key_asked_nothing_shown_without_it(page, keyed_proxy, tmp_path):
    url = keyed_proxy.url
    assert requests.get(url + "/ui/activity", timeout=10).status_code == 401
    assert requests.get(url + "/ui/activity", timeout=10,
                        headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(url + "/ui/activity", timeout=10,
                        headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert requests.get(url + "/ui", timeout=10).status_code == 200      # the page holds no data

    page.goto(url + "/ui")
    page.wait_for_selector("#keybox:not([hidden])", timeout=10_000)
    assert page.locator("#main").is_hidden()
    assert page.locator("#conn").inner_text() == "API key needed"
    assert "tiny-a" not in page.content()
    page.screenshot(path=str(tmp_path / "1-key-asked.png"), full_page=True)

    page.fill("#key", "wrong-key")
    page.click("#key-save")
    page.wait_for_function(
        "() => document.getElementById('key-msg').textContent.includes('refused')", timeout=10_000)
    assert page.locator("#main").is_hidden()
    assert "tiny-a" not in page.content()

    page.fill("#key", KEY)
    page.click("#key-save")
    page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                           timeout=10_000)
    assert page.locator("#keybox").is_hidden()
    page.screenshot(path=str(tmp_path / "2-key-given.png"), full_page=True)

    # The key rides in a header, never in a URL; the event stream carried it.
    urls = [r.url for r in page.requests_seen]
    assert not [u for u in urls if KEY in u]
    events = [r for r in page.requests_seen if r.url.endswith("/events")]
    assert events and events[-1].headers.get("authorization") == f"Bearer {KEY}"

    # Kept in the browser: a reload goes straight to the data.
    page.reload()
    page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)
    assert page.locator("#keybox").is_hidden()
    assert json.loads(page.evaluate("JSON.stringify(localStorage.getItem('coding-stack.api-key'))")) == KEY
