"""The vLLM backend kind for real: vLLM's CPU build serving SmolLM2, started by
the swapper and used through the proxy, swapped with llama.cpp models."""
import json

import openai
import pytest
import requests

from tests.integration.swapper.test_swapper import running
from tests.support.proxyproc import ProxyProcess


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0") as p:
        yield p


def client(proxy):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", timeout=None, max_retries=0)


def test_vllm_through_the_proxy(swapper, proxy, invariant):
    r = requests.post(proxy.url + "/load/v", timeout=900)
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "tiny-vllm"
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


def test_vllm_refuses_connections_until_ready_and_the_swapper_waits(swapper):
    """Ask for the vLLM model cold with a plain chat (no /load first): the
    request waits through vLLM's start-up and is answered."""
    requests.post(swapper.url + "/unload", timeout=120)
    r = requests.post(swapper.url + "/v1/chat/completions", timeout=900, json={
        "model": "tiny-vllm", "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "Hi"}]}, stream=True)
    assert r.status_code == 200
    data = [l for l in r.iter_lines() if l.startswith(b"data: ")]
    assert data[-1] == b"data: [DONE]"
    assert json.loads(data[0][6:])["model"] == "tiny-vllm"


def test_swap_llamacpp_vllm_llamacpp_keeps_one_resident(swapper, proxy, invariant):
    c = client(proxy)
    for model in ("tiny-a", "tiny-vllm", "tiny-a"):
        out = c.chat.completions.create(model=model, max_tokens=4,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].message.content is not None
        assert running(swapper)["model"] == model
    assert invariant.seen_models[-3:] == ["tiny-a", "tiny-vllm", "tiny-a"]
    r = requests.post(proxy.url + "/unload", timeout=120)
    assert r.status_code == 200 and r.json()["unloaded"] is True
    assert running(swapper)["model"] is None
