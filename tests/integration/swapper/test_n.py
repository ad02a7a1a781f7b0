"""`n` completions per request on the real llama-server image: natively where
the backend has the slots, fanned out and merged where it has not."""
import json

import pytest
import requests

from tests.support.servers import wait_until
from tests.support.swapper_client import running


def ask(url, model, n, stream, path="chat", max_tokens=6, **extra):
    if path == "chat":
        body = {"messages": [{"role": "user", "content": "Name a colour."}]}
    else:
        body = {"prompt": "Colours: red, green,"}
    body.update(model=model, n=n, stream=stream, max_tokens=max_tokens, **extra)
    return requests.post(f"{url}/v1/{'chat/completions' if path == 'chat' else 'completions'}",
                         json=body, stream=stream, timeout=300)


def collect_stream(r):
    """Per-choice text and finish_reason from an SSE stream; count [DONE]."""
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    texts, finish, dones, usage, ids = {}, {}, 0, None, set()
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            dones += 1
            continue
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            i = c["index"]
            delta = c.get("delta") or {}
            texts[i] = texts.get(i, "") + (delta.get("content") or c.get("text") or "")
            if c.get("finish_reason"):
                assert i not in finish, f"choice {i} finished twice"
                finish[i] = c["finish_reason"]
    return texts, finish, dones, usage, ids


@pytest.mark.parametrize("model", ["tiny-b", "tiny-a", "tiny-wide"])   # 1, 2 and 8 slots
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("path", ["chat", "completions"])
def test_n_not_streamed(swapper, model, n, path):
    r = ask(swapper.url, model, n, False, path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(n))
    for c in body["choices"]:
        assert c["finish_reason"] in ("length", "stop")
        assert (c.get("message") or {}).get("content") is not None or c.get("text") is not None
    slots = {"tiny-b": 1, "tiny-a": 2, "tiny-wide": 8}[model]
    if n > slots:
        # merged here: every generation counted (llama-server's own n>1 usage
        # counts one choice only; natively answered requests pass as they are)
        assert body["usage"]["completion_tokens"] >= n


@pytest.mark.parametrize("model", ["tiny-b", "tiny-wide"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("path", ["chat", "completions"])
def test_n_streamed(swapper, model, n, path):
    texts, finish, dones, _, ids = collect_stream(ask(swapper.url, model, n, True, path))
    assert sorted(finish) == list(range(n))            # every choice ends, once
    assert sorted(texts) == list(range(n))
    assert dones == 1
    assert len(ids) == 1                               # one response, one id


def test_fanned_out_usage_is_summed(swapper):
    one = ask(swapper.url, "tiny-b", 1, False, max_tokens=5, ignore_eos=True).json()["usage"]
    three = ask(swapper.url, "tiny-b", 3, False, max_tokens=5, ignore_eos=True).json()["usage"]
    assert three["completion_tokens"] == 3 * one["completion_tokens"] == 15
    assert three["prompt_tokens"] == 3 * one["prompt_tokens"]


def test_fanned_out_stream_usage_is_summed(swapper):
    _, _, _, usage, _ = collect_stream(ask(swapper.url, "tiny-b", 4, True, max_tokens=5,
                                           ignore_eos=True,
                                           stream_options={"include_usage": True}))
    assert usage and usage["completion_tokens"] == 20


@pytest.mark.parametrize("bad", [0, 9, -1, "3", 2.5, True])
def test_bad_n_is_400(swapper, bad):
    r = ask(swapper.url, "tiny-b", bad, False)
    assert r.status_code == 400
    assert "'n'" in r.json()["error"]["message"]


def test_a_failed_generation_fails_the_request(swapper):
    # The backend refuses each generation (context too small for the prompt):
    # the merged request fails with the backend's error, no partial success.
    r = requests.post(swapper.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-b", "n": 3, "max_tokens": 4,
        "messages": [{"role": "user", "content": "word " * 1500}]})
    assert r.status_code >= 400
    assert "error" in r.json()


def test_a_fan_out_holds_one_place_in_the_queue(swapper, invariant):
    """While an n=8 fan-out runs on tiny-b, a request for tiny-a waits: no swap
    happens between the generations."""
    from concurrent.futures import ThreadPoolExecutor
    requests.post(swapper.url + "/load/b", timeout=120)
    with ThreadPoolExecutor(2) as pool:
        fan = pool.submit(ask, swapper.url, "tiny-b", 8, False, max_tokens=24, ignore_eos=True)
        wait_until(lambda: running(swapper)["in_flight"] == 1, "fan-out admitted", 30, every=0.2)
        other = pool.submit(ask, swapper.url, "tiny-a", 1, False)
        assert fan.result().status_code == 200
        assert len(fan.result().json()["choices"]) == 8
        assert other.result().status_code == 200
    assert invariant.seen_models[-2:] == ["tiny-b", "tiny-a"]
