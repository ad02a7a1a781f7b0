"""Metrics after real traffic: the real swapper on the real Docker engine with the
real llama-server image and SmolLM2, the real proxy in front of it with two
gunicorn workers (prometheus_client multiprocess mode), clients using the OpenAI
SDK and plain HTTP. Both /metrics are read with prometheus_client's own parser;
the checks are counts (requests, tokens the clients were told, loads, swaps),
never timing values."""
import json

import openai
import pytest
import requests

from tests.support.metrics import scrape
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def multiproc_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("multiproc")


@pytest.fixture(scope="module")
def stack(multiproc_dir):
    with SwapperProcess() as sw, ProxyProcess(
            BACKEND_URL=sw.url, WEB_SEARCH=0, INJECT_SYSTEM=0, PROXY_WORKERS=2,
            PROMETHEUS_MULTIPROC_DIR=multiproc_dir) as proxy:
        yield sw, proxy


def _stream_raw(url, body):
    """A streamed chat through plain HTTP: (content chunks, the final chunk's timings)."""
    r = requests.post(url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                      timeout=300)
    assert r.status_code == 200, r.text
    timings, n = None, 0
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            obj = json.loads(line[6:])
            n += 1
            timings = obj.get("timings") or timings
            assert "usage" not in obj          # the client did not ask for usage
    return n, timings


def _events(r):
    """The JSON data of an SSE answer's events, in order."""
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]


def test_metrics_after_real_traffic(stack, multiproc_dir):
    sw, proxy = stack
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=300)
    prompt = {"tiny-a": 0, "tiny-b": 0}
    completion = {"tiny-a": 0, "tiny-b": 0}

    def count(model, usage_prompt, usage_completion):
        prompt[model] += usage_prompt
        completion[model] += usage_completion

    # Order: llama-server drops its connection after a stream, and a request sent
    # to it at once may meet that (the lead's stale keep-alive retry); here each
    # stream is followed by a swap or by nothing.
    # tiny-a: two answers, one by its alias (the label is the model's id)
    for name in ("tiny-a", "a"):
        r = client.chat.completions.create(model=name, messages=HELLO, max_tokens=4)
        count("tiny-a", r.usage.prompt_tokens, r.usage.completion_tokens)
    # a stream with usage (asked for)
    usage = None
    for chunk in client.chat.completions.create(model="tiny-a", messages=HELLO, max_tokens=4,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    count("tiny-a", usage.prompt_tokens, usage.completion_tokens)
    # Anthropic Messages for tiny-b (a swap)
    r = requests.post(proxy.url + "/v1/messages", timeout=300,
                      json={"model": "tiny-b", "messages": HELLO, "max_tokens": 4})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    count("tiny-b", u["input_tokens"] + u.get("cache_read_input_tokens", 0)
          + u.get("cache_creation_input_tokens", 0), u["output_tokens"])
    # tiny-a again (a second swap): a stream without usage, counted from llama.cpp's timings
    _, timings = _stream_raw(proxy.url, {"model": "tiny-a", "messages": HELLO, "max_tokens": 4})
    count("tiny-a", timings["prompt_n"] + timings.get("cache_n", 0), timings["predicted_n"])
    assert all(prompt.values()) and all(completion.values())

    # Every scrape answers for the whole proxy, whichever worker takes it.
    scrapes = [scrape(proxy.url) for _ in range(6)]
    for m in scrapes:
        assert m.value("proxy_requests_total", route="/v1/chat/completions", status="200") == 4
        assert m.value("proxy_requests_total", route="/v1/messages", status="200") == 1
        for model in ("tiny-a", "tiny-b"):
            assert m.value("proxy_prompt_tokens_total", model=model) == prompt[model]
            assert m.value("proxy_completion_tokens_total", model=model) == completion[model]
        assert m.labels("proxy_prompt_tokens_total", "model") == {"tiny-a", "tiny-b"}
        assert m.value("proxy_time_to_first_token_seconds_count", model="tiny-a") == 2
        assert m.value("proxy_time_to_first_token_seconds_count", model="tiny-b") == 0
        assert m.value("proxy_request_duration_seconds_count",
                       route="/v1/chat/completions") == 4
        # llama.cpp reports its speed (timings) in every chat answer
        assert m.value("proxy_decode_tokens_per_second_count", model="tiny-a") == 4
        assert m.type("proxy_time_to_first_token_seconds") == "histogram"
        assert m.type("proxy_request_duration_seconds") == "histogram"
        assert m.type("proxy_prompt_tokens") == "counter"
    assert list(multiproc_dir.glob("*.db")), "two workers, but no multiprocess files"

    s = scrape(sw.url)
    assert s.value("swapper_loads_total", model="tiny-a", result="ok") == 2
    assert s.value("swapper_loads_total", model="tiny-b", result="ok") == 1
    assert s.value("swapper_load_seconds_count", model="tiny-a") == 2
    assert s.value("swapper_unloads_total", model="tiny-a") == 1
    assert s.value("swapper_unloads_total", model="tiny-b") == 1
    assert s.value("swapper_unload_seconds_count") == 2
    # a→b and b→a were swaps; the first load of tiny-a was not
    assert s.value("swapper_swap_seconds_count", model="tiny-b") == 1
    assert s.value("swapper_swap_seconds_count", model="tiny-a") == 1
    assert s.value("swapper_queue_wait_seconds_count", model="tiny-a") == 4
    assert s.value("swapper_queue_wait_seconds_count", model="tiny-b") == 1
    assert s.value("swapper_requests_total", model="tiny-a", status="200") == 4
    assert s.value("swapper_requests_total", model="tiny-b", status="200") == 1
    assert s.value("swapper_resident", model="tiny-a", phase="ready") == 1
    assert s.value("swapper_queue_depth") == 0
    assert s.type("swapper_swap_seconds") == "histogram"


def test_streamed_dialects_count_their_usage(stack):
    """Anthropic Messages and Responses streams, answered natively by llama-server."""
    sw, proxy = stack
    before = scrape(proxy.url)
    # tiny-b then tiny-a: each stream is followed by a swap (see above)
    msgs = _events(requests.post(proxy.url + "/v1/messages", stream=True, timeout=300, json={
        "model": "tiny-b", "messages": HELLO, "max_tokens": 4, "stream": True}))
    start = next((e for e in msgs if e.get("type") == "message_start"), None)
    assert start is not None, msgs
    # the usage as the client sums it up: message_start's, updated by message_delta's
    # (a stream that waited for the swap opens with the proxy's message_start, whose
    # usage is 0; the backend's comes with the message_delta: proxy/progress.py)
    start = {**start["message"]["usage"],
             **[e["usage"] for e in msgs if e["type"] == "message_delta"][-1]}
    out = [e["usage"]["output_tokens"] for e in msgs if e["type"] == "message_delta"][-1]
    resp = _events(requests.post(proxy.url + "/v1/responses", stream=True, timeout=300, json={
        "model": "a", "input": "Say hello.", "max_output_tokens": 4, "stream": True}))
    usage = next(e for e in resp if e["type"] == "response.completed")["response"]["usage"]
    assert out and usage["output_tokens"]

    after = scrape(proxy.url)

    def delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("proxy_prompt_tokens_total", model="tiny-b") == (
        start["input_tokens"] + start.get("cache_read_input_tokens", 0)
        + start.get("cache_creation_input_tokens", 0))
    assert delta("proxy_completion_tokens_total", model="tiny-b") == out
    assert delta("proxy_prompt_tokens_total", model="tiny-a") == usage["input_tokens"]
    assert delta("proxy_completion_tokens_total", model="tiny-a") == usage["output_tokens"]
    assert delta("proxy_time_to_first_token_seconds_count", model="tiny-a") == 1
    assert delta("proxy_time_to_first_token_seconds_count", model="tiny-b") == 1
    assert delta("proxy_requests_total", route="/v1/messages", status="200") == 1
    assert delta("proxy_requests_total", route="/v1/responses", status="200") == 1


def test_failed_load_is_counted_without_a_duration(stack):
    sw, proxy = stack
    r = requests.post(proxy.url + "/v1/chat/completions", timeout=300,
                      json={"model": "broken", "messages": HELLO, "max_tokens": 4})
    assert r.status_code >= 500 and r.json()["error"]["code"] == "load_failed"
    s = scrape(sw.url)
    assert s.value("swapper_loads_total", model="broken", result="failed") == 1
    assert s.value("swapper_load_seconds_count", model="broken") == 0
    m = scrape(proxy.url)
    assert m.value("proxy_requests_total", route="/v1/chat/completions",
                   status=str(r.status_code)) == 1
    assert "broken" not in m.labels("proxy_prompt_tokens_total", "model")
