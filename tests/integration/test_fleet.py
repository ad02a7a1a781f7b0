"""Several stacks behind a real LiteLLM proxy (deploy/fleet, issue 23).

Two real stacks on the one Docker engine -- each a swapper + proxy pair with its own
STACK_NAME and ports, CPU llama-server + SmolLM2 backends: A declares alpha and beta,
B declares beta and gamma -- and a third, C, whose proxy runs web search against a
SearXNG-shaped server in front of a scripted model that searches. In front of them the
pinned LiteLLM proxy (TESTBED_LITELLM) started from the config scripts/fleet.py
writes, with our routing plugin (deploy/fleet/routing.py). Which stack served a
request: LiteLLM's `x-litellm-model-id` header (`<stack>:<api>:<model>`; with a
person's key it is a per-request id, and the stacks' own request counters tell). Loads and
swaps: each swapper's /metrics. Docker is sampled all along: no stack ever runs two
backends.

The stacks share one PostgreSQL key store (KEYS_DATABASE_URL, a throwaway cluster
started beside the swappers): a person's key (`cs-...`) through the router is passed
on to the stack it picks and checked there (issue 35).

The tests run in order and share the stacks (one start, ~10 s of LiteLLM start-up).
"""
import concurrent.futures as cf
import contextlib
import json
import secrets
import threading
import time
import uuid

import importlib.util

import anthropic
import pytest
import requests

from tests.support.agents import QUERY, cli, codex_home, run, searching_model
from tests.support.chat import Reply, search
from tests.support.dialects import ScriptedDialects
from tests.support.fleet import (FLEET_DIR, KEY, DockerSampler, LiteLLMRouter, chat,
                                 served_by, swapper_counts)
from tests.support.metrics import scrape
from tests.support.postgres import Postgres
from tests.support.process import REPO
from tests.support.proxyproc import ProxyProcess, searching
from tests.support.servers import wait_until
from tests.support.swapperproc import SwapperProcess

A_DIR = REPO / "tests" / "fixtures" / "fleet" / "a"
B_DIR = REPO / "tests" / "fixtures" / "fleet" / "b"
# The window: 2 minutes of router health traffic at the default poll interval
# (FLEET_POLL_INTERVAL 1 s: one /healthz + one /v1/models per stack a second) is 120
# probes of each per stack; the test sends at least that many, at a short interval.
HEALTH_PROBES = 120
# The stacks have API keys, as docs/fleet.md's host step sets them; the router gets them
# as FLEET_KEY_A, _B, _C. The tests' own calls to a stack carry its key (`auth`).
STACK_KEYS = {"A": "stack-a-key-7c1e", "B": "stack-b-key-52d9", "C": "stack-c-key-0b3a"}
_KEY_OF: dict[str, str] = {}                   # a stack's base URL -> its key


def auth(url: str) -> dict:
    return {"Authorization": f"Bearer {_KEY_OF[url]}"} if url in _KEY_OF else {}
WEB = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}


class Fleet:
    pass


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    with contextlib.ExitStack() as started:
        # The stacks' shared key store: its cluster starts beside the swappers (CI time)
        f.pg = Postgres()
        started.callback(f.pg.close)
        pg_up = started.enter_context(cf.ThreadPoolExecutor(1)).submit(f.pg.start)
        keys = {"KEYS_DATABASE_URL": f.pg.url}
        # B's MAX_QUEUE=1: it is "busy beyond its queue" (503 + Retry-After) at 2 slots + 1
        sa = started.enter_context(SwapperProcess(backends_dir=A_DIR))
        sb = started.enter_context(SwapperProcess(backends_dir=B_DIR, MAX_QUEUE=1))
        pg_up.result()
        pa = started.enter_context(ProxyProcess(
            BACKEND_URL=sa.url, WEB_SEARCH=0, SYSTEM_PROMPT="", KEEPALIVE_INTERVAL=0.5,
            API_KEY=STACK_KEYS["A"], **keys))
        pb = started.enter_context(ProxyProcess(
            BACKEND_URL=sb.url, WEB_SEARCH=0, SYSTEM_PROMPT="", KEEPALIVE_INTERVAL=0.5,
            API_KEY=STACK_KEYS["B"], **keys))
        model_c = started.enter_context(ScriptedDialects())
        c_url, _ = started.enter_context(searching(model_c.url, True, API_KEY=STACK_KEYS["C"],
                                                   **keys))
        model_c.responder = searching_model
        f.sa, f.sb, f.pa, f.pb, f.c_url, f.model_c = sa, sb, pa, pb, c_url, model_c
        f.stacks = {"A": pa.url, "B": pb.url, "C": c_url}
        _KEY_OF.update({f.stacks[n]: STACK_KEYS[n] for n in f.stacks})
        f.sampler = started.enter_context(DockerSampler([sa.stack, sb.stack]))
        f.router = started.enter_context(LiteLLMRouter(
            f.stacks, cooldown=5.0, poll=0.5, keys=STACK_KEYS,
            patterns={"C": []}))                                  # A, B: the shipped ones
        f.url = f.router.url
        yield f
        # the restarted swapper of test_failover (if any) is stopped by its own test


def counts(f) -> dict:
    return {"A": swapper_counts(f.sa.url), "B": swapper_counts(f.sb.url)}


def swaps(before: dict, after: dict) -> dict:
    return {s: after[s]["swaps"] - before[s]["swaps"] for s in before}


def loads(before: dict, after: dict) -> dict:
    return {s: after[s]["loads"] - before[s]["loads"] for s in before}


def unload_all(f):
    for p in (f.pa, f.pb):
        requests.post(p.url + "/unload", timeout=30, headers=auth(p.url)).raise_for_status()
    wait_until(lambda: not any(requests.get(sw.url + "/healthz", timeout=5).json()["model"]
                               for sw in (f.sa, f.sb)),
               "both stacks idle", 30, every=0.2)
    time.sleep(1.2)                      # the router's poller (0.5 s) sees it


def load(stack_proxy: str, model: str):
    requests.post(f"{stack_proxy}/load/{model}", timeout=120,
                  headers=auth(stack_proxy)).raise_for_status()
    time.sleep(1.2)


def ok_from(f, model: str, **kw) -> str:
    r = chat(f.url, model, **kw)
    assert r.status_code == 200, r.text
    return served_by(r, f.stacks)


# ------------------------------------------------------------------ the config

def test_config_is_a_group_per_model_over_the_stacks_that_declare_it(fleet):
    groups: dict[str, set] = {}
    for d in fleet.router.config["model_list"]:
        groups.setdefault(d["model_name"], set()).add(
            (d["model_info"]["fleet_stack"], d["litellm_params"]["model"].split("/")[0]))
    assert groups["alpha"] == {("A", "openai"), ("A", "anthropic")}
    assert groups["beta"] == {("A", "openai"), ("A", "anthropic"), ("B", "openai"),
                              ("B", "anthropic")}
    assert groups["gamma"] == {("B", "openai"), ("B", "anthropic")}
    aliases = fleet.router.config["router_settings"]["model_group_alias"]
    assert aliases["al"] == "alpha" and aliases["be"] == "beta" and aliases["ga"] == "gamma"
    # the agents' own names: a wildcard group on the stacks that map them (A, B; not C)
    for glob in ("claude-*", "gpt-5*", "codex-*"):
        assert groups[glob] == {("A", "openai"), ("A", "anthropic"), ("B", "openai"),
                                ("B", "anthropic")}, glob
    assert fleet.router.config["general_settings"]["background_health_checks"] is False
    # A's and B's keys: named by variable in the config (never the key), in force on
    # the stacks (keyless: 401), passed on by the router (every test below)
    keys = {d["model_info"]["fleet_stack"]: d["litellm_params"]["api_key"]
            for d in fleet.router.config["model_list"]}
    assert keys == {n: f"os.environ/FLEET_KEY_{n}" for n in "ABC"}
    assert not any(k in json.dumps(fleet.router.config) for k in STACK_KEYS.values())
    for url in fleet.stacks.values():
        assert requests.get(url + "/v1/models", timeout=10).status_code == 401
    r = requests.get(fleet.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10)
    assert {"alpha", "beta", "gamma", "scripted-model"} <= {m["id"] for m in r.json()["data"]}


# ------------------------------------------------------------------ the router's key

@pytest.mark.parametrize("key", [None, "sk-wrong", "not-even-sk"])
def test_no_key_or_a_wrong_key_is_a_401(fleet, key):
    """Issue 30: no key was a 500 (LiteLLM's auth-error path imports prisma, which its
    proxy extra does not install: deploy/fleet/requirements.txt adds it), a wrong key
    a 400 "No connected db." (the plugin's custom_auth checks the master key). Chat,
    Responses and Messages (and its count_tokens), raw and through the OpenAI and
    Anthropic SDKs (an auth error the client shows, never retried), each in its API's
    error shape: OpenAI's on chat and Responses, Anthropic's exactly on Messages;
    nothing reaches a stack."""
    import openai

    def posts() -> float:                   # the model requests the stacks' proxies counted
        return sum(scrape(p.url, auth(p.url)).value("proxy_requests_total", method="POST")
                   for p in (fleet.pa, fleet.pb))
    n0 = posts()
    message = "Authentication Error: missing or invalid key (the router's master key)"
    anthropic_401 = {"type": "error", "error": {"type": "authentication_error", "message": message}}
    body = {"model": "beta", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    bearer = {"Authorization": f"Bearer {key}"} if key else {}
    x_api_key = {"x-api-key": key} if key else {}
    for path, headers in (
            ("/v1/chat/completions", bearer),
            ("/v1/responses", bearer),
            ("/v1/messages", {**x_api_key, "anthropic-version": "2023-06-01"}),
            ("/v1/messages?beta=true", {**bearer, "anthropic-version": "2023-06-01"}),
            ("/v1/messages/count_tokens", {**x_api_key, "anthropic-version": "2023-06-01"})):
        data = {"model": "beta", "input": "hi"} if path == "/v1/responses" else body
        r = requests.post(fleet.url + path, json=data, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
        if path.startswith("/v1/messages"):
            assert r.json() == anthropic_401, (path, r.text)
        else:
            err = r.json()["error"]
            assert err["type"] == "auth_error" and err["message"] == message, (path, err)
    if key:
        c = openai.OpenAI(base_url=fleet.url + "/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            c.chat.completions.create(model="beta", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["message"] == message, e.value.body   # the SDK keeps "error"
        a = anthropic.Anthropic(base_url=fleet.url, api_key=key, max_retries=0, timeout=30)
        with pytest.raises(anthropic.AuthenticationError) as e:
            a.messages.create(**body)
        assert e.value.body == anthropic_401 and message in str(e.value), e.value.body
        with pytest.raises(anthropic.AuthenticationError) as e:
            a.messages.count_tokens(model="beta", messages=body["messages"])
        assert e.value.body == anthropic_401, e.value.body
    assert posts() == n0                               # no 401 reached a stack
    r = chat(fleet.url, "beta")                        # the master key still passes
    assert r.status_code == 200, r.text
    wait_until(lambda: posts() == n0 + 1, "the one request counted on a stack", 10, every=0.2)


def test_no_virtual_keys_and_the_database_error_is_said(fleet):
    """This router keeps no virtual keys (no database: Prisma's engines cannot be
    installed here; docs/fleet.md, Keys): /key/generate with the master
    key answers LiteLLM's JSON error naming the missing database -- with the prisma
    package installed (deploy/fleet/requirements.txt); without it, a bare-text 500
    (LiteLLM's error path imports prisma)."""
    r = requests.post(fleet.url + "/key/generate", json={"max_budget": 1}, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 500, r.text
    assert "DB not connected" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ a person's key (issue 35)

TOKENS: list[str] = []                  # every person's key made here (never in the log)
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def make_key(f, name: str, **fields) -> str:
    """A person's key in the stacks' one store (made on A: any stack, one database)."""
    r = requests.post(f.pa.url + "/admin/keys", json={"name": name, **fields}, timeout=10,
                      headers=auth(f.pa.url))
    assert r.status_code == 201, r.text
    TOKENS.append(r.json()["token"])
    return TOKENS[-1]


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def messages(f, model: str, token: str, stream: bool = False, **body) -> requests.Response:
    return requests.post(f.url + "/v1/messages", timeout=120, stream=stream,
                         headers={"x-api-key": token, **ANTHROPIC},
                         json={"model": model, "max_tokens": 2, "stream": stream,
                               "messages": [{"role": "user", "content": "hi"}], **body})


def model_posts(f) -> dict:
    """The model requests (POSTs) each stack's proxy counted, its door's refusals too."""
    return {n: scrape(url, auth(url)).value("proxy_requests_total", method="POST")
            for n, url in f.stacks.items()}


def added(before: dict, after: dict) -> dict:
    return {n: after[n] - before[n] for n in before}


def usage(url: str, name: str) -> dict:
    """A key's usage rows as one stack reads them from the shared database: {model:
    requests}."""
    r = requests.get(url + f"/admin/usage?key={name}", timeout=10, headers=auth(url))
    assert r.status_code == 200, r.text
    return {row["model"]: row["requests"] for row in r.json()["rows"]}


def test_a_persons_key_through_the_router_on_both_dialects(fleet):
    """A key of the stacks' shared store through the router: passed on to the stack the
    plugin picks (alpha: A, gamma: B), which checks it -- chat, Responses, and
    Messages plain and streamed, 200 each, each request once on its stack."""
    token = make_key(fleet, "alice")
    before = model_posts(fleet)
    r = chat(fleet.url, "alpha", headers=bearer(token))
    assert r.status_code == 200 and r.json()["choices"][0]["message"], r.text
    r = requests.post(fleet.url + "/v1/responses", timeout=120, headers=bearer(token),
                      json={"model": "alpha", "max_output_tokens": 16, "input": "hi"})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    r = messages(fleet, "gamma", token)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    with messages(fleet, "gamma", token, stream=True) as r:
        assert r.status_code == 200, r.text
        assert b"event: message_stop" in [ln for ln in r.iter_lines() if ln]
    assert added(before, model_posts(fleet)) == {"A": 2, "B": 2, "C": 0}


def test_usage_rows_land_per_key_in_the_shared_database(fleet):
    """Each stack writes a key's rows into the one database: a request of bob's on A
    (alpha), B (gamma) and C (scripted-model) are three rows under bob, read back
    from any stack; alice's rows stay hers."""
    token = make_key(fleet, "bob")
    alice = usage(fleet.pa.url, "alice")
    for model in ("alpha", "gamma", "scripted-model"):
        r = chat(fleet.url, model, headers=bearer(token))
        assert r.status_code == 200, (model, r.text)
    want = {"alpha": 1, "gamma": 1, "scripted-model": 1}
    # each row is written just after its answer has gone
    wait_until(lambda: usage(fleet.c_url, "bob") == want, "bob's three rows", 10, every=0.1)
    for url in fleet.stacks.values():
        assert usage(url, "bob") == want
    assert usage(fleet.pb.url, "alice") == alice == {"alpha": 2, "gamma": 2}


def refused_in_each_dialect(fleet, token, status, kind, words, openai_error, anthropic_error):
    """Chat and Messages for beta with `token`, raw and through both SDKs: each the
    stack's `status` in its dialect's shape, one POST per request in all (the
    refusal is the answer: no second stack is asked)."""
    import openai
    before = model_posts(fleet)
    r = chat(fleet.url, "beta", headers=bearer(token))
    err = r.json()["error"]
    assert r.status_code == status and err["type"] == kind, r.text
    assert words in err["message"], err
    r = messages(fleet, "beta", token)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind, r.text
    assert words in r.json()["error"]["message"], r.text
    c = openai.OpenAI(base_url=fleet.url + "/v1", api_key=token, max_retries=0, timeout=60)
    with pytest.raises(getattr(openai, openai_error)):
        c.chat.completions.create(model="beta", max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}])
    a = anthropic.Anthropic(base_url=fleet.url, api_key=token, max_retries=0, timeout=60)
    with pytest.raises(getattr(anthropic, anthropic_error)):
        a.messages.create(model="beta", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert sum(added(before, model_posts(fleet)).values()) == 4


def test_a_key_scoped_to_one_model_gets_the_stacks_403(fleet):
    """A key that may use alpha asks for beta (declared by A and B): the stack the
    plugin picks answers 403 in the route's dialect -- raw and through both SDKs -- and
    that is the answer: no second stack is asked (one POST per request in all)."""
    token = make_key(fleet, "alpha-only", models=["alpha"])
    refused_in_each_dialect(fleet, token, 403, "permission_error", "may not use model 'beta'",
                            "PermissionDeniedError", "PermissionDeniedError")


def test_a_wrong_persons_key_gets_the_stacks_401_once(fleet):
    """A key of the right form that no stack knows: the stack's 401 in the route's
    dialect (raw and through both SDKs, which raise AuthenticationError), one POST per
    request in all (never retried on the other stack). A person's key on a route the
    router cannot pass it on (its model list, count_tokens): the router's own 401."""
    wrong = "cs-" + secrets.token_urlsafe(32)
    TOKENS.append(wrong)
    refused_in_each_dialect(fleet, wrong, 401, "authentication_error", "missing or wrong API key",
                            "AuthenticationError", "AuthenticationError")
    token = make_key(fleet, "carol")
    before = model_posts(fleet)
    r = requests.get(fleet.url + "/v1/models", headers=bearer(token), timeout=30)
    assert r.status_code == 401 and "model requests only" in r.json()["error"]["message"], r.text
    r = requests.post(fleet.url + "/v1/messages/count_tokens", timeout=30,
                      headers={"x-api-key": token, **ANTHROPIC},
                      json={"model": "beta", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    assert model_posts(fleet) == before


def test_a_concurrency_limit_of_one_holds_across_the_stacks(fleet):
    """A key with max_concurrent 1 holds a stream on C (scripted, held after its first
    chunk): its requests to A (chat) and B (Messages) through the router are the
    stacks' 429 (the lease is a row of the shared database), each once, never
    retried elsewhere; once the stream ends, the key is served again."""
    token = make_key(fleet, "solo", max_concurrent=1)
    held = threading.Event()
    fleet.model_c.responder = None
    fleet.model_c.script(Reply(content="a held answer", hold=held))
    stream = requests.post(fleet.url + "/v1/chat/completions", stream=True, timeout=60,
                           headers=bearer(token), json={
                               "model": "scripted-model", "max_tokens": 16, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]})
    try:
        assert stream.status_code == 200, stream.text
        next(stream.iter_lines())                          # C is answering it
        before = model_posts(fleet)
        r = chat(fleet.url, "alpha", headers=bearer(token))
        err = r.json()["error"]
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", (r.text, r.headers)
        assert err["type"] == "throttling_error", err
        assert "already has 1 request(s) in flight" in err["message"], err
        r = messages(fleet, "gamma", token)
        assert r.status_code == 429 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "rate_limit_error", r.text
        assert added(before, model_posts(fleet)) == {"A": 1, "B": 1, "C": 0}
    finally:
        held.set()
        stream.close()
        fleet.model_c.responder = searching_model
    wait_until(lambda: chat(fleet.url, "alpha", headers=bearer(token)).status_code == 200,
               "the key served once its stream ended", 10, every=0.1)


def test_no_persons_key_in_the_routers_log_or_config(fleet):
    """The keys passed on (and the wrong one) never reach the router's output (LiteLLM
    at its shipped level, ERROR, which logged every refusal above with its
    traceback) nor its config."""
    assert len(TOKENS) >= 6
    log = fleet.router.logs()
    assert "AuthenticationError" in log                     # the refusals were logged
    config = (fleet.router.dir / "config.yaml").read_text()
    for token in TOKENS:
        assert token not in log and token not in config


# ------------------------------------------------------------------ routing

def test_alpha_goes_to_a_and_gamma_to_b(fleet):
    for _ in range(3):
        assert ok_from(fleet, "alpha") == "A"
        assert ok_from(fleet, "gamma") == "B"
    assert ok_from(fleet, "al") == "A" and ok_from(fleet, "ga") == "B"     # aliases


def test_beta_goes_where_it_is_resident(fleet):
    unload_all(fleet)
    load(fleet.pb.url, "beta")
    before = counts(fleet)
    assert {ok_from(fleet, "beta") for _ in range(5)} == {"B"}
    load(fleet.pa.url, "alpha")               # A busy with another model: still B
    assert {ok_from(fleet, "beta") for _ in range(3)} == {"B"}
    after = counts(fleet)
    assert swaps(before, after) == {"A": 0, "B": 0}
    # now resident on A only (B holds gamma): beta follows it
    load(fleet.pb.url, "gamma")
    load(fleet.pa.url, "beta")
    before = counts(fleet)
    assert {ok_from(fleet, "beta") for _ in range(3)} == {"A"}
    assert swaps(before, counts(fleet)) == {"A": 0, "B": 0}


def test_beta_prefers_an_idle_stack_to_a_swap(fleet):
    unload_all(fleet)
    load(fleet.pa.url, "alpha")               # A holds alpha, B holds nothing
    before = counts(fleet)
    assert ok_from(fleet, "beta") == "B"
    assert swaps(before, counts(fleet)) == {"A": 0, "B": 0}


def test_twenty_turns_of_one_session_stay_on_one_stack_with_no_swap(fleet):
    unload_all(fleet)
    sid = str(uuid.uuid4())
    before = counts(fleet)
    messages, served = [], []
    for turn in range(20):
        messages.append({"role": "user", "content": f"turn {turn}"})
        r = chat(fleet.url, "beta", headers={"X-Claude-Code-Session-Id": sid},
                 messages=messages)
        assert r.status_code == 200, r.text
        served.append(served_by(r, fleet.stacks))
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"] or "ok"})
    assert len(set(served)) == 1, served
    after = counts(fleet)
    assert swaps(before, after) == {"A": 0, "B": 0}
    assert sum(loads(before, after).values()) == 1          # the first turn's load only


@pytest.mark.parametrize("how", ["claude-header", "x-session-id", "metadata-user-id",
                                 "codex-client-metadata"])
def test_a_session_stays_on_its_stack_over_a_resident_elsewhere(fleet, how):
    """Session affinity beats residency: a session that began on B stays on B after
    beta moved to A (B is up; its prompt cache is there)."""
    unload_all(fleet)
    load(fleet.pb.url, "beta")
    sid = str(uuid.uuid4())

    def turn() -> str:
        if how == "metadata-user-id":      # Claude Code's body field, Anthropic Messages
            r = requests.post(fleet.url + "/v1/messages", timeout=120, headers={
                "x-api-key": KEY, "anthropic-version": "2023-06-01"}, json={
                "model": "beta", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": sid})}})
        elif how == "codex-client-metadata":   # Codex's Responses body field
            r = requests.post(fleet.url + "/v1/responses", timeout=120, headers={
                "Authorization": f"Bearer {KEY}"}, json={
                "model": "beta", "max_output_tokens": 2, "input": "hi",
                "client_metadata": {"session_id": sid}})
        else:
            header = "X-Claude-Code-Session-Id" if how == "claude-header" else "x-session-id"
            r = chat(fleet.url, "beta", headers={header: sid})
        assert r.status_code == 200, r.text
        return served_by(r, fleet.stacks)

    assert turn() == "B"
    requests.post(fleet.pb.url + "/unload", timeout=30, headers=auth(fleet.pb.url)).raise_for_status()
    load(fleet.pa.url, "beta")
    assert ok_from(fleet, "beta") == "A"       # no session: where it is resident
    assert turn() == "B"                       # the session: where it was


def test_a_sessions_call_to_a_second_model_does_not_move_its_first(fleet):
    """Issue 30: a session on B for beta asks once for alpha (only A declares it); its
    next beta turns go back to B, where beta is resident and its cache is -- not to
    A, where the session last went (that swapped alpha out). Stickiness is per
    session and model: 0 swaps, no load after alpha's."""
    unload_all(fleet)
    load(fleet.pb.url, "beta")
    session = {"X-Claude-Code-Session-Id": str(uuid.uuid4())}
    r = chat(fleet.url, "beta", headers=session)
    assert r.status_code == 200 and served_by(r, fleet.stacks) == "B", r.text
    r = chat(fleet.url, "alpha", headers=session)                   # a load on idle A
    assert r.status_code == 200 and served_by(r, fleet.stacks) == "A", r.text
    time.sleep(1.2)                                                 # the poller sees alpha on A
    before = counts(fleet)
    for _ in range(3):
        r = chat(fleet.url, "beta", headers=session)
        assert r.status_code == 200 and served_by(r, fleet.stacks) == "B", r.text
    r = chat(fleet.url, "alpha", headers=session)                   # and alpha stays on A
    assert r.status_code == 200 and served_by(r, fleet.stacks) == "A", r.text
    after = counts(fleet)
    assert swaps(before, after) == {"A": 0, "B": 0}
    assert loads(before, after) == {"A": 0, "B": 0}
    assert [requests.get(sw.url + "/healthz", timeout=5).json()["model"]
            for sw in (fleet.sa, fleet.sb)] == ["alpha", "beta"]


def test_agents_tier_names_go_to_the_sessions_stack_with_no_load(fleet):
    """Claude Code's background name (claude-haiku-4-5; the user set only ANTHROPIC_MODEL)
    and Codex's default (gpt-5.5) have wildcard groups (claude-*, gpt-5*) on A and B,
    whose model_patterns answer them with the resident model. In a session whose turns
    went to B (beta; A holds alpha, is named first and has a model loaded too): B, in
    the Messages and chat dialects and Responses, 200, and 0 loads or swaps anywhere.
    Without a session: the stack with something loaded, not the idle one named first."""
    unload_all(fleet)
    load(fleet.pa.url, "alpha")
    sid = str(uuid.uuid4())
    session = {"X-Claude-Code-Session-Id": sid}
    r = chat(fleet.url, "beta", headers=session)              # the session's main model
    assert r.status_code == 200 and served_by(r, fleet.stacks) == "B", r.text
    cx = str(uuid.uuid4())                                    # a Codex session (Responses)

    def responses(model: str) -> requests.Response:
        return requests.post(fleet.url + "/v1/responses", timeout=120, headers={
            "Authorization": f"Bearer {KEY}"}, json={
            "model": model, "max_output_tokens": 16, "input": "hi",
            "client_metadata": {"session_id": cx}})
    r = responses("beta")
    assert r.status_code == 200 and served_by(r, fleet.stacks) == "B", r.text
    before, mapped = counts(fleet), scrape(fleet.sb.url)
    r = chat(fleet.url, "claude-haiku-4-5", headers=session)
    assert r.status_code == 200, r.text
    assert r.headers["x-litellm-model-id"] == "B:openai:claude-*"
    assert r.json()["choices"][0]["message"]["content"] is not None
    r = requests.post(fleet.url + "/v1/messages", timeout=120, headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01", **session}, json={
        "model": "claude-haiku-4-5", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-litellm-model-id"] == "B:anthropic:claude-*"
    assert r.json()["type"] == "message" and r.json()["content"], r.json()
    r = responses("gpt-5.5")
    assert r.status_code == 200, r.text
    assert r.headers["x-litellm-model-id"] == "B:openai:gpt-5*"
    # B's own model_patterns answered the names, unchanged, with its resident beta
    now = scrape(fleet.sb.url)
    for pattern, n in (("claude-*", 2), ("gpt-5*", 1)):
        assert now.value("swapper_models_mapped_total", pattern=pattern, model="beta") - \
            mapped.value("swapper_models_mapped_total", pattern=pattern, model="beta") == n
    after = counts(fleet)
    assert loads(before, after) == {"A": 0, "B": 0}
    assert swaps(before, after) == {"A": 0, "B": 0}
    assert [requests.get(sw.url + "/healthz", timeout=5).json()["model"]
            for sw in (fleet.sa, fleet.sb)] == ["alpha", "beta"]
    # no session: to B (beta loaded), not A (idle, named first)
    requests.post(fleet.pa.url + "/unload", timeout=30, headers=auth(fleet.pa.url)).raise_for_status()
    time.sleep(1.2)
    before = counts(fleet)
    for _ in range(2):
        assert ok_from(fleet, "claude-haiku-4-5") == "B"
    assert loads(before, counts(fleet)) == {"A": 0, "B": 0}


def test_beta_overflows_to_the_other_stack_only_beyond_its_queue(fleet):
    """Beta resident on B (2 slots, queue 1): 3 at once all stay on B; 8 at once
    overflow -- B answers 503 to those beyond its queue, LiteLLM retries them and the
    plugin sends the retry to the other stack (A, which loads beta) -- none fails."""
    unload_all(fleet)
    load(fleet.pb.url, "beta")

    def burst(n: int) -> list:
        out: list = []

        def one():
            r = chat(fleet.url, "beta", max_tokens=48, timeout=120)
            out.append((r.status_code, served_by(r, fleet.stacks)))
        ts = [threading.Thread(target=one) for _ in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        return out

    assert burst(3) == [(200, "B")] * 3
    got = burst(8)
    assert all(code == 200 for code, _ in got), got
    assert {s for _, s in got} == {"A", "B"}, got
    time.sleep(5.5)                          # B's cooldown (5 s) ends before the next test


def routing_module():
    """deploy/fleet/routing.py, the file LiteLLM loads, loaded the same way (by path)."""
    spec = importlib.util.spec_from_file_location("fleet_routing_it", FLEET_DIR / "routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probes(proxy_url: str) -> dict:
    """The status probes a stack's proxy answered (its own request counter)."""
    m = scrape(proxy_url, auth(proxy_url))
    return {route: m.value("proxy_requests_total", route=route, method="GET", status="200")
            for route in ("/healthz", "/v1/models")}


def test_health_traffic_starts_no_load(fleet):
    """The router's health traffic -- the plugin's /healthz + /v1/models polls (its
    StatusPoller; LiteLLM's background health checks are off) -- for as many probes as
    2 minutes at the default 1 s interval: the router's own poller (0.5 s) and the same
    StatusPoller class run here at 0.05 s, until it has polled HEALTH_PROBES times.
    Counted from each stack's side (the proxy's request counter): at least that many
    probes answered, and no load on either swapper."""
    unload_all(fleet)
    before, seen = counts(fleet), {"A": probes(fleet.pa.url), "B": probes(fleet.pb.url)}
    poller = routing_module().StatusPoller({"A": fleet.pa.url, "B": fleet.pb.url},
                                           interval=0.05, api_keys=STACK_KEYS).start()
    try:
        def enough():
            assert requests.get(fleet.url + "/health/liveliness", timeout=5).status_code == 200
            return poller.polls >= HEALTH_PROBES
        wait_until(enough, f"{HEALTH_PROBES} status polls", 22, every=0.5)
    finally:
        poller.stop()
        poller._thread.join(5)
    assert poller.status["A"].up and poller.status["B"].up
    after = counts(fleet)
    for name, proxy in (("A", fleet.pa), ("B", fleet.pb)):
        now = probes(proxy.url)
        for route in ("/healthz", "/v1/models"):
            answered = now[route] - seen[name][route]
            # ours, and the router's poller's on top
            assert answered > poller.polls >= HEALTH_PROBES, (name, route, answered, poller.polls)
    assert loads(before, after) == {"A": 0, "B": 0}
    assert swaps(before, after) == {"A": 0, "B": 0}
    for sw in (fleet.sa, fleet.sb):
        assert requests.get(sw.url + "/healthz", timeout=5).json()["model"] is None


# ------------------------------------------------------------------ dialects (stack C)

def _blocks(msg: dict) -> list[dict]:
    """Content blocks less the per-answer ids."""
    out = []
    for b in msg["content"]:
        b = {k: v for k, v in b.items() if k not in ("id", "tool_use_id")}
        out.append(b)
    return out


def test_anthropic_web_search_blocks_pass_through_unchanged(fleet):
    body = {"model": "scripted-model", "max_tokens": 256, "tools": [WEB],
            "messages": [{"role": "user", "content": "What changed in Flask 3.1?"}]}
    direct = requests.post(fleet.c_url + "/v1/messages", json=body, timeout=60,
                           headers=auth(fleet.c_url)).json()
    routed = requests.post(fleet.url + "/v1/messages", json=body, timeout=60, headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-litellm-model-id"].startswith("C:anthropic:")
    kinds = [b["type"] for b in routed.json()["content"]]
    assert "server_tool_use" in kinds and "web_search_tool_result" in kinds, kinds
    assert _blocks(routed.json()) == _blocks(direct)
    # streamed, with the anthropic SDK: the same blocks
    c = anthropic.Anthropic(base_url=fleet.url, api_key=KEY, max_retries=0, timeout=60)
    with c.messages.stream(**body) as s:
        msg = s.get_final_message()
    assert [b.type for b in msg.content] == kinds
    res = next(b for b in msg.content if b.type == "web_search_tool_result")
    assert res.content[0].url.startswith("https://example.com/")
    assert msg.content[-1].text.startswith("ANSWER: the changelog is at https://example.com/")


def test_messages_stream_carries_the_stacks_load_progress(fleet):
    """A streamed Messages request that starts a load: the stack's progress comments
    (`: loading model alpha ...`) reach the client through the router (Anthropic
    pass-through). Chat completions' streams lose them (LiteLLM re-emits parsed
    chunks): the chunks still arrive."""
    unload_all(fleet)
    r = requests.post(fleet.url + "/v1/messages", stream=True, timeout=120, headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01"}, json={
        "model": "alpha", "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    lines = [ln for ln in r.iter_lines() if ln]
    assert any(ln.startswith(b": loading model alpha") for ln in lines), lines[:5]
    assert any(ln == b"event: message_stop" for ln in lines)
    unload_all(fleet)
    r = requests.post(fleet.url + "/v1/chat/completions", stream=True, timeout=120, headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": "alpha", "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]})
    lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]" and not any(ln.startswith(b":") for ln in lines)


def test_responses_web_search_through_the_router(fleet):
    r = requests.post(fleet.url + "/v1/responses", timeout=60, headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": "scripted-model", "input": "What changed in Flask 3.1?",
        "tools": [{"type": "web_search"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    text = "".join(c.get("text", "") for i in out["output"] if i.get("type") == "message"
                   for c in i.get("content", []))
    assert "https://example.com/" in text, out


def test_chat_with_the_injected_search_and_n_through_the_router(fleet):
    """Chat completions: the stack injects its web_search tool and runs the search
    round; the router passes the request on and returns the stack's final answer."""
    fleet.model_c.requests.clear()
    fleet.model_c.script(Reply(tool_calls=[search(QUERY)]),
                         Reply(content="Flask 3.1 adds partitioned cookies [1]."))
    # these two replies, not the searching responder (which answers chat too since
    # cab86dc); a budget at the stack's TOOL_MAX_TOKENS_FLOOR (1024): below it the
    # stack injects no web_search (the client's budget is the client's, 449def7)
    fleet.model_c.responder = None
    try:
        r = chat(fleet.url, "scripted-model", max_tokens=1024,
                 messages=[{"role": "user", "content": "What changed in Flask 3.1?"}])
    finally:
        fleet.model_c.responder = searching_model
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer.startswith("Flask 3.1 adds partitioned cookies [1]."), (
        answer, [{k: v for k, v in q.items() if k != "messages"} for q in fleet.model_c.requests])
    assert "https://example.com/flask-3-1-changelog/0" in answer               # the stack's sources
    first, second = fleet.model_c.requests[-2:]
    assert "web_search" in json.dumps(first.get("tools") or [])           # injected by the stack
    assert "https://example.com/" in json.dumps(second["messages"])       # the SearXNG results
    r = chat(fleet.url, "beta", n=2, max_tokens=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


# ------------------------------------------------------------------ failure

def test_failover_when_a_swapper_dies_and_return(fleet):
    """Beta resident on A only; A's swapper is killed mid-traffic: beta moves to B
    (cooldown + the plugin's poll), no request lost beyond the one in flight; A's
    swapper comes back on the same port and the router sends alpha to it again."""
    unload_all(fleet)
    load(fleet.pa.url, "beta")
    assert ok_from(fleet, "beta") == "A"
    results: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                r = chat(fleet.url, "beta", timeout=60)
                results.append((r.status_code, served_by(r, fleet.stacks)))
            except requests.RequestException:
                results.append((0, None))

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    time.sleep(1.0)
    n_before_kill = len(results)
    fleet.sa.stop(kill=True)
    killed_at = time.monotonic()
    wait_until(lambda: any(s == "B" for _, s in results[n_before_kill:]),
               "beta served by B", 60, every=0.2)
    moved_after = time.monotonic() - killed_at
    time.sleep(2.0)
    stop.set()
    t.join(60)
    after_kill = results[n_before_kill:]
    failed = [r for r in after_kill if r[0] != 200]
    assert len(failed) <= 1, after_kill            # at most the one in flight at the kill
    assert moved_after < 10, moved_after
    assert all(s == "B" for code, s in after_kill[-3:] if code == 200)

    # A's swapper returns (same stack name, same port: its proxy points there)
    back = SwapperProcess(stack=fleet.sa.stack, backends_dir=A_DIR,
                          publish_port=fleet.sa.publish_port)
    back.port, back.url = fleet.sa.port, fleet.sa.url
    back.env["SWAPPER_PORT"] = str(fleet.sa.port)
    with back:
        fleet.sa = back
        wait_until(lambda: chat(fleet.url, "alpha").status_code == 200,
                   "alpha answered", 60, every=0.2)
        assert ok_from(fleet, "alpha") == "A"
        assert ok_from(fleet, "beta") in ("A", "B")
        unload_all(fleet)


def test_no_stack_ever_ran_two_backends(fleet):
    assert fleet.sampler.samples > 50
    assert all(n <= 1 for n in fleet.sampler.max_running.values()), fleet.sampler.max_running
    assert max(fleet.sampler.max_running.values()) == 1                  # it did see backends


def test_router_compose_file_is_valid(tmp_path):
    """deploy/fleet/docker-compose.yaml parses (docker compose config) and mounts the
    generated config beside the plugin; it refuses to start without a master key."""
    import os
    import subprocess
    import yaml
    compose = REPO / "deploy" / "fleet" / "docker-compose.yaml"
    env = {**os.environ, "LITELLM_MASTER_KEY": "sk-x"}
    out = subprocess.run(["docker", "compose", "-f", str(compose), "config"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    svc = yaml.safe_load(out.stdout)["services"]["router"]
    assert svc["volumes"][0]["target"] == "/app/config.yaml"
    env.pop("LITELLM_MASTER_KEY")
    out = subprocess.run(["docker", "compose", "-f", str(compose), "config"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "LITELLM_MASTER_KEY" in out.stderr


# ------------------------------------------------------------------ the agents, headless

URL0 = "https://example.com/flask-3-1-changelog/0"


def test_claude_code_through_the_router_searches_on_the_stack(fleet, tmp_path):
    """Claude Code (headless) with ANTHROPIC_BASE_URL at the router: its WebSearch
    (web_search_20250305) is run by stack C against SearXNG, the result blocks come
    back through LiteLLM, and the answer is built on the first result."""
    fleet.model_c.requests.clear()
    p = run([cli("claude"), "-p", "Search the web: what changed in Flask 3.1?",
             "--max-turns", "4", "--allowedTools", "WebSearch"], tmp_path, {
        "ANTHROPIC_BASE_URL": fleet.url, "ANTHROPIC_AUTH_TOKEN": KEY,
        "ANTHROPIC_MODEL": "scripted-model", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted-model",
        "ANTHROPIC_SMALL_FAST_MODEL": "scripted-model",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"})
    assert f"ANSWER: the changelog is at {URL0}" in p.stdout, p.stdout + p.stderr
    assert any(URL0 in json.dumps(b.get("messages")) for b in fleet.model_c.requests)


def test_codex_through_the_router_searches_on_the_stack(fleet, tmp_path):
    """Codex (headless, Responses) with its provider's base_url at the router: the
    stack runs its web_search; the answer names the first result."""
    home = codex_home(tmp_path, fleet.url, 'web_search = "live"')
    p = run([cli("codex"), "exec", "--skip-git-repo-check",
             "Search the web: what changed in Flask 3.1?"], tmp_path,
            {"CODEX_HOME": home, "LOCAL_KEY": KEY})
    assert f"ANSWER: the changelog is at {URL0}" in p.stdout, p.stdout + p.stderr
