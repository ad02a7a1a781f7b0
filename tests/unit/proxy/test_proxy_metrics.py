"""proxy.metrics.Metrics.observe on answers in the exact wire shapes of the three
dialects (taken from llama-server's output), split across chunks in awkward
places; read back with prometheus_client's parser."""
import json

import pytest
from flask import Flask, Response, request

from common.metrics import exposition
from common.sse import event as sse_event
from proxy import progress
from proxy.dialects import BY_NAME
from proxy.metrics import Metrics, route_label
from proxy.record import Record
from tests.support.metrics import Scrape, record_labels

APP = Flask("t")


def sse(*objs, crlf=False) -> bytes:
    out = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"
    return out.replace(b"\n", b"\r\n") if crlf else out


def chunk(text="x", **extra):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            "model": "/models/x.gguf", "object": "chat.completion.chunk", **extra}


USAGE = {"prompt_tokens": 33, "completion_tokens": 3, "total_tokens": 36}
TIMINGS = {"cache_n": 30, "prompt_n": 3, "predicted_n": 3, "predicted_per_second": 9.5}
CHAT_STREAM = sse(chunk("a"), chunk("b"), chunk("c"),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                   "model": "/models/x.gguf", "timings": TIMINGS},
                  {"choices": [], "model": "/models/x.gguf", "usage": USAGE})


def observe(metrics, resp, request, t0):
    """The app's hooks around an answer: the request's record (its model not read by
    a handler: the metrics read it from the body), then the metrics."""
    rec = Record(route_label(request.path), None, request.method, t0)
    rec.body = request.get_data()
    return metrics.observe(resp, rec)


def run(metrics, body_parts, *, path="/v1/chat/completions", status=200, stream=True,
        request_json=None, mimetype=None, stages=None):
    """`stages`: what makes the client's stream of the backend's pieces (the
    dialect's stages, proxy/dialects: their events, not bytes, reach the metrics)."""
    mimetype = mimetype or ("text/event-stream" if stream else "application/json")
    with APP.test_request_context(path, method="POST",
                                  json=request_json or {"model": "tiny", "messages": []}):
        request.get_data()                       # as the handlers do
        if stream:
            body = stages(iter(body_parts)) if stages else iter(body_parts)
            resp = Response(body, status=status, mimetype=mimetype)
        else:
            resp = Response(b"".join(body_parts), status=status, mimetype=mimetype)
        resp = observe(metrics, resp, request, 0.0)
        if resp.is_streamed:
            for _ in resp.response:
                pass
            resp.response.close()
        else:
            resp.close()                  # as the server does once it has sent it
    return Scrape(exposition(metrics.collectors).decode())


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


@pytest.mark.parametrize("parts", [
    [CHAT_STREAM],                                   # one chunk
    split_every(CHAT_STREAM, 7),                     # events and markers split anywhere
    CHAT_STREAM.splitlines(keepends=True),           # each line, blank ones apart
], ids=["whole", "every-7-bytes", "line-by-line"])
def test_chat_stream_usage_however_chunked(parts):
    s = run(Metrics(), parts)
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33
    assert s.value("proxy_completion_tokens_total", model="tiny") == 3
    assert s.value("proxy_time_to_first_token_seconds_count", model="tiny") == 1
    assert s.value("proxy_decode_tokens_per_second_sum", model="tiny") == 9.5


def test_crlf_stream_and_timings_without_usage():
    body = sse(chunk("a"), {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                            "timings": TIMINGS}, crlf=True)
    s = run(Metrics(), split_every(body, 5))
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33      # prompt_n + cache_n
    assert s.value("proxy_completion_tokens_total", model="tiny") == 3


def test_anthropic_stream_and_responses_json():
    m = Metrics()
    events = (
        b'event: message_start\ndata: {"type":"message_start","message":{"model":"/m.gguf",'
        b'"usage":{"cache_read_input_tokens":32,"input_tokens":1,"output_tokens":0}}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"max_tokens"},"usage":{"output_tokens":4}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    run(m, split_every(events, 11), path="/v1/messages")
    s = run(m, [json.dumps({"object": "response", "model": "/m.gguf", "usage": {
        "input_tokens": 33, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 32}}}
    ).encode()], path="/v1/responses", stream=False)
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33 + 33
    assert s.value("proxy_completion_tokens_total", model="tiny") == 4 + 4
    assert s.value("proxy_requests_total", route="/v1/messages", status="200") == 1


def staged(dialect: str):
    """The straight path's stages of `dialect` on a streamed answer, as
    proxy/dialects.handle puts them: its straight relay, then the wait's progress."""
    d = BY_NAME[dialect]
    body = {"model": "tiny", "stream": True}
    return lambda pieces: progress.kept_in_progress(
        d.progress, body, d.straight_stream(pieces, body, {}))


# The swapper's comments before a stream that waited (a load, its queue wait).
WAITED = [b"", b": loading model tiny (2 s), ~3 s left\n\n", b": queue-wait 2.500\n\n"]


def named(obj: dict) -> bytes:
    return sse_event(obj["type"], obj)


def test_a_stream_that_waited_counts_the_usage_its_stages_remade():
    """A waited stream's progress stage remakes some of the backend's events
    (Responses: its lifecycle events under our response's id, the usage in
    response.completed; Messages: the blocks renumbered, the usage in message_delta):
    the record reads them as the data events they are, not as comments (the
    failure of test_metrics.py::test_streamed_dialects_count_their_usage)."""
    m = Metrics()
    usage = {"input_tokens": 33, "output_tokens": 4, "total_tokens": 37}
    responses = WAITED + [
        named({"type": "response.created", "response": {"id": "resp_b", "status": "in_progress"}})
        + named({"type": "response.output_text.delta", "delta": "Hi"}),
        named({"type": "response.completed", "response": {
            "id": "resp_b", "status": "completed", "model": "/m.gguf", "usage": usage}})]
    s = run(m, responses, path="/v1/responses", stages=staged("responses"))
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33
    assert s.value("proxy_completion_tokens_total", model="tiny") == 4
    assert s.value("proxy_time_to_first_token_seconds_count", model="tiny") == 1
    messages = WAITED + [
        named({"type": "message_start", "message": {"model": "/m.gguf", "usage": {
            "input_tokens": 1, "cache_read_input_tokens": 32, "output_tokens": 0}}}),
        named({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}})
        + named({"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": "Hi"}}),
        named({"type": "content_block_stop", "index": 0})
        + named({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                 "usage": {"output_tokens": 4}})
        + named({"type": "message_stop"})]
    s = run(m, messages, path="/v1/messages", stages=staged("messages"))
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33 + 33
    assert s.value("proxy_completion_tokens_total", model="tiny") == 4 + 4
    assert s.value("proxy_time_to_first_token_seconds_count", model="tiny") == 2


def test_a_mirrored_reasoning_delta_is_the_first_token(monkeypatch):
    """The chat relay's reasoning mirror remakes the events that carry reasoning:
    the first of them is the answer's first token."""
    read = []
    real = Record.event
    monkeypatch.setattr(Record, "event", lambda self, ev, now: read.append(ev.raw) or
                        real(self, ev, now))
    think = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}],
             "model": "/models/x.gguf"}
    s = run(Metrics(), [b"data: " + json.dumps(think).encode() + b"\n\n", CHAT_STREAM],
            stages=staged("chat"))
    assert json.loads(read[0][len(b"data: "):])["choices"][0]["delta"] == {
        "reasoning_content": "hm", "reasoning": "hm"}, "the mirrored event read first"
    assert s.value("proxy_time_to_first_token_seconds_count", model="tiny") == 1
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 33


def test_streamed_json_answer_and_errors_not_counted():
    m = Metrics()
    body = json.dumps({"model": "x", "choices": [], "usage": USAGE}).encode()
    run(m, split_every(body, 9), mimetype="application/json")
    s = run(m, [json.dumps({"error": {"message": "no", "type": "x", "code": None},
                            "usage": USAGE}).encode()], status=503, stream=False)
    assert s.value("proxy_prompt_tokens_total") == 33
    assert s.value("proxy_requests_total", status="503") == 1


def test_model_label_resolves_aliases_and_falls_back():
    asked = []

    def resolve(name):          # the catalog: may fetch /v1/models, so asked once per name
        asked.append(name)
        return {"a": "tiny-a"}.get(name)

    m = Metrics(resolve=resolve)
    run(m, [CHAT_STREAM], request_json={"model": "a", "messages": []})
    run(m, [CHAT_STREAM], request_json={"model": "a", "messages": []})
    assert asked == ["a"]
    run(m, [CHAT_STREAM], request_json={"messages": []})
    s = run(Metrics(), [CHAT_STREAM], request_json={"messages": []})
    assert s.labels("proxy_prompt_tokens_total", "model") == {"/models/x.gguf"}
    s = Scrape(exposition(m.collectors).decode())
    assert s.labels("proxy_prompt_tokens_total", "model") == {"tiny-a", "/models/x.gguf"}
    assert s.value("proxy_prompt_tokens_total", model="tiny-a") == 2 * 33


@pytest.mark.parametrize("path, label", [
    ("/v1/chat/completions", "/v1/chat/completions"), ("/v1/messages", "/v1/messages"),
    ("/v1/files/abc", "/v1/other"), ("/load/x", "/load"), ("/../etc", "other"),
])
def test_route_label(path, label):
    assert route_label(path) == label


def test_a_bookkeeping_bug_never_breaks_the_answer(monkeypatch):
    import proxy.metrics as pm

    def broken(self, *a):
        raise RuntimeError("metrics bug")

    monkeypatch.setattr(Record, "event", broken)
    monkeypatch.setattr(pm.Metrics, "_ended", broken)
    m = Metrics()
    with APP.test_request_context("/v1/chat/completions", method="POST", json={"model": "t"}):
        request.get_data()
        resp = observe(m, Response(iter(split_every(CHAT_STREAM, 7)),
                                   mimetype="text/event-stream"), request, 0.0)
        assert b"".join(resp.response) == CHAT_STREAM
        resp.response.close()
        resp = observe(m, Response(json.dumps({"usage": USAGE}), mimetype="application/json"),
                       request, 0.0)
        assert resp.get_json() == {"usage": USAGE}
        resp.close()
    s = Scrape(exposition(m.collectors).decode())
    assert s.value("proxy_requests_total", status="200") == 2


def test_each_label_child_is_looked_up_once(monkeypatch):
    """prometheus_client's labels() (a lock, str() of each value, a key built) runs
    once per series, not on every request: the children are kept."""
    looked_up = record_labels(monkeypatch)
    m = Metrics()
    answer = json.dumps({"model": "tiny", "usage": USAGE, "timings": TIMINGS}).encode()
    for _ in range(3):
        s = run(m, [answer], stream=False)
        s = run(m, split_every(CHAT_STREAM, 7))
    assert len(looked_up) == len(set(looked_up))
    assert s.value("proxy_requests_total", route="/v1/chat/completions", status="200") == 6
    assert s.value("proxy_prompt_tokens_total", model="tiny") == 6 * 33
    assert s.value("proxy_request_duration_seconds_count", route="/v1/chat/completions") == 6


def test_an_answer_leaves_before_the_metrics_read_it(monkeypatch):
    """What the metrics read of an answer (its events parsed, its usage, the
    histograms) is read once that piece has gone to the client: never between
    the backend's token and the client."""
    read = []
    real = Record.event
    monkeypatch.setattr(Record, "event", lambda self, ev, now: read.append(ev.raw) or
                        real(self, ev, now))
    m = Metrics()
    pieces = split_every(CHAT_STREAM, 40)
    with APP.test_request_context("/v1/chat/completions", method="POST", json={"model": "t"}):
        request.get_data()
        stream = observe(m, Response(iter(pieces), mimetype="text/event-stream"), request,
                         0.0)
        it = iter(stream.response)
        # the reader hands on each read's whole events: the first event's bytes
        first = next(it)
        assert first == CHAT_STREAM[:len(first)] and first.endswith(b"\n\n")
        assert read == []                                    # out, not yet read
        next(it)
        assert read and read[0].startswith(b"data: {")
        list(it)
        stream.response.close()
        whole = observe(m, Response(json.dumps({"usage": USAGE}),
                                    mimetype="application/json"), request, 0.0)
        before = Scrape(exposition(m.collectors).decode())
        whole.close()                                        # the server has sent it
    after = Scrape(exposition(m.collectors).decode())
    assert before.value("proxy_prompt_tokens_total", model="t") == 33    # the stream's
    assert after.value("proxy_prompt_tokens_total", model="t") == 66
