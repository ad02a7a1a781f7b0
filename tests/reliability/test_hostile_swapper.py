"""Hostile input against the real swapper (`python -m swapper`) on the real Docker
engine with the real llama-server and SmolLM2 (the test bed's registry in
tests/fixtures/backends): a request that cannot succeed never starts or evicts
a model, the model asked for is the model that answers whatever the
Content-Type, and no input makes our code answer a 5xx or leave the envelope."""
from __future__ import annotations

import json
from urllib.parse import quote

import docker
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import hostile
from tests.support.proxyproc import ProxyProcess
from tests.support.rawhttp import send
from tests.support.swapperproc import SwapperProcess, stack_containers

FORM = "application/x-www-form-urlencoded"      # what `curl -d` sends


@pytest.fixture(scope="module")
def docker_client():
    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture(scope="module")
def swapper(docker_client):
    with SwapperProcess() as sw:
        yield sw
    assert stack_containers(docker_client, sw.stack) == [], "a backend container leaked"


def running(sw) -> dict:
    return requests.get(sw.url + "/running", timeout=10).json()


def containers(client, sw) -> list[str]:
    return sorted(c.id for c in stack_containers(client, sw.stack))


def load(sw, model: str) -> None:
    r = requests.post(sw.url + f"/load/{model}", timeout=180)
    assert r.status_code == 200, r.text


def unload(sw) -> None:
    assert requests.post(sw.url + "/unload", timeout=120).status_code == 200


def chat(model=None, **extra) -> bytes:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **extra}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


# ------------------------------------------------------------------- item 6

@pytest.mark.parametrize("ctype", [FORM, None, "text/plain"])
def test_the_model_named_answers_whatever_the_content_type(swapper, ctype):
    load(swapper, "a")
    ans = send(swapper.url, "POST", "/v1/chat/completions",
               {"Content-Type": ctype} if ctype else {}, chat("b"), timeout=180)
    assert ans.status == 200, ans.body
    assert ans.json()["choices"], ans.body
    assert running(swapper)["model"] == "tiny-b"


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/chat/completions", 405),
    ("HEAD", "/v1/chat/completions", 405),
    ("PUT", "/v1/completions", 405),
    ("DELETE", "/v1/embeddings", 405),
    ("POST", "/v1/nope", 404),
    ("GET", "/v1/chat/completions/extra", 404),
    ("POST", "/v1/load_lora_adapter", 404),
    ("OPTIONS", "/v1/chat/completions", 204),
    ("OPTIONS", "/v1/nope", 404),
])
def test_a_request_that_cannot_succeed_never_loads_or_evicts(swapper, docker_client, method,
                                                             path, status):
    load(swapper, "a")
    before = containers(docker_client, swapper)
    # It even names another model: still nothing may move.
    ans = send(swapper.url, method, path, {"Content-Type": "application/json"}, chat("b"),
               timeout=30)
    assert ans.status == status, ans.body
    if status >= 400 and method != "HEAD":
        assert ans.envelope is not None, ans.body
    if status == 405:
        assert "POST" in ans.headers["allow"]
    assert containers(docker_client, swapper) == before
    snap = running(swapper)
    assert (snap["model"], snap["state"]) == ("tiny-a", "ready")


def test_a_read_of_a_state_change_moves_nothing(swapper, docker_client):
    """Issue 28: a state change acts on POST only (an <img> or a link loaded or
    unloaded a model): GET and HEAD are 405s with Allow: POST. One load for all."""
    load(swapper, "a")
    before = containers(docker_client, swapper)
    for method, path in [("GET", "/load/b"), ("HEAD", "/load/b"), ("GET", "/unload"),
                         ("HEAD", "/unload"), ("GET", "/models/load"),
                         ("GET", "/models/unload")]:
        ans = send(swapper.url, method, path, {"Content-Type": "application/json"},
                   None, timeout=30)
        assert ans.status == 405 and "POST" in ans.headers["allow"], (method, path)
        if method != "HEAD":
            assert ans.envelope is not None, ans.body
    assert containers(docker_client, swapper) == before
    snap = running(swapper)
    assert (snap["model"], snap["state"]) == ("tiny-a", "ready")


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_looking_up_a_stored_response_with_nothing_loaded_loads_nothing(swapper, docker_client,
                                                                       method):
    unload(swapper)
    ans = send(swapper.url, method, "/v1/responses/resp_123", timeout=30)
    assert ans.status == 404, ans.body
    assert ans.envelope is not None
    assert containers(docker_client, swapper) == []


def test_a_request_naming_no_model_goes_to_the_resident_model(swapper):
    load(swapper, "b")                    # not the default model (tiny-a)
    ans = send(swapper.url, "POST", "/v1/chat/completions", {"Content-Type": FORM}, chat(),
               timeout=180)
    assert ans.status == 200, ans.body
    assert running(swapper)["model"] == "tiny-b"


def test_a_request_naming_no_model_loads_the_default_when_none_is_resident(swapper):
    unload(swapper)
    ans = send(swapper.url, "POST", "/v1/chat/completions", {}, chat(), timeout=180)
    assert ans.status == 200, ans.body
    assert running(swapper)["model"] == "tiny-a"


# ------------------------------------------------------------------- item 7

REFUSED = {
    "lone surrogate": ("/v1/completions", b'{"model": "a", "prompt": "\\ud800"}', "surrogate"),
    "deep json": ("/v1/chat/completions",
                  ('{"model": "a", "messages": ' + hostile.deep(1000) + "}").encode(), "deep"),
    "array": ("/v1/chat/completions", b"[1]", "JSON object"),
    "string": ("/v1/chat/completions", b'"str"', "JSON object"),
    "model array": ("/v1/chat/completions", b'{"model": ["x"]}', "'model' must be a string"),
    "invalid utf-8": ("/v1/embeddings", b'{"model": "a", "input": "\xff"}', "UTF-8"),
    "empty": ("/v1/chat/completions", b"", "JSON object body"),
    "not json": ("/v1/chat/completions", b"model=a&messages=hi", "not valid JSON"),
    "image to text model": ("/v1/chat/completions", json.dumps({
        "model": "a", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    ).encode(), "takes no images"),
    "image to text model (responses)": ("/v1/responses", json.dumps({
        "model": "a", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}).encode(),
        "takes no images"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_input_that_cannot_succeed_is_a_400_before_any_load(swapper, docker_client, case):
    unload(swapper)
    path, body, words = REFUSED[case]
    ans = send(swapper.url, "POST", path, {"Content-Type": "application/json"}, body, timeout=30)
    assert ans.status == 400, ans.body
    assert words in ans.envelope["message"], ans.envelope
    assert containers(docker_client, swapper) == []
    assert running(swapper)["model"] is None


@pytest.mark.parametrize("body, status", [
    (b"[1]", 400), (b'"str"', 400), (b'{"model": ["x"]}', 400), (b'{"model": 5}', 400),
    (b"{", 400), (b"\xff", 400), (hostile.deep(1000).encode(), 400), (b'{"model": "zz"}', 404),
])
def test_load_refuses_bodies_it_cannot_use(swapper, docker_client, body, status):
    unload(swapper)
    ans = send(swapper.url, "POST", "/load", {"Content-Type": "application/json"}, body,
               timeout=30)
    assert ans.status == status, ans.body
    assert ans.envelope is not None, ans.body
    assert containers(docker_client, swapper) == []


@pytest.mark.parametrize("ctype", ["application/json", FORM])
def test_load_takes_a_json_body_and_answers_the_seed_fields(swapper, ctype):
    unload(swapper)
    ans = send(swapper.url, "POST", "/load", {"Content-Type": ctype}, b'{"model": "b"}',
               timeout=180)
    assert ans.status == 200, ans.body
    got = ans.json()
    assert got["loaded"] == "tiny-b"
    assert got["running"] == ["tiny-b"]
    assert got["upstream_status"] == 200
    assert isinstance(got["seconds"], float)


# ------------------------------------------------------------------- item 8

@pytest.mark.parametrize("method, target", [
    ("POST", "/upstream/a/../../unload"),
    ("POST", "/upstream/a/%2e%2e/%2e%2e/unload"),
    ("GET", "/logs/a/../../running"),
    ("GET", "/upstream/a/..%2f..%2frunning"),
    ("GET", "/v1/..%2funload"),
])
def test_dot_segments_are_refused_at_the_swapper_too(swapper, docker_client, method, target):
    load(swapper, "a")
    before = containers(docker_client, swapper)
    ans = send(swapper.url, method, target)
    assert ans.status == 400, ans.body
    assert ans.envelope["code"] == "invalid_path"
    assert containers(docker_client, swapper) == before
    assert running(swapper)["model"] == "tiny-a"


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH=0, LOG_LEVEL="warning") as p:
        yield p


@pytest.mark.parametrize("method, target", [
    ("POST", "/upstream/a/../../unload"),              # curl --path-as-is -X POST ...
    ("POST", "/upstream/a/%2e%2e/%2e%2e/unload"),
    ("GET", "/logs/a/../../unload"),
])
def test_the_issue_s_path_tricks_through_the_proxy_leave_the_model_loaded(
        swapper, proxy, docker_client, method, target):
    load(swapper, "a")
    before = containers(docker_client, swapper)
    ans = send(proxy.url, method, target, timeout=60)
    assert ans.status == 400, ans.body
    assert containers(docker_client, swapper) == before
    assert running(swapper)["model"] == "tiny-a"


def test_through_the_proxy_upstream_without_a_slash_names_no_internal_address(swapper, proxy):
    ans = send(proxy.url, "GET", "/upstream/a", timeout=180)
    assert "location" not in ans.headers, ans.headers
    assert swapper.url.split("//")[1] not in ans.body.decode("utf-8", "replace")


def test_load_by_json_body_through_the_proxy(swapper, proxy):
    unload(swapper)
    ans = send(proxy.url, "POST", "/load", {"Content-Type": FORM}, b'{"model": "b"}',
               timeout=180)
    assert ans.status == 200, ans.body
    assert ans.json()["running"] == ["tiny-b"] and ans.json()["upstream_status"] == 200


def test_upstream_without_a_slash_does_not_redirect(swapper):
    ans = send(swapper.url, "GET", "/upstream/a", timeout=180)
    assert not 300 <= ans.status < 400, (ans.status, ans.headers)
    assert "location" not in ans.headers
    ans = send(swapper.url, "GET", "/upstream/a/health", timeout=180)
    assert ans.status == 200, ans.body


# ------------------------------------------------------------------- properties

UNKNOWN = st.text(max_size=12).map(lambda s: "zz-" + s)
SWAPPER_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                  "/v1/messages", "/v1/models", "/v1/models/zz", "/v1/nope", "/load/zz",
                  "/logs/zz", "/logs/zz/stream", "/upstream/zz/health", "/upstream/zz",
                  "/running", "/healthz", "/metrics", "/nope"]


def cannot_load(body: bytes) -> bytes:
    """Make sure a body names no registered model, so no example loads one
    (what a valid request does is tested above, not swept)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(value, dict) and not (isinstance(value.get("model"), str)
                                        and value["model"].startswith("zz-")):
        value["model"] = "zz-unknown"
        return hostile.dumps(value)
    return body


@settings(max_examples=150)
@given(method=st.sampled_from(hostile.METHODS), path=st.sampled_from(SWAPPER_ROUTES),
       ctype=st.sampled_from(hostile.CONTENT_TYPES),
       body=hostile.raw_bodies(hostile.chat_bodies(UNKNOWN)))
def test_every_swapper_route_survives_any_request(swapper, docker_client, method, path, ctype,
                                                  body):
    body = cannot_load(body)
    before = containers(docker_client, swapper)
    ans = send(swapper.url, method, path, {"Content-Type": ctype} if ctype else {}, body,
               timeout=30)
    hostile.check(ans, f"{method} {path} ({ctype}) {body[:80]!r}")
    assert containers(docker_client, swapper) == before, "an example started or removed a backend"


# Issue 28: reads and preflights of the routes that change state, and requests a
# browser makes from another origin or under a rebound name, on every route.
STATE_ROUTES = ["/load/b", "/load", "/unload", "/models/load", "/models/unload",
                "/upstream/b/props", "/upstream/b/health", "/upstream/b/slots",
                "/upstream/b/slots/0?action=save", "/v1/chat/completions", "/v1/models"]
BROWSER = st.sampled_from([
    {}, {"Origin": "https://evil.example"}, {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
    {"Host": "evil.example:9000"}, {"Host": "rebind.test", "Origin": "http://rebind.test"},
    {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}])


@settings(max_examples=60)
@given(method=st.sampled_from(["GET", "HEAD", "OPTIONS", "POST"]),
       path=st.sampled_from(STATE_ROUTES), browser=BROWSER)
def test_reads_preflights_and_other_origins_never_move_a_model(swapper, docker_client, method,
                                                               path, browser):
    if method == "POST" and not browser:
        return                                   # an ordinary POST acts: tested above
    load(swapper, "a")
    before = containers(docker_client, swapper)
    ans = send(swapper.url, method, path, {"Content-Type": "application/json", **browser},
               chat("b") if method == "POST" else None, timeout=30)
    what = f"{method} {path} {browser}"
    hostile.check(ans, what)
    if "Host" in browser:
        assert ans.status == 421, (what, ans.status)
    elif browser:
        assert ans.status == 403, (what, ans.status)
    assert not any(k.startswith("access-control-") for k in ans.headers), what
    assert containers(docker_client, swapper) == before, f"{what} moved a model"
    snap = running(swapper)
    assert (snap["model"], snap["state"]) == ("tiny-a", "ready"), what


# A path segment drawn from every character: controls, DEL, non-ASCII, `?`, `#`, `%`,
# spaces; sent percent-encoded (what a client's library does) or raw where a request
# line can carry it (printable ASCII and Latin-1 beyond it).
SEGMENTS = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1,
                   max_size=10)


def encoded(seg: str, raw: bool) -> str:
    if raw:
        return "".join(c if " " < c <= "\xff" and c not in "\x7f#?%" else
                       quote(c, safe="") for c in seg)
    return quote(seg, safe="")


@settings(max_examples=120, deadline=None)
@given(method=st.sampled_from(["GET", "POST", "DELETE", "HEAD", "OPTIONS"]),
       route=st.sampled_from(["/upstream/tiny-a/{}", "/upstream/a/{}/x", "/v1/responses/{}",
                              "/v1/responses/{}/cancel", "/v1/models/{}"]),
       seg=SEGMENTS, raw=st.booleans(), query=st.none() | SEGMENTS)
def test_paths_of_any_character_reach_the_backend_and_never_jam_it(swapper, docker_client,
                                                                   method, route, seg, raw,
                                                                   query):
    """The sweep reaches the forwarding code with the real registry and a resident
    model (issue 20: `%E2%82%AC` jammed the model for good): any path is forwarded
    still encoded, or refused; nothing is a 5xx of ours; no slot stays taken."""
    if running(swapper)["model"] != "tiny-a":
        load(swapper, "tiny-a")
    target = route.format(encoded(seg, raw)) + ("" if query is None else
                                                "?" + encoded(query, raw))
    before = containers(docker_client, swapper)
    body = b"{}" if method == "POST" else None
    ans = send(swapper.url, method, target.encode("utf-8").decode("latin-1"),
               {"Content-Type": "application/json"} if body else {}, body, timeout=60)
    what = f"{method} {target}"
    hostile.check(ans, what)
    snap = running(swapper)
    assert snap["in_flight"] == 0 and snap["queued"] == 0, f"{what} left {snap}"
    assert snap["model"] == "tiny-a" and containers(docker_client, swapper) == before
