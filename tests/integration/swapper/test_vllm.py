"""The vLLM backend kind for real: vLLM's CPU build serving SmolLM2, started by
the swapper and used through the proxy, swapped with llama.cpp models.

CPU vLLM takes ~30 s to come up, so the module starts it once (`cold_start`):
tiny-a resident, then a plain streamed chat for tiny-vllm straight to the swapper
(no /load) swaps to it cold, and is answered once vLLM accepts connections. The
tests read what that start showed, use the vLLM it left resident (this module
does not unload between tests) and the last one swaps back to tiny-a. Each test
also runs alone: the fixture makes the same start for it."""
import json
from dataclasses import dataclass, field

import openai
import pytest
import requests

from tests.support.proxyproc import ProxyProcess
from tests.support.swapper_client import running
from tests.support.swapperproc import InvariantSampler


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0") as p:
        yield p


@pytest.fixture(autouse=True)
def _unload_between_tests():
    """Overrides the swapper tests' unload after each test: vLLM's one start is
    shared here (test_swap_llamacpp_vllm_llamacpp_keeps_one_resident unloads
    at the end, and asserts that it did)."""
    yield


def client(proxy):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", timeout=None, max_retries=0)


@dataclass
class ColdStart:
    sampler: InvariantSampler
    resident_before: str | None = None      # /running's model before the vLLM request
    status: int = 0
    data: list = field(default_factory=list)  # the stream's `data: ` lines
    resident_after: str | None = None


@pytest.fixture(scope="module")
def cold_start(swapper, proxy, docker_client):
    """tiny-a resident (through the proxy), then tiny-vllm asked for with a plain
    streamed chat straight to the swapper, no /load first: the swap to a cold vLLM,
    which refuses connections until it is ready, while the request waits. Docker is
    sampled from before tiny-a's load to the module's end (one resident at a time)."""
    with InvariantSampler(docker_client, swapper.stack) as sampler:
        seen = ColdStart(sampler)
        out = client(proxy).chat.completions.create(
            model="tiny-a", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].message.content is not None
        seen.resident_before = running(swapper)["model"]
        r = requests.post(swapper.url + "/v1/chat/completions", timeout=900, json={
            "model": "tiny-vllm", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}, stream=True)
        seen.status = r.status_code
        seen.data = [l for l in r.iter_lines() if l.startswith(b"data: ")]
        seen.resident_after = running(swapper)["model"]
        yield seen
    requests.post(swapper.url + "/unload", timeout=120)
    assert sampler.samples > 0
    assert sampler.peak <= 1, f"{sampler.peak} backend containers of the stack ran at once"


def test_vllm_refuses_connections_until_ready_and_the_swapper_waits(cold_start):
    """Ask for the vLLM model cold with a plain chat (no /load first): the
    request waits through vLLM's start-up and is answered."""
    assert cold_start.resident_before == "tiny-a"       # so tiny-vllm was not running
    assert cold_start.status == 200
    assert cold_start.data[-1] == b"data: [DONE]"
    assert json.loads(cold_start.data[0][6:])["model"] == "tiny-vllm"
    assert cold_start.resident_after == "tiny-vllm"


def test_vllm_through_the_proxy(swapper, proxy, invariant, cold_start):
    r = requests.post(proxy.url + "/load/v", timeout=900)
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "tiny-vllm"
    assert r.json()["running"] == ["tiny-vllm"]
    assert running(swapper)["last_load_seconds"] > 0

    c = client(proxy)
    out = c.chat.completions.create(model="v", max_tokens=8,
                                    messages=[{"role": "user", "content": "Say hello."}])
    assert out.choices[0].message.content
    assert out.model == "tiny-vllm"          # the alias reached vLLM as its served name
    # Its published port is no side door (issue 28): vLLM has the backend's own key
    # (VLLM_API_KEY), which the swapper adds and nobody else has.
    assert requests.get(swapper.backend_url + "/v1/models", timeout=30).status_code == 401
    assert requests.get(swapper.backend_url + "/v1/models", timeout=30,
                        headers=swapper.backend_headers).status_code == 200
    # ... and serves no web page (issue 35; the kind's --allowed-origins []): a foreign
    # Origin's preflight is refused, no answer names an origin a page could read it from.
    evil = {"Origin": "http://evil.example"}
    pre = requests.options(swapper.backend_url + "/v1/chat/completions", timeout=30, headers={
        **evil, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 400 and "Access-Control-Allow-Origin" not in pre.headers, (
        pre.status_code, dict(pre.headers))
    assert "Access-Control-Allow-Credentials" not in pre.headers, dict(pre.headers)
    for path, headers in (("/health", evil), ("/v1/models", {**evil, **swapper.backend_headers})):
        r = requests.get(swapper.backend_url + path, headers=headers, timeout=30)
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers, (
            path, dict(r.headers))

    chunks = list(c.chat.completions.create(model="tiny-vllm", max_tokens=8, stream=True,
                                            messages=[{"role": "user", "content": "Say hello."}]))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    # A limit above the context (OpenCode and Qwen Code 0.24.4 send 32000): vLLM refuses it
    # ("max_tokens=32000 cannot be greater than max_model_len=2048"); through the proxy it
    # is clamped to the registry's context_length, and vLLM fits it to the prompt.
    big = {"model": "tiny-vllm", "max_tokens": 32000, "stop": ["\n", ".", "!"],
           "messages": [{"role": "user", "content": "Say hello."}]}
    direct = requests.post(swapper.url + "/v1/chat/completions", json=big, timeout=120)
    assert direct.status_code == 400 and "max_model_len" in direct.text, direct.text
    via = requests.post(proxy.url + "/v1/chat/completions", json=big, timeout=300)
    assert via.status_code == 200, via.text

    # n natively (vLLM honours n): two choices from one request
    two = c.chat.completions.create(model="tiny-vllm", max_tokens=6, n=2,
                                    messages=[{"role": "user", "content": "Name a colour."}])
    assert sorted(ch.index for ch in two.choices) == [0, 1]
    assert two.usage.completion_tokens >= 2
    assert running(swapper)["model"] == "tiny-vllm"
    assert invariant.seen_models == ["tiny-vllm"], "served by the one vLLM start"


def test_swap_llamacpp_vllm_llamacpp_keeps_one_resident(swapper, proxy, cold_start):
    """tiny-a, then tiny-vllm (cold_start's swap), then tiny-a again through the
    proxy, one resident at a time; /unload through the proxy frees it."""
    assert (cold_start.resident_before, cold_start.resident_after) == ("tiny-a", "tiny-vllm")
    c = client(proxy)
    out = c.chat.completions.create(model="tiny-vllm", max_tokens=4,
                                    messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content is not None
    assert running(swapper)["model"] == "tiny-vllm"
    out = c.chat.completions.create(model="tiny-a", max_tokens=4,
                                    messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content is not None
    assert running(swapper)["model"] == "tiny-a"
    assert cold_start.sampler.seen_models[-3:] == ["tiny-a", "tiny-vllm", "tiny-a"]
    assert cold_start.sampler.peak <= 1
    r = requests.post(proxy.url + "/unload", timeout=120)
    assert r.status_code == 200 and r.json()["unloaded"] is True
    assert running(swapper)["model"] is None
