"""Pass-through against a real llama-server (SmolLM2-135M) behind `python -m proxy`.

Needs tests/testbed/testbed.env sourced; without it these tests FAIL (by design).
"""
import time

import openai
import pytest
import requests

from tests.support.llama import LlamaServer
from tests.support.proxyproc import ProxyProcess
from tests.support.servers import post_and_abandon
from tests.support.sseclient import read_stream

MSG = [{"role": "user", "content": "Count from one to twenty in words."}]


@pytest.fixture(scope="module")
def llama():
    with LlamaServer(ctx=2048, parallel=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(llama):
    with ProxyProcess(BACKEND_URL=llama.url, WEB_SEARCH=0, INJECT_SYSTEM=0) as p:
        yield p


def test_nonstream_same_shape_as_direct(llama, proxy):
    body = {"messages": MSG, "max_tokens": 8, "temperature": 0, "seed": 1}
    direct = requests.post(llama.url + "/v1/chat/completions", json=body).json()
    via = requests.post(proxy.url + "/v1/chat/completions", json=body)
    assert via.status_code == 200
    j = via.json()
    assert j["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert j["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] <= 8
    assert set(j) == set(direct)


def _models(url):
    """llama-server's /v1/models, less `created` (the second it was asked)."""
    j = requests.get(url + "/v1/models").json()
    for m in j["data"]:
        assert isinstance(m.pop("created"), int)
    return j


def test_models_and_raw_paths(llama, proxy):
    assert _models(proxy.url) == _models(llama.url)
    r = requests.post(proxy.url + "/v1/completions",
                      json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    # an upstream error envelope passes through untouched (no --embeddings on this server)
    d = requests.post(llama.url + "/v1/embeddings", json={"input": "x"})
    p = requests.post(proxy.url + "/v1/embeddings", json={"input": "x"})
    assert p.status_code == d.status_code != 200
    assert p.json() == d.json()


def test_stream_arrives_incrementally(proxy):
    r = requests.post(proxy.url + "/v1/chat/completions", stream=True,
                      json={"messages": MSG, "max_tokens": 24, "stream": True,
                            "ignore_eos": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["X-Accel-Buffering"] == "no" and r.headers["Cache-Control"] == "no-cache"
    s = read_stream(r)
    assert s.done == 1 and s.text()
    before_done = [b for b in s.reads if b"data: {" in b and b"[DONE]" not in b]
    # a buffering proxy would hand over the whole body in one read at the end
    assert len(before_done) >= 2, f"{len(s.reads)} reads: stream was buffered"


def _metric(llama, name: str) -> float:
    for line in requests.get(llama.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in llama-server /metrics")


def test_client_disconnect_stops_generation(llama, proxy):
    max_tokens = 900
    before = _metric(llama, "llamacpp:tokens_predicted_total")
    r = requests.post(proxy.url + "/v1/chat/completions", stream=True,
                      json={"messages": MSG, "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True})
    got = 0
    for chunk in r.iter_content(chunk_size=None):
        got += chunk.count(b"data: {")
        if got >= 3:
            break
    r.close()                                # the client goes away mid-generation
    # wait (bounded) until llama-server has no request in flight
    deadline = time.monotonic() + 300
    while _metric(llama, "llamacpp:requests_processing") > 0:
        assert time.monotonic() < deadline, "llama-server still generating"
        time.sleep(0.2)
    predicted = _metric(llama, "llamacpp:tokens_predicted_total") - before
    assert 3 <= predicted < max_tokens, \
        f"{predicted} tokens generated: generation was not cut at the disconnect"


def test_client_disconnect_stops_a_non_streaming_generation(llama, proxy):
    """A non-streaming answer arrives whole at the end: while it is generated
    the proxy watches the client, and closes the upstream when it leaves."""
    max_tokens = 900                         # fits the slot's context: only a cut stops it early
    before = _metric(llama, "llamacpp:tokens_predicted_total")
    post_and_abandon(proxy.url, "/v1/chat/completions",
                     {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": True})
    # Poll slowly: llama-server checks a non-streaming request's connection only
    # after 1 s with no other result, and every /metrics answer restarts that wait.
    deadline = time.monotonic() + 300
    while _metric(llama, "llamacpp:requests_processing") > 0:
        assert time.monotonic() < deadline, "llama-server still generating"
        time.sleep(2.5)
    predicted = _metric(llama, "llamacpp:tokens_predicted_total") - before
    assert predicted < max_tokens, \
        f"{predicted} tokens generated: generation was not cut at the disconnect"


def test_openai_client_against_llama(proxy):
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="any", messages=MSG, max_tokens=6)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 6
    text, n = "", 0
    with c.chat.completions.create(model="any", messages=MSG, max_tokens=6,
                                   stream=True) as s:
        for chunk in s:
            n += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    assert text and n >= 2


def test_openai_client_with_search_enabled(llama):
    """Default settings (web_search injected): the real model answers through the loop and
    never hands a web_search call to the client."""
    from tests.support.searxng import FakeSearxng
    with FakeSearxng() as searx, ProxyProcess(BACKEND_URL=llama.url,
                                              SEARXNG_URL=searx.url) as p:
        c = openai.OpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="any", messages=MSG, max_tokens=48,
                                      temperature=0)
        assert r.choices[0].message.tool_calls is None
        with c.chat.completions.create(model="any", messages=MSG, max_tokens=48,
                                       temperature=0, stream=True) as s:
            for chunk in s:
                assert not (chunk.choices and chunk.choices[0].delta.tool_calls)
