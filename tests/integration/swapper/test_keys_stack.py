"""Issue 35, keys through the whole stack: the real proxy (gunicorn, two workers,
an SQLite key store), the real swapper, the real llama-server with SmolLM2.

- An agent's tier name (Claude Code's `claude-haiku-*`) is mapped by the swapper
  within the key's scope: to the model the key may use, not to the resident one
  another key loaded; a key that may use no registry model gets a 403 in
  Anthropic's shape (the proxy alone cannot know what a tier name maps to).
- Usage totals stay exact across a restart of the swapper during traffic: every
  request that passed the door is one row count, and the row's tokens are the
  sums of the usages the clients were answered with."""
import concurrent.futures as cf
import threading

import anthropic
import pytest
import requests

from tests.support.proxyproc import ProxyProcess
from tests.support.servers import wait_until

ADMIN = "admin-secret"
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def proxy(swapper, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("keys") / "keys.db")
    with ProxyProcess(BACKEND_URL=swapper.url, KEYS_DB=db, API_KEY=ADMIN, WEB_SEARCH=0,
                      SYSTEM_PROMPT="", PROXY_WORKERS=2, MODELS_TTL=0) as p:
        yield p


@pytest.fixture(autouse=True)
def _unload_between_tests():
    """These tests prove where requests go and what is counted, not loads: the
    model one test leaves resident serves the next."""
    yield


def make_key(proxy, name, models):
    r = requests.post(proxy.url + "/admin/keys", json={"name": name, "models": models},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["token"]


def resident(swapper):
    return requests.get(swapper.url + "/running", timeout=10).json().get("model")


def test_a_tier_name_is_mapped_within_the_keys_scope(proxy, swapper):
    token_b = make_key(proxy, "only-b", ["b"])              # tiny-b, by its alias
    token_none = make_key(proxy, "only-z", ["z-*"])         # no registry model
    r = requests.post(proxy.url + "/load/tiny-a", headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=180)
    assert r.status_code == 200, r.text
    assert resident(swapper) == "tiny-a"
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=token_b, max_retries=0,
                                 timeout=300)
    # Claude Code's background call: before, it went to the resident tiny-a
    msg = claude.messages.create(model="claude-haiku-4-5-20251001", max_tokens=4,
                                 messages=USER)
    assert msg.content and resident(swapper) == "tiny-b"
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        anthropic.Anthropic(base_url=proxy.url, api_key=token_none, max_retries=0,
                            timeout=60).messages.create(
            model="claude-opus-4-8", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error" and \
        e.value.body["error"]["type"] == "permission_error"
    assert "z-*" in e.value.body["error"]["message"]
    assert resident(swapper) == "tiny-b", "a refusal loads nothing"


def usage_of(proxy, key):
    r = requests.get(proxy.url + "/admin/usage", params={"key": key},
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return r.json()["totals"]


def test_usage_is_exact_across_a_swapper_restart_during_traffic(proxy, swapper):
    token = make_key(proxy, "steady", ["*"])
    stop = threading.Event()
    answered: list[dict] = []               # usage of each 200, as the client got it
    refused: list[int] = []                 # the other answers' statuses
    sent = [0]
    lock = threading.Lock()

    def agent(i):
        s = requests.Session()
        while not stop.is_set():
            with lock:
                sent[0] += 1
            try:
                r = s.post(proxy.url + "/v1/chat/completions", timeout=300, headers={
                    "Authorization": f"Bearer {token}"}, json={
                    "model": "tiny-b", "max_tokens": 3, "messages": [
                        {"role": "user", "content": f"Count to {i}."}]})
            except requests.RequestException as e:     # the proxy never drops one
                raise AssertionError(f"no answer: {e}") from e
            with lock:
                if r.status_code == 200:
                    answered.append(r.json()["usage"])
                else:
                    refused.append(r.status_code)
    with cf.ThreadPoolExecutor(3) as ex:
        agents = [ex.submit(agent, i) for i in range(3)]
        try:
            wait_until(lambda: len(answered) >= 3, "traffic flowing", deadline=120)
            swapper.stop()                  # SIGTERM: in flight finish, new ones refused
            wait_until(lambda: refused, "a request answered while the swapper is down")
            swapper.start()                 # it adopts the running backend
            n = len(answered)
            wait_until(lambda: len(answered) >= n + 3, "traffic after the restart",
                       deadline=120)
        finally:
            stop.set()
            for f in agents:
                f.result(timeout=300)
    totals = usage_of(proxy, "steady")
    assert set(refused) == {502}, refused
    assert totals["requests"] == sent[0] == len(answered) + len(refused), totals
    assert totals["prompt_tokens"] == sum(u["prompt_tokens"] for u in answered)
    assert totals["completion_tokens"] == sum(u["completion_tokens"] for u in answered)
