"""llama-server's prompt progress made SSE comments (swapper/progress.py): the
conversion on the bytes llama-server sends (measured on the test bed's build),
and which requests ask for it -- only streamed ones to a llama.cpp backend whose
client did not; the client's own `return_progress` gets the chunks untouched."""
import json

import pytest

from common import sse
from swapper import progress
from swapper.app import create_app
from swapper.settings import Settings
from tests.support.fake_runtime import FakeRuntime
from tests.support.servers import Scripted
from tests.support.swapperproc import ENV, FIXTURE_BACKENDS

HEAD = '"created":1796216205,"id":"chatcmpl-u8B","model":"tiny-b","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"'
ROLE = '{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],' + HEAD


def pp(processed, total=6114, cache=0, ms=0):
    return (f'{{"total":{total},"cache":{cache},"processed":{processed},"time_ms":{ms}}}')


def chat_progress(processed, **kw) -> bytes:
    """A chat chunk of llama-server's with prompt progress (as it sends it)."""
    return ("data: " + ROLE + ',"prompt_progress":' + pp(processed, **kw) + "}\n\n").encode()


# What follows the prefill, the same with or without progress.
CHAT_ANSWER = ("data: " + ROLE + "}\n\n"
               'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"The"}}],'
               + HEAD + "}\n\n"
               'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],' + HEAD
               + ',"timings":{"cache_n":0,"prompt_n":6114}}\n\n'
               "data: [DONE]\n\n").encode()
CHAT = (chat_progress(0) + chat_progress(2048, ms=10000) + chat_progress(4096, ms=20500)
        + chat_progress(6114, ms=30000) + CHAT_ANSWER)

RESP = '"response":{"id":"resp_XCw","object":"response","status":"in_progress"}'
CREATED = ('event: response.created\ndata: {"type":"response.created",' + RESP + "}\n\n").encode()
IN_PROGRESS = ('event: response.in_progress\ndata: {"type":"response.in_progress",'
               + RESP + "}\n\n").encode()
RESP_ANSWER = (b'event: response.output_item.added\ndata: {"type":"response.output_item.added",'
               b'"item":{"content":[],"id":"msg_XQd","role":"assistant","status":"in_progress",'
               b'"type":"message"}}\n\n'
               b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
               b'"item_id":"msg_XQd","delta":"The \xc3\xa9t\xc3\xa9"}\n\n')


def resp_progress(processed, **kw) -> bytes:
    return ('event: response.in_progress\ndata: {"type":"response.in_progress",' + RESP
            + ',"prompt_progress":' + pp(processed, total=2014, **kw) + "}\n\n").encode()


RESPONSES = (CREATED + resp_progress(24, cache=24) + resp_progress(280, cache=24, ms=2044)
             + resp_progress(2014, cache=24, ms=16984) + RESP_ANSWER)


def relayed(target: str, stream: bytes, size: int) -> bytes:
    """`stream` through a Relay in pieces of `size` bytes."""
    r = progress.Relay(target)
    out = [r.feed(stream[i:i + size]) for i in range(0, len(stream), size)]
    return b"".join(out) + r.rest()


def comments(out: bytes) -> list[str]:
    return [ev.raw[2:].decode().strip() for ev in sse.events(out) if ev.data is None]


def without_comments(out: bytes) -> bytes:
    return b"".join(ev.raw for ev in sse.events(out) if ev.data is not None)


def test_words():
    assert progress.words({"total": 18112, "cache": 3000, "processed": 4096,
                           "time_ms": 1096}) == \
        "processing the prompt: 4,096 of 18,112 tokens (22 %), 3,000 from cache, ~14 s left"
    # the first report: nothing timed yet; the last: nothing left
    assert progress.words({"total": 6114, "cache": 0, "processed": 0, "time_ms": 0}) == \
        "processing the prompt: 0 of 6,114 tokens (0 %)"
    assert progress.words({"total": 6114, "cache": 0, "processed": 6114, "time_ms": 47563}) \
        == "processing the prompt: 6,114 of 6,114 tokens (100 %)"
    assert progress.words({"total": 100000, "cache": 0, "processed": 2048,
                           "time_ms": 20000}).endswith("~16 min left")
    for bad in ({}, {"total": 0, "cache": 0, "processed": 0}, {"total": "x"}, None):
        assert progress.words(bad) is None


@pytest.mark.parametrize("size", [1, 7, 100, 100000])
def test_chat_progress_chunks_become_comments_and_the_answer_is_as_without(size):
    out = relayed("v1/chat/completions", CHAT, size)
    assert b"prompt_progress" not in out
    assert without_comments(out) == CHAT_ANSWER             # bytes as without progress
    # the start's report and the last (the first token follows at once) say nothing
    assert comments(out) == [
        "processing the prompt: 2,048 of 6,114 tokens (33 %), ~20 s left",
        "processing the prompt: 4,096 of 6,114 tokens (66 %), ~10 s left"]
    assert out.index(b": processing the prompt: 4,096") < out.index(b'"content":"The"')


@pytest.mark.parametrize("target,stream,without", [
    ("v1/chat/completions", chat_progress(0) + chat_progress(6114, ms=900) + CHAT_ANSWER,
     CHAT_ANSWER),
    ("v1/responses", CREATED + resp_progress(24, cache=24)
     + resp_progress(2014, cache=24, ms=900) + RESP_ANSWER,
     CREATED + IN_PROGRESS + RESP_ANSWER),
])
def test_a_prompt_done_in_one_batch_gets_no_comment_and_the_bytes_of_no_progress(
        target, stream, without):
    """Its stream reaches the proxy as it did without progress: no wait shown."""
    assert relayed(target, stream, 9) == without


def test_comments_before_the_answer_pass_and_an_answer_without_progress_is_untouched():
    before = b": queue-wait 3.214\n\n"
    out = relayed("v1/chat/completions", before + CHAT, 50)
    assert out.startswith(before) and without_comments(out) == CHAT_ANSWER
    assert relayed("v1/chat/completions", CHAT_ANSWER, 13) == CHAT_ANSWER
    err = b'data: {"error":{"message":"boom","code":500}}\n\n'
    assert relayed("v1/chat/completions", chat_progress(0) + chat_progress(64, ms=500) + err,
                   9) == b": processing the prompt: 64 of 6,114 tokens (1 %), ~47 s left\n\n" + err


@pytest.mark.parametrize("size", [1, 11, 100000])
def test_responses_get_created_and_one_in_progress_where_they_come_without_progress(size):
    out = relayed("v1/responses", RESPONSES, size)
    assert b"prompt_progress" not in out
    assert without_comments(out) == CREATED + IN_PROGRESS + RESP_ANSWER
    assert comments(out) == [
        "processing the prompt: 280 of 2,014 tokens (13 %), 24 from cache, ~14 s left"]
    # the held events go after the comments, just before the first token's
    assert out.index(CREATED) > out.rindex(b": processing")


def test_a_stream_that_ends_in_the_prefill_keeps_what_was_held():
    assert relayed("v1/responses", CREATED + resp_progress(24, cache=24)
                   + resp_progress(280, cache=24, ms=2044), 5) == \
        b": processing the prompt: 280 of 2,014 tokens (13 %), 24 from cache, ~14 s left\n\n" \
        + CREATED + IN_PROGRESS


@pytest.mark.parametrize("kind,target,payload,stream,asks", [
    ("llamacpp", "v1/chat/completions", {"stream": True}, True, True),
    ("llamacpp", "v1/completions", {"stream": True}, True, True),
    ("llamacpp", "v1/responses", {"stream": True}, True, True),
    ("llamacpp", "v1/messages", {"stream": True}, True, False),      # llama-server: none
    ("llamacpp", "v1/chat/completions", {}, False, False),          # not streamed
    ("vllm", "v1/chat/completions", {"stream": True}, True, False),
    ("llamacpp", "v1/chat/completions", {"stream": True, "return_progress": True}, True, False),
    ("llamacpp", "v1/chat/completions", {"stream": True, "return_progress": False}, True, False),
])
def test_which_requests_ask(kind, target, payload, stream, asks):
    body = dict(payload)
    assert progress.ask(kind, target, body, stream) is asks
    assert body == ({**payload, "return_progress": True} if asks else payload)


def chunked(*pieces: bytes) -> list:
    """An SSE answer in HTTP/1.1 chunks, each sent on its own."""
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    return [head] + [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


def make_app(urls, **settings):
    s = Settings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV, WATCH_INTERVAL=0.05,
                 CRASH_BACKOFF=0.01, **settings)
    return create_app(s, runtime=FakeRuntime(urls))


def post(app, model, stream, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            **extra}
    return app.test_client().post("/v1/chat/completions", json=body, buffered=True)


SPLIT = [CHAT[:200], CHAT[200:900], CHAT[900:]]


def test_through_the_swapper_a_streamed_request_asks_and_its_client_gets_comments():
    srv = Scripted(chunked(*SPLIT))
    try:
        r = post(make_app({"tiny-b": srv.url}), "tiny-b", True)
        assert r.status_code == 200
        assert json.loads(srv.bodies[0])["return_progress"] is True
        assert b"prompt_progress" not in r.data and without_comments(r.data) == CHAT_ANSWER
        assert len(comments(r.data)) == 2
    finally:
        srv.close()


@pytest.mark.parametrize("model,stream,extra,settings", [
    ("tiny-b", True, {"return_progress": True}, {}),    # asked itself: the chunks as sent
    ("tiny-b", True, {}, {"PREFILL_PROGRESS": False}),  # turned off
    ("tiny-vllm", True, {}, {}),                        # vLLM
    ("tiny-b", False, {}, {}),                          # not streamed
])
def test_other_requests_go_as_sent_and_come_back_as_answered(model, stream, extra, settings):
    srv = Scripted(chunked(*SPLIT))
    try:
        r = post(make_app({model: srv.url}, **settings), model, stream, **extra)
        assert r.status_code == 200
        sent = json.loads(srv.bodies[0])
        assert sent == {"model": model, "messages": [{"role": "user", "content": "hi"}],
                        "stream": stream, **extra}
        assert r.data == CHAT
    finally:
        srv.close()
