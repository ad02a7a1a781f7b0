"""llama-server's prompt progress through the real swapper (swapper/progress.py):
the real CPU llama-server and SmolLM2, a model with 64-token batches
(`tiny-batches`), a prompt of several hundred tokens. A streamed request whose
client did not ask for `return_progress` gets, before its first token, one SSE
comment per batch with the real token counts, and otherwise the answer
llama-server sends without progress: no `prompt_progress` reaches it."""
import json
import re
import time

import openai
import pytest
import requests

from common import sse
from tests.support.proxyproc import ProxyProcess

MODEL = "tiny-batches"
COUNTS = re.compile(r"^: processing the prompt: ([\d,]+) of ([\d,]+) tokens \((\d+) %\)")


def prompt(tag: str, lines: int = 16) -> str:
    return f"{tag}. Summarise these lines: " + " ".join(
        f"{tag} line {i}: the quick brown fox jumps over the lazy dog number {i}."
        for i in range(lines))


def read(url: str, path: str, body: dict, headers=None) -> tuple[list, float]:
    """The stream's events, each with the seconds since the request when it came."""
    t0 = time.monotonic()
    out = []
    parser = sse.Parser()
    with requests.post(url + path, json=body, headers=headers, stream=True,
                       timeout=(10, 300)) as r:
        assert r.status_code == 200, r.text
        for piece in r.iter_content(chunk_size=None):
            out += [(time.monotonic() - t0, ev) for ev in parser.feed(piece)]
    out += [(time.monotonic() - t0, ev) for ev in parser.flush()]
    return out, time.monotonic() - t0


def shape(events) -> list:
    """The data events without what changes from one answer to the next."""
    out = []
    for _, ev in events:
        if ev.data is None:
            continue
        if ev.is_done:
            out.append("[DONE]")
            continue
        obj = json.loads(ev.data)
        for k in ("id", "created", "timings", "usage"):
            obj.pop(k, None)
        out.append(obj)
    return out


def test_a_streamed_prefill_says_how_far_it_is_and_the_answer_is_as_without(swapper):
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": prompt("alpha")}]}
    requests.post(f"{swapper.url}/load/{MODEL}", timeout=120).raise_for_status()
    events, took = read(swapper.url, "/v1/chat/completions", body)

    raw = b"".join(ev.raw for _, ev in events)
    assert b"prompt_progress" not in raw
    first = next(i for i, (_, ev) in enumerate(events)
                 if ev.data and '"content":"' in ev.data)
    said = [(t, COUNTS.match(ev.raw.decode())) for t, ev in events[:first]
            if ev.data is None and ev.raw.startswith(b": processing")]
    assert len(said) >= 3, raw[:2000]
    total = int(said[0][1].group(2).replace(",", ""))
    done = [int(m.group(1).replace(",", "")) for _, m in said]
    # one per 64-token batch, the start's and the last report left unsaid
    assert done == list(range(64, total, 64)) and total > 300
    prompt_n = next(json.loads(ev.data)["timings"]["prompt_n"] for _, ev in events
                    if ev.data and '"timings"' in ev.data)
    assert prompt_n == total                      # the real count: all of it processed
    print(f"{len(said)} progress comments for {total} tokens; first at {said[0][0]:.2f} s, "
          f"first token at {events[first][0]:.2f} s, answer done at {took:.2f} s")

    # The same request straight to llama-server without progress (no prompt cache,
    # so the same batches): the same data events, id, times and timings aside.
    direct, _ = read(swapper.backend_url, "/v1/chat/completions",
                     {**body, "model": MODEL, "cache_prompt": False},
                     headers=swapper.backend_headers)
    assert shape(events) == shape(direct)

    # A client that asks for the progress itself gets llama-server's chunks.
    own, _ = read(swapper.url, "/v1/chat/completions",
                  {**body, "return_progress": True,
                   "messages": [{"role": "user", "content": prompt("gamma", 6)}]})
    chunks = [ev for _, ev in own if ev.data and '"prompt_progress"' in ev.data]
    assert len(chunks) >= 2
    assert not any(ev.raw.startswith(b": processing") for _, ev in own)


def test_a_responses_prefill_too(swapper):
    body = {"model": MODEL, "stream": True, "max_output_tokens": 4, "temperature": 0,
            "input": prompt("beta", 10)}
    events, _ = read(swapper.url, "/v1/responses", body)
    raw = b"".join(ev.raw for _, ev in events)
    assert b"prompt_progress" not in raw
    assert len(re.findall(rb"^: processing the prompt: ", raw, re.M)) >= 2
    kinds = [ev.name for _, ev in events if ev.data is not None]
    # created and in_progress once each, just before the answer's first item
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"], kinds
    assert kinds[-1] == "response.completed"


@pytest.fixture(scope="module")
def proxy(swapper):
    with ProxyProcess(BACKEND_URL=swapper.url, WEB_SEARCH="0") as p:
        yield p


def test_through_the_proxy_the_words_come_with_each_dialects_progress(swapper, proxy):
    """The proxy (unchanged) makes the comments its waiting progress: chat's empty
    deltas, Responses' in_progress, which the OpenAI SDK takes; the answer follows."""
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": prompt("delta")}]}
    events, _ = read(proxy.url, "/v1/chat/completions", body)
    raw = b"".join(ev.raw for _, ev in events)
    assert b"prompt_progress" not in raw
    words = [i for i, (_, ev) in enumerate(events) if ev.raw.startswith(b": processing")]
    first = next(i for i, (_, ev) in enumerate(events)
                 if ev.data and re.search(r'"content":"[^"]', ev.data))
    assert len(words) >= 3 and words[-1] < first
    empty = [ev for _, ev in events[:first] if ev.data and '"content":""' in ev.data]
    assert len(empty) >= len(words)                 # the chunks agents' timers count

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    kinds, text = [], ""
    with client.responses.create(model=MODEL, input=prompt("epsilon", 10),
                                 max_output_tokens=4, stream=True) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert kinds.count("response.in_progress") >= 3 and text
