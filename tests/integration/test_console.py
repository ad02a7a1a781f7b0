"""The console at /ui, in a real browser (Debian's headless Chromium driven by
Playwright), against the real stack: a real swapper (Docker, the test bed's CPU
llama-server and SmolLM2), the real proxy (gunicorn + gevent) in front of it.

A screenshot of each state goes to the test's tmp_path."""
from __future__ import annotations

import json
import secrets
import signal
import threading

import pytest
import requests
from playwright import sync_api

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import wait_until
from tests.support.swapperproc import SwapperProcess, stack_containers

CHROMIUM = "/usr/bin/chromium"
KEY = "console-test-key-3f9a"
WAIT_MS = 90_000            # a CPU load on 2 shared cores, with room


def quick_stop(sw: SwapperProcess) -> SwapperProcess:
    """Its stops made gunicorn's quick shutdown (SIGINT: the worker leaves at once; the
    swapper's exit clean-up still runs). A graceful one (SIGTERM) waits gunicorn's
    graceful_timeout, 30 s, for the page's /events and /logs streams, which never end
    while the page is open (the log follow not even once the proxy is gone: it waits on
    Docker for the backend's next line), and was killed at ServiceProcess.stop's 30 s."""
    sw.stop_signal = signal.SIGINT
    return sw


@pytest.fixture(scope="module")
def swapper():
    import docker
    client = docker.from_env()
    client.ping()
    with SwapperProcess() as sw:
        quick_stop(sw)
        yield sw
    assert stack_containers(client, sw.stack) == [], "a backend container leaked"


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0") as p:
        yield p


@pytest.fixture(scope="module")
def keyed_proxy(swapper, tmp_path_factory):
    """API_KEY set, and a key store (SQLite): until a test makes a key in it, the
    door is API_KEY's alone, as without the store."""
    db = str(tmp_path_factory.mktemp("console-keys") / "keys.db")
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0", API_KEY=KEY, KEYS_DB=db) as p:
        yield p


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        # attacker.test and rebind.test: names of an attacker's pages (issue 28), which
        # this browser resolves to 127.0.0.1 (a DNS-rebinding name, in the second case).
        b = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox",
            "--host-resolver-rules=MAP attacker.test 127.0.0.1, MAP rebind.test 127.0.0.1"])
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
    assert rec["queue_wait"] >= 0                # it joined the load: the swapper said how long
    assert first.locator(".wait").inner_text() != "–"

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

    # A model that cannot start: failed, with its message (the container's last words).
    broken = page.locator('#models tr[data-model="broken"]')
    broken.locator("button.load").click()
    wait_status(page, "broken", "failed", timeout=WAIT_MS)
    assert broken.locator("td.status .detail").inner_text().strip()
    page.screenshot(path=str(tmp_path / "4b-failed.png"), full_page=True)

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
    # It still steers, from the keyboard alone: Enter on "Load tiny-a", Tab to its
    # "Unload tiny-a", Space; the focus stays on the pressed button through each
    # action and re-render, and both status changes are announced (aria-live).
    page.evaluate("""() => { window.said = []; new MutationObserver(() => window.said.push(
        document.getElementById('announce').textContent)).observe(
        document.getElementById('announce'), {childList: true, characterData: true, subtree: true}); }""")
    focused = "() => document.activeElement.getAttribute('aria-label')"
    row.locator("button.load").focus()
    page.keyboard.press("Enter")
    wait_status(page, "tiny-a", "loaded")
    page.wait_for_timeout(1500)                      # a render and a poll after the load
    assert page.evaluate(focused) == "Load tiny-a"
    page.keyboard.press("Tab")
    assert page.evaluate(focused) == "Unload tiny-a"
    page.keyboard.press(" ")
    wait_status(page, "tiny-a", "unloaded")
    page.wait_for_timeout(1500)
    assert page.evaluate(focused) == "Unload tiny-a"
    said = page.evaluate("() => window.said")
    assert "tiny-a: loaded" in said and "tiny-a: unloaded" in said, said
    assert page.locator("#announce").get_attribute("aria-live") == "polite"
    for m in ids:                                    # every row's buttons named for its model
        for verb in ("Load", "Unload"):
            assert page.get_by_role("button", name=f"{verb} {m}", exact=True).count() == 1


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


# ------------------------------------------------------------------ issue 35: keys

def log_in(page, url: str, key: str) -> None:
    page.goto(url + "/ui")
    page.wait_for_selector("#keybox:not([hidden])", timeout=10_000)
    page.fill("#key", key)
    page.click("#key-save")
    page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)


def chat_as(url: str, token: str, model: str, **kw) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=WAIT_MS / 1000,
                         headers={"Authorization": f"Bearer {token}"},
                         json={"model": model, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}], **kw})


def models_of(url: str, token: str) -> list[str] | int:
    r = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"},
                     timeout=10)
    return [m["id"] for m in r.json()["data"]] if r.ok else r.status_code


def key_form(page, form: str, **fields) -> None:
    for name, value in fields.items():
        page.locator(f'{form} [name="{name}"]').fill(value)


def test_keys_made_used_changed_and_revoked_in_the_page(page, keyed_proxy, tmp_path):
    """Issue 35, from the console with API_KEY (an admin key) on a real SQLite key
    store: a key made in the page (its token shown once, copied, never in a URL, in
    localStorage or in the proxy's log) works from Python, scoped as set; its usage
    (tokens, queue wait, load seconds) shows after a request; a change made in the
    page applies; the API's refusals (409, 400, 503) are said in the page; revoked
    in the page (after a confirmation), its token is refused."""
    url = keyed_proxy.url
    admin = {"Authorization": f"Bearer {KEY}"}
    name = "alice-" + secrets.token_hex(3)
    assert requests.post(url + "/unload", headers=admin, timeout=WAIT_MS / 1000).ok
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    log_in(page, url, KEY)
    page.wait_for_selector("#keys-body:not([hidden])", timeout=10_000)

    # Made in the page: use, tiny-a only, 30 a minute, weight 2.
    key_form(page, "#key-new", name=name, models="tiny-a", rpm="30", weight="2")
    page.click("#key-new button[type=submit]")
    page.wait_for_selector("#new-token:not([hidden])", timeout=10_000)
    token = page.input_value("#nt-token")
    assert token.startswith("cs-") and len(token) == 46
    assert "Shown once." in page.locator("#new-token").inner_text()
    assert page.evaluate("() => document.activeElement.id") == "nt-token"
    page.click("#nt-copy")
    page.wait_for_function("() => document.getElementById('nt-copied').textContent === 'Copied.'",
                           timeout=5_000)
    assert page.evaluate("() => navigator.clipboard.readText()") == token
    page.screenshot(path=str(tmp_path / "1-token-shown-once.png"), full_page=True)
    page.click("#nt-done")
    assert page.locator("#new-token").is_hidden() and page.input_value("#nt-token") == ""
    assert token not in page.content()
    assert page.evaluate("() => Object.keys(localStorage)") == ["coding-stack.api-key"]
    row = page.locator(f'#keys tr[data-name="{name}"]')
    row.wait_for(timeout=10_000)
    assert [row.locator(f"td.{c}").inner_text() for c in
            ("role", "models", "max-concurrent", "rpm", "tokens-per-day", "weight", "state")] \
        == ["use", "tiny-a", "–", "30", "–", "2", "active"]
    assert row.locator("td.today").inner_text() == "–"
    revoke_button = f'button[aria-label="Revoke {name}"]'
    page.eval_on_selector(revoke_button, "b => { b.dataset.mark = 'first'; }")

    # The API's refusals, said in the form: the name taken (409), a bad field (400).
    error = page.locator("#key-new .form-error")
    key_form(page, "#key-new", name=name)
    page.click("#key-new button[type=submit]")
    page.wait_for_function("() => /exists already \\(HTTP 409\\)/.test(document.querySelector("
                           "'#key-new .form-error').textContent)", timeout=10_000)
    key_form(page, "#key-new", name=name + "-b", rpm="0")
    page.click("#key-new button[type=submit]")
    page.wait_for_function("() => /rpm must be .*\\(HTTP 400\\)/.test(document.querySelector("
                           "'#key-new .form-error').textContent)", timeout=10_000)
    assert error.is_visible() and page.locator("#new-token").is_hidden()

    # The token works from Python, scoped as set (and it is no admin key).
    assert models_of(url, token) == ["tiny-a"]
    refused = chat_as(url, token, "tiny-b")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    r = requests.get(url + "/admin/keys", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    answered = chat_as(url, token, "tiny-a")          # it waits for tiny-a's load
    assert answered.status_code == 200, answered.text

    # Its usage in the page: a row per model for the last 7 days, and today's in the list.
    def usage_row(model):
        rows = requests.get(url + "/admin/usage", params={"key": name, "model": model},
                            headers=admin, timeout=10).json()["rows"]
        return rows[0] if rows else None
    wait_until(lambda: usage_row("tiny-a"), "tiny-a's usage row written", deadline=10,
               every=0.1)
    want = usage_row("tiny-a")
    assert want["requests"] == 1 and want["prompt_tokens"] > 0 and want["load_seconds"] > 0
    page.click("#usage-refresh")
    cells = page.locator(f'#usage tr[data-key="{name}"][data-model="tiny-a"]')
    cells.wait_for(timeout=10_000)
    assert [cells.locator(f"td.{c}").inner_text() for c in
            ("requests", "prompt", "cached", "completion")] == \
        [f"{want[c]:,}" for c in ("requests", "prompt_tokens", "cached_tokens",
                                  "completion_tokens")]
    for c in ("wait", "load"):
        assert cells.locator(f"td.{c}").inner_text() not in ("–", "0 ms")
    assert page.locator(f'#usage tr[data-key="{name}"][data-model="tiny-b"] td.requests') \
        .inner_text() == "1"                           # the refused model: counted too
    assert page.locator("#usage tfoot th").inner_text() == "total"
    assert row.locator("td.today").inner_text().startswith("2 req · ")
    # Updated in place: the row's buttons are the same elements (a rebuilt row could
    # swallow a click whose press and release land on two different buttons).
    assert page.eval_on_selector(revoke_button, "b => b.dataset.mark") == "first"
    page.screenshot(path=str(tmp_path / "2-key-and-usage.png"), full_page=True)

    # Changed in the page: a bad change is said (400), a good one applies.
    page.click(f'button[aria-label="Edit {name}"]')
    edit = page.locator("#key-edit")
    assert edit.locator('[name="models"]').input_value() == "tiny-a"
    assert edit.locator('[name="rpm"]').input_value() == "30"
    assert edit.locator('[name="role"]').input_value() == "use"
    key_form(page, "#key-edit", models=" , ")
    edit.locator("button[type=submit]").click()
    page.wait_for_function("() => /at least one model.*\\(HTTP 400\\)/.test(document"
                           ".querySelector('#key-edit .form-error').textContent)", timeout=10_000)
    key_form(page, "#key-edit", models="tiny-b", rpm="", max_concurrent="1", weight="3")
    edit.locator('[name="role"]').select_option("admin")
    edit.locator("button[type=submit]").click()
    edit.wait_for(state="hidden", timeout=10_000)
    page.wait_for_function("n => document.activeElement.getAttribute('aria-label') === `Edit ${n}`",
                           arg=name, timeout=10_000)        # the focus back on its button
    page.wait_for_function("n => document.querySelector(`#keys tr[data-name='${n}'] td.models`)"
                           ".textContent === 'tiny-b'", arg=name, timeout=10_000)
    assert [row.locator(f"td.{c}").inner_text() for c in ("max-concurrent", "rpm", "weight")] \
        == ["1", "–", "3"]
    got = requests.get(url + f"/admin/keys/{name}", headers=admin, timeout=10).json()["key"]
    assert (got["role"], got["models"], got["max_concurrent"], got["rpm"], got["weight"]) == \
        ("admin", ["tiny-b"], 1, None, 3.0)
    assert row.locator("td.role").inner_text() == "admin"
    wait_until(lambda: requests.get(url + "/admin/keys", timeout=10, headers={
        "Authorization": f"Bearer {token}"}).status_code == 200,
        "the key made admin in the page reaches the admin routes", deadline=10, every=0.2)
    wait_until(lambda: chat_as(url, token, "tiny-a").status_code == 403,
               "tiny-a refused to the changed key", deadline=10, every=0.2)
    assert models_of(url, token) == ["tiny-b"]

    # The key database unreachable (the admin routes' 503, stubbed here): said in
    # the section, the last list still shown; then it clears by itself.
    def down(route):
        route.fulfill(status=503, headers={"Retry-After": "1"}, json={"error": {
            "message": "the key database is unreachable", "type": "server_error",
            "code": "key_store_unavailable"}})
    page.route("**/admin/**", down)
    page.click("#usage-refresh")
    page.wait_for_function("() => /unreachable \\(HTTP 503\\)/.test("
                           "document.getElementById('keys-msg').textContent)", timeout=10_000)
    assert row.is_visible()
    page.screenshot(path=str(tmp_path / "3-store-down.png"), full_page=True)
    page.unroute("**/admin/**", down)
    page.click("#usage-refresh")
    page.wait_for_selector("#keys-msg[hidden]", state="attached", timeout=10_000)

    # Revoked in the page, after a confirmation (cancelled once).
    page.click(f'button[aria-label="Revoke {name}"]')
    assert name in page.locator("#kc-text").inner_text()
    page.click("#kc-no")
    assert page.locator("#key-confirm").is_hidden() and models_of(url, token) == ["tiny-b"]
    assert page.evaluate("() => document.activeElement.getAttribute('aria-label')") == \
        f"Revoke {name}"
    page.click(f'button[aria-label="Revoke {name}"]')
    page.click(f'#key-confirm button:text-is("Revoke {name}")')
    row.wait_for(state="detached", timeout=10_000)
    page.check("#keys-revoked")
    gone = page.locator(f'#keys tr[data-name="{name}"][data-revoked]')
    assert gone.locator("td.state").inner_text().startswith("revoked ")
    assert gone.locator("button").count() == 0
    wait_until(lambda: models_of(url, token) == 401, "the revoked token refused", deadline=10,
               every=0.2)
    page.screenshot(path=str(tmp_path / "4-revoked.png"), full_page=True)

    # The token went in no URL the page asked for, nor in the proxy's log.
    assert not [r.url for r in page.requests_seen if token in r.url]
    assert token not in keyed_proxy.logs()
    assert requests.post(url + "/unload", headers=admin, timeout=WAIT_MS / 1000).ok


ADMIN_ROUTES = ("/load", "/unload", "/logs", "/upstream", "/admin")   # proxy/keys/auth.py
POLLS = 6                   # /running polls watched after the first 403: ~12 s at 2 s


def path_of(url: str) -> str:
    return "/" + url.split("://", 1)[1].split("/", 1)[1].split("?", 1)[0]


def is_admin_route(url: str) -> bool:
    path = path_of(url)
    return any(path == p or path.startswith(p + "/") for p in ADMIN_ROUTES)


def test_a_use_key_sees_no_keys_section(page, keyed_proxy, tmp_path):
    """A `use` key in the console, tiny-a resident (an admin's console follows its
    log): the page asked /admin/keys once, at start, got 403 admin_only (and asked
    no /admin/usage, which follows the list), and shows no keys section, no Load / Unload and no log, a line saying each needs an admin
    key; over POLLS polls of /running after that first 403 it asks no admin route
    (the log follow retried its 403 every <= 10 s, for ever). The key cannot list
    keys from the page either. Then the console's key changed to API_KEY (an
    admin): the buttons and the log are back, and Unload and Load work from the page."""
    url = keyed_proxy.url
    name = "bob-" + secrets.token_hex(3)
    admin = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(url + "/admin/keys", headers=admin, timeout=10, json={"name": name})
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    r = requests.post(url + "/load/tiny-a", headers=admin, timeout=WAIT_MS / 1000)
    assert r.status_code == 200, r.text
    seen: list[tuple] = []            # requests and answers, in the order the page saw them
    page.on("request", lambda q: seen.append(("request", q.url)))
    page.on("response", lambda a: seen.append(("response", a.url, a.status)))

    log_in(page, url, token)
    page.wait_for_function("() => S.keys.state === 'forbidden'", timeout=10_000)
    first = next(i for i, e in enumerate(seen) if e[0] == "response" and e[2] == 403)
    assert is_admin_route(seen[first][1]), seen[first]
    for _ in range(POLLS):            # the window: POLLS more polls, however long they take
        page.wait_for_event("request", lambda q: path_of(q.url) == "/running", timeout=15_000)
    asked = [e[1] for e in seen if e[0] == "request" and is_admin_route(e[1])]
    assert list(map(path_of, asked)) == ["/admin/keys"], asked         # once, at start
    assert not [e for e in seen[first:] if e[0] == "request" and is_admin_route(e[1])]
    polls = [e for e in seen[first:] if e[0] == "request" and path_of(e[1]) == "/running"]
    assert len(polls) >= POLLS

    # What it shows: the models and the resident backend; no keys, no button, no log.
    assert page.locator("#keys-panel").is_hidden()
    assert page.locator("#main").is_visible()
    wait_status(page, "tiny-a", "loaded", timeout=10_000)
    assert page.locator("#r-model").inner_text() == "tiny-a"
    assert page.locator("#models button").count() > 0           # in the page, not shown
    assert page.locator("#models button:visible").count() == 0
    assert page.get_by_role("button", name="Load tiny-a").count() == 0
    assert page.locator("#models th:visible").all_inner_texts()[-1] == "status"
    assert "need an admin key" in page.locator("#models-note").inner_text()
    assert page.locator("#log-note").inner_text() == "The backend log needs an admin key."
    assert page.locator("#log").is_hidden() and page.locator("#log").inner_text() == ""
    page.screenshot(path=str(tmp_path / "1-use-key.png"), full_page=True)
    got = page.evaluate("""async (t) => { const r = await fetch('/admin/keys',
        {headers: {Authorization: 'Bearer ' + t}}); return [r.status, await r.text()]; }""", token)
    assert got[0] == 403 and json.loads(got[1])["error"]["code"] == "admin_only"

    # The console's key changed to an admin's: asked afresh, everything is back.
    page.click("#forget-key")
    page.wait_for_selector("#keybox:not([hidden])", timeout=10_000)
    mark = len(seen)
    page.fill("#key", KEY)
    page.click("#key-save")
    row = page.locator('#models tr[data-model="tiny-a"]')
    row.locator("button.unload").wait_for(state="visible", timeout=10_000)
    assert page.locator("#models-note").is_hidden() and page.locator("#log-note").is_hidden()
    page.wait_for_function(
        "() => /llama|server|slot/.test(document.getElementById('log').textContent)", timeout=15_000)
    assert [e for e in seen[mark:] if e[0] == "response" and path_of(e[1]).startswith("/logs/")
            and e[2] == 200]
    page.wait_for_selector("#keys-panel:not([hidden])", timeout=10_000)
    row.locator("button.unload").click()
    wait_status(page, "tiny-a", "unloaded")
    row.locator("button.load").click()
    wait_status(page, "tiny-a", "loaded")
    page.screenshot(path=str(tmp_path / "2-admin-key.png"), full_page=True)
    assert requests.post(url + f"/admin/keys/{name}/revoke", headers=admin, timeout=10).ok
    assert requests.post(url + "/unload", headers=admin, timeout=WAIT_MS / 1000).ok


def test_the_first_key_through_an_open_door_keeps_its_token_shown(page, proxy):
    """A store that has never held a key and no API_KEY (stubbed here on the proxy
    without a store: its admin routes answered as such a proxy answers): the section
    says the first key closes the door; once made, the console's calls are refused
    (401) and it asks for a key, and the new token stays shown until closed."""
    token = "cs-" + "t" * 43
    closed = threading.Event()
    made = {"name": "ops", "role": "admin", "models": ["*"], "max_concurrent": None,
            "rpm": None, "tokens_per_day": None, "weight": 1.0, "created": 1.8e9,
            "revoked": None}

    def door(route):
        path = route.request.url.split("://", 1)[1].split("/", 1)[1]
        if path.startswith("ui"):
            return route.continue_()
        if closed.is_set():
            return route.fulfill(status=401, json={"error": {
                "message": "missing or wrong API key", "type": "authentication_error",
                "code": "invalid_api_key"}})
        if path == "admin/keys" and route.request.method == "POST":
            assert route.request.headers["content-type"] == "application/json"
            assert json.loads(route.request.post_data)["role"] == "admin"
            closed.set()
            return route.fulfill(status=201, json={"key": made, "token": token})
        if path.startswith("admin/keys"):
            return route.fulfill(json={"keys": []})
        if path.startswith("admin/usage"):
            return route.fulfill(json={"rows": [], "totals": {}, "pending_rows": 0})
        return route.continue_()
    page.route("**/*", door)
    page.goto(proxy.url + "/ui")
    page.wait_for_selector("#keys-body:not([hidden])", timeout=10_000)
    assert "The first key closes it" in page.locator("#keys-msg").inner_text()
    assert page.locator("#keys-empty").is_visible()
    page.locator('#key-new [name="name"]').fill("ops")
    page.select_option('#key-new [name="role"]', "admin")
    page.click("#key-new button[type=submit]")
    page.wait_for_selector("#keybox:not([hidden])", timeout=10_000)
    assert page.locator("#main").is_hidden()
    assert page.locator("#new-token").is_visible() and page.input_value("#nt-token") == token
    page.click("#nt-done")
    assert page.locator("#new-token").is_hidden() and token not in page.content()


def stub(page, models: dict, events: str, running: dict, activity: list, logs: dict) -> None:
    """The page's data calls answered from these (the page itself from the proxy)."""
    def fulfil(route):
        path = route.request.url.split("://", 1)[1].split("/", 1)[1]
        if path.startswith("ui/activity"):
            since = int(path.partition("since=")[2] or 0)
            body = {"object": "list", "data": [e for e in activity if e["seq"] > since],
                    "newest": activity[-1]["seq"] if activity else 0}
            return route.fulfill(json=body)
        if path.startswith("events"):
            return route.fulfill(body=events, content_type="text/event-stream")
        if path.startswith("v1/models"):
            return route.fulfill(json=models)
        if path.startswith("running"):
            return route.fulfill(json=running)
        for model, text in logs.items():
            if path.startswith(f"logs/{model}/stream"):
                return route.fulfill(body=text, content_type="text/plain")
        return route.continue_()
    page.route("**/*", fulfil)


def sse_of(*events: dict) -> str:
    return "".join("data: " + json.dumps(e) + "\n\n" for e in events)


def test_load_eta_queue_wait_and_swap_time(page, proxy, tmp_path):
    """From stubbed data calls: a load with past loads shows its ETA (the swapper's
    expected_seconds, counted down by the page), a request's queue wait is in
    its activity row, and the resident panel has the last load and swap times."""
    models = {"object": "list", "data": [
        {"id": "next", "aliases": [], "kind": "llamacpp", "gpus": [], "context_length": 4096,
         "status": {"value": "loading", "elapsed_seconds": 2.0, "expected_seconds": 600.0,
                    "eta_seconds": 598.0}},
        {"id": "first", "aliases": [], "kind": "llamacpp", "gpus": [],
         "context_length": 4096, "status": {"value": "unloaded"}},
        {"id": "late", "aliases": [], "kind": "llamacpp", "gpus": [],   # (as /v1/models says)
         "context_length": 4096, "status": {"value": "loading", "elapsed_seconds": 30.0,
                                            "expected_seconds": 10.0, "eta_seconds": 0.0}}]}
    events = sse_of({"event": "state", "time": 1.0, "model": "next", "state": "loading",
                     "models": {m["id"]: m["status"] for m in models["data"]}},
                    {"event": "load_started", "time": 1.0, "model": "next",
                     "expected_seconds": 600.0, "eta_seconds": 600.0})
    running = {"model": "next", "state": "loading", "since_seconds": 2.0, "in_flight": 0,
               "queued": 1, "slots": 1, "last_load_seconds": 41.5, "last_swap_seconds": 44.2,
               "expected_seconds": 600.0, "epoch": 2, "downloads": {},
               "policy": "hold", "loads_last_hour": 12, "load_seconds_last_hour": 250.3,
               "hold": {"sessions": 1, "until_seconds": 2.5, "quantum_ends_in": 7.0,
                        "waiting_model": "first"},
               "swaps": {"last_swap": {
                   "from": "first", "to": "next", "cause": "swap", "at": 1.0,
                   "phases": {"stop": 0.4, "save": 1.2, "start": 0.9, "healthy": 38.5,
                              "restore": 0.3},
                   "saved": {"prompts": 3, "tokens": 9000, "bytes": 66_500_000,
                             "seconds": 1.2},
                   "restored": {"prompts": 3, "tokens": 9000, "bytes": 66_500_000,
                                "seconds": 0.3},
                   "reprefill": {"requests": 2, "tokens": 31, "seconds": 0.4},
                   "seconds": 41.3},
                   "last_hour": {"busy_seconds": 900.0, "swap_seconds": 250.3,
                                 "reprefill_seconds": 12.0, "serving_share": 0.7648}},
               "kv_cache": {"models": {"first": {"prompts": 3, "bytes": 66_500_000},
                                       "next": {"prompts": 1, "bytes": 22_000_000}},
                            "bytes": 88_500_000, "max_bytes": 20_000_000_000,
                            "conversations_per_model": 8}}
    activity = [{"seq": 1, "time": 1_700_000_000, "dialect": "chat", "model": "first",
                 "status": 200, "queue_wait": 42.7, "ttft": 0.2, "prompt_tokens": 9,
                 "completion_tokens": 4, "tokens_per_second": 20.0, "seconds": 43.5,
                 "stream": True},
                {"seq": 2, "time": 1_700_000_050, "dialect": "messages", "model": "first",
                 "status": 200, "ttft": 0.1, "prompt_tokens": 9, "completion_tokens": 4,
                 "tokens_per_second": 20.0, "seconds": 0.5}]          # no wait said
    stub(page, models, events, running, activity, {"next": "loading next\n"})
    page.goto(proxy.url + "/ui")
    wait_status(page, "next", "loading", timeout=10_000)
    detail = page.locator('#models tr[data-model="next"] td.status .detail')
    page.wait_for_function(
        """() => /left/.test(document.querySelector(
             '#models tr[data-model="next"] td.status .detail').textContent)""", timeout=10_000)
    assert "~9 min" in detail.inner_text(), detail.inner_text()        # 600 s less ~2 s
    late = page.locator('#models tr[data-model="late"] td.status .detail').inner_text()
    assert late.startswith("30.0 s · usually 10.0 s"), late        # past its ETA
    page.wait_for_selector('#activity tbody tr[data-seq="1"]', timeout=10_000)
    assert page.locator('#activity tr[data-seq="1"] .wait').inner_text() == "42.7 s"
    assert page.locator('#activity tr[data-seq="2"] .wait').inner_text() == "–"
    headers = page.eval_on_selector_all("#activity thead th", "ths => ths.map(t => t.textContent)")
    cells = page.locator('#activity tr[data-seq="1"] td').count()
    assert len(headers) == cells and headers[4] == "wait"
    assert page.locator("#r-lastload").inner_text() == "41.5 s"
    assert page.locator("#r-lastswap").inner_text() == "44.2 s"
    assert page.locator("#r-loads").inner_text() == "12 (4 min 10 s loading)"
    assert page.locator("#r-phases").inner_text() == (
        "stop 400 ms, save 1.2 s, start 900 ms, healthy 38.5 s, restore 300 ms; saved 3 "
        "prompts (66.5 MB); restored 3; re-prefilled 31 tokens (400 ms)")
    assert page.locator("#r-share").inner_text() == \
        "76.5 % (4 min 10 s swapping, 12.0 s re-prefilling)"
    assert page.locator("#r-kept").inner_text() == \
        "4 prompts, 88.5 MB of 20.0 GB (up to 8 conversations a model)"
    assert page.locator("#r-hold").inner_text() == \
        "for 1 agent session up to 2.5 s; first in 7.0 s at most"
    page.screenshot(path=str(tmp_path / "loading-eta.png"), full_page=True)
    # Accessibility: no empty header cell; every badge state and status colour at
    # WCAG AA for its small text (4.5:1), computed from the page's own styles.
    assert "" not in page.eval_on_selector_all("th", "ths => ths.map(t => t.textContent.trim())")
    ratios = page.evaluate(CONTRAST_JS)
    assert ratios and min(ratios.values()) >= 4.5, ratios


CONTRAST_JS = """() => {
  const rgb = (c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const lum = (c) => { const v = rgb(c).map((x) => { x /= 255;
    return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const ratio = (a, b) => { const [h, l] = [lum(a), lum(b)].sort((x, y) => y - x);
    return (h + 0.05) / (l + 0.05); };
  const out = {};
  const badge = document.getElementById('conn'), keep = badge.dataset.state;
  for (const st of ['starting', 'live', 'ok', 'reconnecting', 'degraded', 'unreachable', 'key']) {
    badge.dataset.state = st;
    const cs = getComputedStyle(badge);
    out['badge ' + st] = ratio(cs.color, cs.backgroundColor);
  }
  badge.dataset.state = keep;
  const td = document.querySelector('#models td.status'), was = td.dataset.value;
  const card = getComputedStyle(document.querySelector('.card')).backgroundColor;
  for (const v of ['loaded', 'loading', 'downloading', 'failed', 'unloaded']) {
    td.dataset.value = v;
    out['status ' + v] = ratio(getComputedStyle(td).color, card);
  }
  td.dataset.value = was;
  return out;
}"""


def test_downloading_failed_and_bounded_memory(page, proxy, tmp_path):
    """The page's side of states this stack makes rarely or slowly, from stubbed data
    calls (the real proxy serves the page): a download in progress in the swapper's
    fields, a failure with its message, and bounded memory when fed far more
    requests and log lines than it keeps."""
    progress = {"event": "download_progress", "time": 1.0, "model": "big",
                "done_bytes": 12_400_000_000, "total_bytes": 28_500_000_000,
                "bytes_per_second": 85_000_000, "eta_seconds": 190.0}
    downloading = {"value": "downloading", **{k: v for k, v in progress.items()
                                              if k not in ("event", "time", "model")}}
    models = {"object": "list", "data": [
        {"id": "big", "aliases": ["b"], "kind": "llamacpp", "gpus": [0, 1],
         "context_length": 131072, "status": downloading},
        {"id": "bad", "aliases": [], "kind": "vllm", "gpus": [0], "context_length": 8192,
         "status": {"value": "failed", "failure": "the container exited: no such file"}},
        {"id": "small", "aliases": [], "kind": "llamacpp", "gpus": [],
         "context_length": 4096, "status": {"value": "loaded"}}]}
    events = sse_of({"event": "state", "time": 1.0, "model": "small", "state": "ready",
                     "models": {m["id"]: m["status"] for m in models["data"]}},
                    {"event": "download_started", "time": 1.0, "model": "big"}, progress)
    running = {"model": "small", "state": "ready", "since_seconds": 5.0, "in_flight": 1,
               "queued": 3, "slots": 2, "last_load_seconds": 2.5, "epoch": 1,
               "downloads": {"big": progress}}
    many = [{"seq": i, "time": 1_700_000_000 + i, "dialect": "chat", "model": "small",
             "status": 200, "ttft": 0.1, "prompt_tokens": 10, "completion_tokens": 5,
             "tokens_per_second": 50.0, "seconds": 0.2} for i in range(1, 501)]
    log = "".join(f"line {i}\n" for i in range(3000))
    stub(page, models, events, running, many, {"small": log})
    page.goto(proxy.url + "/ui")
    wait_status(page, "big", "downloading", timeout=10_000)
    detail = page.locator('#models tr[data-model="big"] td.status .detail').inner_text()
    assert detail == "12.4 GB / 28.5 GB · 85.0 MB/s · ~3 min 10 s left", detail
    width = page.locator('#models tr[data-model="big"] .bar > i').evaluate("e => e.style.width")
    assert width == "43.5%"
    assert page.locator('#models tr[data-model="big"] td').nth(3).inner_text() == "GPU 0, 1"
    assert "12.4 GB / 28.5 GB" in page.locator("#r-downloads").inner_text()
    wait_status(page, "bad", "failed")
    assert "no such file" in page.locator(
        '#models tr[data-model="bad"] td.status .detail').inner_text()
    assert page.locator("#r-queued").inner_text() == "3"
    assert page.locator("#r-inflight").inner_text() == "1 / 2 slots"
    page.wait_for_function("() => document.getElementById('log').textContent"
                           ".includes('line 2999')", timeout=10_000)
    page.screenshot(path=str(tmp_path / "downloading.png"), full_page=True)

    page.wait_for_timeout(2 * 2000 + 500)          # polls: the stubbed stream reconnects too
    rows = page.locator("#activity tbody tr").count()
    log_lines = page.evaluate("() => document.getElementById('log').childNodes.length")
    assert rows == 50 and log_lines <= 1000, (rows, log_lines)
    assert page.evaluate("() => S.activity.length") == 200          # as the proxy's ring
    assert page.locator("#activity tbody tr").first.get_attribute("data-seq") == "500"


def test_download_on_first_use_in_the_page(page, tmp_path):
    """A model whose files are absent (a fresh MODELS_DIR), its GGUF served by a
    stand-in Hub over HF_ENDPOINT (the Hub's resolve/HEAD protocol, Range GETs):
    the real swapper downloads it for a streamed request through the real proxy;
    the request hears the progress comments, the page shows `downloading` with
    its bytes, then `loaded`, the request gets its 200 and its queue wait. The
    next load of it shows an ETA from that load's time."""
    import docker

    from tests.support.fake_runtime import TINY_REPO, FakeHub, tiny_a_from_hub

    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o755)
    tmp_path.chmod(0o755)
    gguf, manifest = tiny_a_from_hub(tmp_path)
    client = docker.from_env()
    with FakeHub({f"{TINY_REPO}/{gguf.name}": gguf}, rate=20e6) as hub, \
            SwapperProcess(TESTBED_MODELS_DIR=str(models), MODELS_DIR=str(models),
                           MODELS_MANIFEST=str(manifest), HF_ENDPOINT=hub.url,
                           KEEPALIVE_INTERVAL="0.5") as sw, \
            ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="0") as px:
        quick_stop(sw)
        page.goto(px.url + "/ui")
        page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                               timeout=10_000)
        assert status_of(page, "tiny-a") == "unloaded"
        answer = {}

        def chat():
            r = requests.post(px.url + "/v1/chat/completions", stream=True, timeout=300, json={
                "model": "tiny-a", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            answer["status"], answer["body"] = r.status_code, r.content.decode()

        t = threading.Thread(target=chat)
        t.start()
        wait_status(page, "tiny-a", "downloading", timeout=30_000)
        page.wait_for_function(          # bytes counting, of the Hub's size, at a rate
            """() => /\\/ 98\\.4 MB · .+\\/s/.test(document.querySelector(
                 '#models tr[data-model="tiny-a"] td.status .detail').textContent)""",
            timeout=30_000)
        assert page.locator('#models tr[data-model="tiny-a"] .bar').count() == 1
        assert "tiny-a" in page.locator("#r-downloads").inner_text()
        page.screenshot(path=str(tmp_path / "1-downloading.png"), full_page=True)
        wait_status(page, "tiny-a", "loaded", timeout=WAIT_MS * 2)
        t.join(300)
        assert answer.get("status") == 200, answer
        body = answer["body"]
        assert ": downloading tiny-a: " in body and "/ 98.4 MB" in body, body[:2000]
        assert "data: [DONE]" in body and '"error"' not in body, body[-2000:]
        assert (models / gguf.name).stat().st_size == gguf.stat().st_size
        assert len([q for q in hub.requests if q[0] == "GET"]) == 1
        page.wait_for_selector("#activity tbody tr", timeout=15_000)
        rec = requests.get(px.url + "/ui/activity", timeout=10).json()["data"][-1]
        assert rec["status"] == 200 and rec["queue_wait"] > 0, rec   # it waited for the download
        assert page.locator("#activity tbody tr").first.locator(".wait").inner_text() != "–"
        page.screenshot(path=str(tmp_path / "2-downloaded-loaded.png"), full_page=True)

        # Loaded once: its next load has an ETA, from the page and in /events.
        row = page.locator('#models tr[data-model="tiny-a"]')
        row.locator("button.unload").click()
        wait_status(page, "tiny-a", "unloaded")
        seen = []
        page.expose_function("seenDetail", lambda text: seen.append(text))
        page.evaluate("""() => new MutationObserver(() => seenDetail(document.querySelector(
            '#models tr[data-model="tiny-a"] td.status .detail').textContent)).observe(
            document.getElementById('models'), {subtree: true, characterData: true, childList: true})""")
        row.locator("button.load").click()
        wait_status(page, "tiny-a", "loaded")
        assert any("left" in s for s in seen), seen
        assert page.locator("#r-lastload").inner_text() != "–"
    assert stack_containers(client, sw.stack) == []


# ------------------------------------------------------------------ issue 28: other origins

# A page on another origin, as an attacker writes it: CORS reads (simple and
# preflighted), no-cors writes, <img> GETs and <form> POSTs (text/plain: a JSON body
# a lenient server reads as JSON) against the stack. Run in that page (page.evaluate).
ATTACK_JS = """async ([base, model, other]) => {
  const out = {};
  const read = async (name, url, init) => {
    try {
      const r = await fetch(url, init);
      out[name] = {type: r.type, status: r.status,
                   text: r.type === "opaque" ? null : (await r.text()).slice(0, 300)};
    } catch (e) { out[name] = {error: String(e)}; }
  };
  const chat = JSON.stringify({model: model, max_tokens: 3,
                               messages: [{role: "user", content: "hi"}]});
  // CORS reads: simple and preflighted
  await read("cors GET /v1/models", base + "/v1/models");
  await read("cors GET /running", base + "/running");
  await read("cors GET /ui/activity", base + "/ui/activity");
  await read("cors GET /upstream slots", base + "/upstream/" + model + "/slots");
  await read("cors POST chat text/plain", base + "/v1/chat/completions",
             {method: "POST", headers: {"Content-Type": "text/plain"}, body: chat});
  await read("cors POST chat json (preflight)", base + "/v1/chat/completions",
             {method: "POST", headers: {"Content-Type": "application/json"}, body: chat});
  await read("cors POST upstream props (preflight)", base + "/upstream/" + other + "/props",
             {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"});
  await read("cors PUT load (preflight)", base + "/load/" + other, {method: "PUT"});
  // no-cors writes
  await read("no-cors GET /unload", base + "/unload", {mode: "no-cors"});
  await read("no-cors POST /unload", base + "/unload", {mode: "no-cors", method: "POST"});
  await read("no-cors POST /load", base + "/load/" + other, {mode: "no-cors", method: "POST"});
  await read("no-cors POST /models/load", base + "/models/load", {mode: "no-cors",
             method: "POST", headers: {"Content-Type": "text/plain"},
             body: JSON.stringify({model: other})});
  await read("no-cors POST chat", base + "/v1/chat/completions", {mode: "no-cors",
             method: "POST", headers: {"Content-Type": "text/plain"},
             body: JSON.stringify({model: other, max_tokens: 3, messages: [{role: "user", content: "hi"}]})});
  await read("no-cors POST slot save", base + "/upstream/" + model + "/slots/0?action=save",
             {mode: "no-cors", method: "POST", headers: {"Content-Type": "text/plain"},
              body: JSON.stringify({filename: "evil.bin"})});
  // images
  const img = (src) => new Promise((res) => {
    const i = new Image();
    i.onload = () => res("load"); i.onerror = () => res("error"); i.src = src; });
  out["img /load"] = await img(base + "/load/" + other);
  out["img /unload"] = await img(base + "/unload");
  out["img /v1/models"] = await img(base + "/v1/models");
  // forms (text/plain: a JSON body a naive server reads as JSON)
  const form = (action, name, value) => new Promise((res) => {
    const frame = document.createElement("iframe");
    const id = "f" + Math.random().toString(36).slice(2);
    frame.name = id; document.body.appendChild(frame);
    frame.onload = () => {
      let readable;
      try { readable = frame.contentDocument.body.innerText; } catch (e) { readable = null; }
      res({loaded: true, readable: readable});
    };
    const f = document.createElement("form");
    f.method = "POST"; f.action = action; f.target = id; f.enctype = "text/plain";
    const i = document.createElement("input");
    i.type = "hidden"; i.name = name; i.value = value; f.appendChild(i);
    document.body.appendChild(f); f.submit();
    setTimeout(() => res({loaded: false}), 5000);
  });
  out["form POST /load"] = await form(base + "/load/" + other, "x", "y");
  out["form POST /unload"] = await form(base + "/unload", "x", "y");
  out["form POST chat"] = await form(base + "/v1/chat/completions",
    '{"model":"' + other + '","max_tokens":3,"messages":[{"role":"user","content":"',
    'hi"}],"x":"1"}');
  return out;
}"""


@pytest.fixture(scope="module")
def attacker():
    """The attacker's own server: a page at http://attacker.test:<port> (another site;
    the browser maps the name to 127.0.0.1) and at http://127.0.0.1:<port> (the
    same site as the stack, another origin)."""
    from flask import Flask

    from tests.support.servers import ServerThread
    app = Flask("attacker")
    app.get("/")(lambda: "<!doctype html><title>a page</title><body>just a page</body>")
    with ServerThread(app) as srv:
        yield srv


def refusals(url: str, key: str | None = None) -> dict[str, float]:
    """proxy_requests_total by status, summed over routes and methods."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith("proxy_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            out[status] = out.get(status, 0) + float(line.rsplit(" ", 1)[1])
    return out


def container_ids(client, stack) -> list[str]:
    return sorted(c.id for c in stack_containers(client, stack))


@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "API_KEY"])
def test_a_page_on_another_origin_reads_nothing_changes_nothing(
        page, proxy, keyed_proxy, swapper, attacker, keyed, tmp_path):
    """Issue 28: a page on another origin used and read the stack (llama-server's
    Access-Control-Allow-Origin relayed; a text/plain chat answered and readable;
    `no-cors GET /unload` unloaded the model; a preflight to /upstream loaded one).
    With the real swapper, llama-server and SmolLM2: tiny-a is loaded, the page
    tries everything from another site and from another port of the same site, and
    a DNS-rebinding page tries the proxy under its own name. Nothing is readable,
    tiny-a is still the same container, tiny-b never started."""
    import docker
    client = docker.from_env()
    target = keyed_proxy if keyed else proxy
    auth = {"Authorization": f"Bearer {KEY}"} if keyed else {}
    r = requests.post(target.url + "/load/tiny-a", headers=auth, timeout=WAIT_MS / 1000)
    assert r.status_code == 200, r.text
    before_ids = container_ids(client, swapper.stack)
    before = refusals(target.url, KEY if keyed else None)

    for origin in (f"http://attacker.test:{attacker.port}", f"http://127.0.0.1:{attacker.port}"):
        page.goto(origin + "/")
        out = page.evaluate(ATTACK_JS, [target.url, "tiny-a", "tiny-b"])
        for name, got in out.items():
            if name.startswith("cors"):
                assert "error" in got, (origin, name, got)           # nothing readable
            elif name.startswith("no-cors"):
                assert got == {"type": "opaque", "status": 0, "text": None}, (origin, name)
            elif name.startswith("img"):
                assert got == "error", (origin, name, got)
            else:
                assert got["loaded"] and got["readable"] is None, (origin, name, got)
    page.screenshot(path=str(tmp_path / "attacker.png"))

    # DNS rebinding: the attacker's name now resolves to 127.0.0.1; to the browser the
    # proxy is then the page's own origin, so it may read what the proxy answers.
    port = target.url.rsplit(":", 1)[1]
    r = page.goto(f"http://rebind.test:{port}/ui")
    assert r.status == 421
    got = page.evaluate("""async () => { const out = [];
        for (const [m, p] of [["GET", "/v1/models"], ["GET", "/running"],
                              ["GET", "/upstream/tiny-a/slots"], ["POST", "/unload"],
                              ["POST", "/load/tiny-b"]]) {
          const r = await fetch(p, {method: m}); out.push([p, r.status, await r.text()]); }
        return out; }""")
    for path, status, text in got:
        assert status == 421 and "tiny-a" not in text and "slot" not in text, (path, text)

    # Nothing changed: the same tiny-a container serves, tiny-b never started.
    running = requests.get(target.url + "/running", headers=auth, timeout=10).json()
    assert running["model"] == "tiny-a" and running["state"] == "ready", running
    assert container_ids(client, swapper.stack) == before_ids
    statuses = {m["id"]: m["status"]["value"] for m in requests.get(
        target.url + "/v1/models", headers=auth, timeout=10).json()["data"]}
    assert statuses["tiny-b"] in ("unloaded", "failed"), statuses
    # ... and the requests did reach the proxy, which refused them.
    after = refusals(target.url, KEY if keyed else None)
    assert after.get("403", 0) - before.get("403", 0) >= 2 * 17, (before, after)
    assert after.get("421", 0) - before.get("421", 0) >= 6, (before, after)
    requests.post(target.url + "/unload", headers=auth, timeout=WAIT_MS / 1000)


def test_the_console_works_from_its_own_origin_under_another_name(page, proxy):
    """The console reached as http://localhost:<port> (a loopback name, not the
    address) is its own origin: its page, event stream and data calls pass. This
    proxy has no key store: the keys section says keys are off, and offers nothing."""
    port = proxy.url.rsplit(":", 1)[1]
    page.goto(f"http://localhost:{port}/ui")
    page.wait_for_selector('#models tr[data-model="tiny-a"]', timeout=10_000)
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                           timeout=10_000)
    page.wait_for_selector("#keys-panel:not([hidden])", timeout=10_000)
    assert page.locator("#keys-msg").inner_text().startswith("Keys are off: set KEYS_DB")
    assert page.locator("#keys-body").is_hidden()


def test_an_allowlisted_origin_reads_through_the_proxys_own_cors(page, swapper, attacker):
    """CORS_ORIGINS: that origin's simple and preflighted reads work in a real browser
    (the preflight answered by the proxy: Authorization allowed, nothing routed), with
    the proxy's Access-Control-Allow-Origin only; any other origin is still refused."""
    allowed = f"http://attacker.test:{attacker.port}"
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0", API_KEY=KEY,
                      CORS_ORIGINS=allowed) as p:
        reads = """async ([base, key]) => { const out = {};
            for (const [name, init] of [["simple", {}],
                                        ["preflighted", {headers: {Authorization: "Bearer " + key}}]]) {
              try { const r = await fetch(base + "/v1/models", init);
                    out[name] = [r.status, await r.text()]; }
              catch (e) { out[name] = String(e); } }
            return out; }"""
        page.goto(allowed + "/")
        got = page.evaluate(reads, [p.url, KEY])
        assert got["simple"][0] == 401                  # readable: the key's refusal
        assert got["preflighted"][0] == 200 and "tiny-a" in got["preflighted"][1], got
        page.goto(f"http://127.0.0.1:{attacker.port}/")
        got = page.evaluate(reads, [p.url, KEY])
        assert all(isinstance(v, str) and "Failed to fetch" in v for v in got.values()), got


# A page's reads of the published backend port: simple ones, and preflighted ones with
# the backend's key (handed to the page here: the worst case, a page that knows it).
BACKEND_READS_JS = """async ([base, key]) => {
  const out = {};
  const read = async (name, url, init) => {
    try { const r = await fetch(url, init);
          out[name] = {status: r.status, text: (await r.text()).slice(0, 200)}; }
    catch (e) { out[name] = {error: String(e)}; }
  };
  const chat = JSON.stringify({max_tokens: 2, messages: [{role: "user", content: "hi"}]});
  await read("GET /health", base + "/health");
  await read("GET /health, credentials", base + "/health", {credentials: "include"});
  await read("GET /v1/models", base + "/v1/models");
  await read("POST chat text/plain", base + "/v1/chat/completions",
             {method: "POST", headers: {"Content-Type": "text/plain"}, body: chat});
  await read("POST chat X-Api-Key (preflight)", base + "/v1/chat/completions",
             {method: "POST", body: chat,
              headers: {"Content-Type": "application/json", "X-Api-Key": key}});
  await read("POST chat Authorization, credentials (preflight)",
             base + "/v1/chat/completions",
             {method: "POST", body: chat, credentials: "include",
              headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key}});
  return out;
}"""


def test_a_page_reads_nothing_from_the_published_backend_port(page, swapper, attacker):
    """Issue 35: llama-server echoed any page's Origin in Access-Control-Allow-Origin
    (credentials allowed on its preflight): a page on another site, or on another port
    of localhost, read /health and every answer it could get (all of them with the key,
    through X-Api-Key). Its kind now starts it with `--cors-origins none
    --no-cors-credentials`: in a real browser, with tiny-a loaded, every read fails,
    even with the backend's key handed to the page; the key still opens the port to
    curl and SDKs (no Origin, no browser)."""
    r = requests.post(swapper.url + "/load/tiny-a", timeout=WAIT_MS / 1000)
    assert r.status_code == 200, r.text
    for origin in (f"http://attacker.test:{attacker.port}", f"http://127.0.0.1:{attacker.port}"):
        page.goto(origin + "/")
        got = page.evaluate(BACKEND_READS_JS, [swapper.backend_url, swapper.backend_key])
        for name, res in got.items():
            assert "Failed to fetch" in res.get("error", ""), (origin, name, res)
    keyed = requests.post(swapper.backend_url + "/v1/chat/completions", timeout=60,
                          headers=swapper.backend_headers,
                          json={"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2})
    assert keyed.status_code == 200 and keyed.json()["choices"], keyed.text[:300]
    requests.post(swapper.url + "/unload", timeout=WAIT_MS / 1000)


def test_every_request_listed_once_over_a_slow_link(page, proxy, tmp_path):
    """Chromium's network emulation makes every call of the page take ~2.5 s (more
    than the 2 s poll period) while requests reach the proxy: polls must not overlap
    and ask from the same point (each appended the same records again: issue 30).
    Every record the proxy lists is in the page exactly once, in order."""
    page.goto(proxy.url + "/ui")
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                           timeout=10_000)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {
        "offline": False, "latency": 2500, "downloadThroughput": -1, "uploadThroughput": -1})
    before = requests.get(proxy.url + "/ui/activity", timeout=10).json()["newest"]
    for i in range(6):                       # records arriving while slow polls run
        r = requests.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            "model": f"no-such-model-{i}", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404, r.text
        page.wait_for_timeout(1500)
    listed = [e["seq"] for e in requests.get(proxy.url + "/ui/activity", timeout=10).json()["data"]]
    assert listed[-1] >= before + 6
    page.wait_for_function("n => S.activity.length && S.activity[S.activity.length - 1].seq >= n",
                           arg=listed[-1], timeout=20_000)
    page.wait_for_timeout(6000)              # polls still in flight land (or would duplicate)
    seqs = page.evaluate("() => S.activity.map((e) => e.seq)")
    assert seqs == listed[-len(seqs):] and len(seqs) == min(len(listed), 200), (seqs, listed)
    rows = page.eval_on_selector_all("#activity tbody tr", "rs => rs.map((r) => +r.dataset.seq)")
    assert rows == sorted(set(rows), reverse=True) == listed[::-1][:50], rows
    page.screenshot(path=str(tmp_path / "slow-link.png"), full_page=True)


def test_a_call_that_hangs_does_not_stop_the_polls(page, proxy):
    """One poll at a time: a call of a poll that never answers (here /running, held
    by the stub) is given up after S.callMs (10 s; 1 s here), so polling goes on:
    a request listed after the hang still appears."""
    models = {"object": "list", "data": [{"id": "m", "aliases": [], "kind": "llamacpp",
                                          "gpus": [], "status": {"value": "unloaded"}}]}
    running = {"model": None, "state": "idle", "in_flight": 0, "queued": 0, "epoch": 1,
               "downloads": {}}
    rec = {"time": 1_700_000_000, "dialect": "chat", "model": "m", "status": 200, "seconds": 0.1}
    activity = [{"seq": 1, **rec}]
    stub(page, models, sse_of({"event": "state", "time": 1.0, "models": {}}), running,
         activity, {})
    hang = threading.Event()
    held = []

    def running_or_hang(route):
        if hang.is_set():
            held.append(route)            # never answered
            return
        route.fulfill(json=running)
    page.route("**/running", running_or_hang)
    page.goto(proxy.url + "/ui")
    page.wait_for_selector('#activity tbody tr[data-seq="1"]', timeout=10_000)
    page.evaluate("() => { S.callMs = 1000; }")
    hang.set()
    page.wait_for_timeout(2500)                          # a poll is stuck on /running
    assert held
    activity.append({"seq": 2, **rec})
    page.wait_for_selector('#activity tbody tr[data-seq="2"]', timeout=8_000)
    assert page.evaluate("() => S.activity.map((e) => e.seq)") == [1, 2]
