"""The streaming fast paths give the bytes the slow paths give, however the reads
cut the stream: sse.Parser.take/batches, normalize_sse (a read's whole events
without "reasoning pass untouched, an incomplete tail waits), and the chat search
loop (plain chunks of the first round pass unparsed, the events of a read leave
in one write). The reference for the loop is the same code with the fast path
off (`_plain` always False): every event parsed, as before it existed."""
import concurrent.futures as cf
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import sse
from proxy import normalize
from proxy.dialects import chat
from proxy.search import rounds
from proxy.search.searxng import SearchOutcome
from proxy.settings import Settings
from tests.support.answers import StreamAnswer


def chunk(delta=None, finish=None, **extra):
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
           "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return sse.emit(obj)


def call(i, name=None, args=None, id=None):
    tc = {"index": i, "function": {}}
    if id:
        tc["id"], tc["type"] = id, "function"
    if name:
        tc["function"]["name"] = name
    if args:
        tc["function"]["arguments"] = args
    return chunk({"tool_calls": [tc]})


ROLE = chunk({"role": "assistant", "content": None})
FINISH = chunk(finish="stop")
USAGE = sse.emit({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
LOADING = b": loading model m (12 s)\n\n"


def text(*pieces):
    return [chunk({"content": p}) for p in pieces]


# Rounds of backend streams (lists of events) with what makes each path differ.
ANSWER = [LOADING, ROLE, *text("Hel", "lo", " wörld"), chunk({"content": ""}),
          LOADING, *text("!"), FINISH, USAGE, sse.DONE]
SEARCH = [ROLE, *text("Let me ", "look."),
          call(0, "web_search", id="call_1"), call(0, args='{"query": '),
          call(0, args='"flask"}'), chunk(finish="tool_calls"), sse.DONE]
CLIENT_TOOL = [ROLE, *text("Running"), call(0, "Bash", id="call_9"),
               call(0, args='{"cmd": "ls"}'), chunk(finish="tool_calls"), sse.DONE]
REASONING = [ROLE, chunk({"reasoning_content": "hmm"}), *text("A", "B"), FINISH, sse.DONE]
SPACED = [json.dumps(json.loads(e[6:])).encode().join([b"data: ", b"\n\n"])
          for e in ANSWER[:-1] if e.startswith(b"data:")] + [sse.DONE]   # not compact
ERROR = [ROLE, *text("par"), sse.emit({"error": {"message": "boom", "code": 500}})]
TRUNCATED = [ROLE, *text("cut", " off")]                       # no finish, no [DONE]
EMPTY_TRUNCATED = [ROLE, LOADING]
BLANKS = [ROLE, b"\n\n", *text("x"), b"\n", *text("y"), b"\n\n\n", FINISH, sse.DONE]
CRLF = [e.replace(b"\n", b"\r\n") for e in ANSWER]
# vLLM's continuous_usage_stats: usage on every chunk; a line that is not JSON
U = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
USAGE_EVERYWHERE = [chunk({"role": "assistant", "content": ""}, usage=U),
                    *(chunk({"content": t}, usage=U) for t in "abc"),
                    chunk(finish="stop", usage=U), sse.DONE]
NOT_JSON = [ROLE, *text("a"), text("b")[0].replace(b"}\n\n", b"} x\n\n"), FINISH, sse.DONE]

SCRIPTS = {
    "answer": [ANSWER],
    "search then answer": [SEARCH, ANSWER],
    "search twice": [SEARCH, SEARCH, ANSWER],
    "client tool": [CLIENT_TOOL],
    "reasoning": [REASONING],
    "spaced json": [SPACED],
    "error": [ERROR],
    "truncated": [TRUNCATED],
    "search, then empty and truncated": [SEARCH, EMPTY_TRUNCATED],
    "blank lines": [BLANKS],
    "crlf": [CRLF],
    "usage on every chunk": [USAGE_EVERYWHERE],
    "not json": [NOT_JSON],
}


# ---------------------------------------------------------------- the reads

def cut(data: bytes, offsets) -> list[bytes]:
    """data in pieces, cut at the given offsets."""
    edges = [0, *sorted(set(o for o in offsets if 0 < o < len(data))), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def reads(data: bytes):
    """Every way of cutting the stream once, every event on its own, and all at once."""
    yield [data]
    for i in range(1, len(data)):
        yield cut(data, [i])


offsets = st.lists(st.integers(min_value=1, max_value=4000), max_size=40)


def reference_events(data: bytes) -> list[bytes]:
    """Each event's bytes, by the parser this change replaced (left to right)."""
    buf = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    out = []
    while (end := buf.find(b"\n\n")) >= 0:
        out.append(buf[:end + 2])
        buf = buf[end + 2:]
    return out, buf


# ---------------------------------------------------------------- sse.Parser

@pytest.mark.parametrize("name", ["answer", "blank lines", "crlf", "reasoning"])
def test_batches_at_every_cut_are_the_stream_events(name):
    data = b"".join(e for r in SCRIPTS[name] for e in r)
    whole, rest = reference_events(data)
    for pieces in reads(data):
        got = list(sse.batches(pieces))
        assert all(b.endswith(b"\n\n") for b in got)
        joined = b"".join(got)
        assert joined == b"".join(whole) + (rest.rstrip(b"\n") + b"\n\n" if rest.strip()
                                             else b""), pieces
        assert [e.raw for e in sse.iter_events(pieces)] == \
            [e.raw for e in sse.events(joined)]


def test_take_holds_only_the_incomplete_event():
    p = sse.Parser()
    assert p.take(b"data: a\n\ndata: b\n\nda") == b"data: a\n\ndata: b\n\n"
    assert p.take(b"ta: c\r") == b""            # a CR may be half of a CRLF
    assert p.take(b"\n\r\n: x\n\n") == b"data: c\n\n: x\n\n"
    assert p.take(b"data: d") == b"" and p.rest() == b"data: d\n\n"
    assert p.take(b"data: e\n\n\n") == b"data: e\n\n"      # the odd newline waits
    assert p.take(b"data: f\n\n") == b"\ndata: f\n\n"
    assert sse.parse_event(b"event: x\ndata: {}\n\n").name == "x"


# ---------------------------------------------------------------- normalize_sse

def normalized_reference(data: bytes) -> bytes:
    whole, rest = reference_events(data)
    if rest.strip():
        whole.append(rest.rstrip(b"\n") + b"\n\n")
    out = []
    for raw in whole:
        ev = sse.parse_event(raw)
        if ev is not None and ev.data and b'"reasoning' in raw and not ev.is_done:
            obj = json.loads(ev.data)
            normalize.normalize_completion(obj)
            raw = sse.emit(obj)
        out.append(raw)
    return b"".join(out)


def check_normalize(pieces):
    data = b"".join(pieces)
    out: list[bytes] = []

    def source():
        seen = b""
        for p in pieces:
            # what the reads so far completed is out before the next read (but an
            # event whose last CR may be half of a CRLF)
            whole, _ = reference_events(seen[:-1] if seen.endswith(b"\r") else seen)
            assert b"".join(out) == normalized_reference(b"".join(whole))
            seen += p
            yield p

    for piece in normalize.normalize_sse(source()):
        assert piece.endswith(b"\n\n")
        out.append(piece)
    assert b"".join(out) == normalized_reference(data)


@pytest.mark.parametrize("name", ["reasoning", "answer", "blank lines", "crlf"])
def test_normalize_sse_same_bytes_at_every_cut(name):
    data = b"".join(e for r in SCRIPTS[name] for e in r)
    for pieces in reads(data):
        check_normalize(pieces)


@settings(max_examples=60, deadline=None)
@given(offsets)
def test_normalize_sse_same_bytes_however_cut(cuts):
    data = b"".join(REASONING + ANSWER[:-1] + BLANKS + REASONING)
    check_normalize(cut(data, cuts))


def test_normalize_sse_passes_batches_through_untouched():
    batch = b"".join(ANSWER)
    assert list(normalize.normalize_sse([batch[:50], batch[50:]])) == \
        [batch[:batch.rfind(b"\n\n", 0, 50) + 2], batch[batch.rfind(b"\n\n", 0, 50) + 2:]]


# ---------------------------------------------------------------- the chat search loop

class Upstream:
    """Answers each round with the next script, cut into reads by `cutter`."""

    def __init__(self, rounds, cutter):
        self.rounds = list(rounds)
        self.cutter = cutter
        self.bodies = []

    def request(self, method, path, headers=None, data=None, stream=False, **_):
        self.bodies.append(json.loads(data))
        return StreamAnswer(self.cutter(b"".join(self.rounds.pop(0))))


class Searx:
    def __init__(self):
        self.queries = []

    def search(self, q):
        self.queries.append(q)
        return SearchOutcome(query=q, ok=True, results=[{"url": "https://a.org/x",
                                                         "title": q, "content": "s"}])


class Metrics:
    def search(self, kind):
        pass

    def rounds(self, n):
        pass


@pytest.fixture(scope="module")
def pool():
    with cf.ThreadPoolExecutor(2) as p:
        yield p


class Request:
    environ = {}
    headers = {}


def adapter(up, searx, pool) -> chat.ChatAdapter:
    """The chat search adapter of a streamed request, over fakes."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}
    chat.inject_tool(body)
    parts = dict(settings=Settings.from_env({}), upstream=up, searx=searx, metrics=Metrics(),
                 executor=pool)
    return chat.ChatAdapter(body, {}, parts, Request())


def run(script, cutter, pool, fast=True, monkeypatch=None):
    """The client's bytes, the bodies sent to the backend and the queries searched."""
    if not fast:
        monkeypatch.setattr(chat, "_plain", lambda whole: False)
    up, searx = Upstream(script, cutter), Searx()
    ad = adapter(up, searx, pool)
    pieces = list(rounds._stream(ad, ad.call(stream=True)))
    if not fast:
        monkeypatch.undo()
    return pieces, up.bodies, searx.queries


def whole(data):
    return [data]


@pytest.mark.parametrize("name", SCRIPTS)
def test_loop_fast_path_gives_the_slow_path_bytes(name, pool, monkeypatch):
    rounds = SCRIPTS[name]
    slow, slow_bodies, slow_queries = run(rounds, whole, pool, False, monkeypatch)
    assert slow[-1].endswith(sse.DONE) or b"error" in slow[-1]
    one_per_event = lambda data: [e for e in reference_events(data)[0]] or [data]  # noqa: E731
    for cutter in (whole, one_per_event, lambda d: cut(d, range(0, len(d), 7))):
        pieces, bodies, queries = run(rounds, cutter, pool)
        assert b"".join(pieces) == b"".join(slow)
        assert (bodies, queries) == (slow_bodies, slow_queries)


@pytest.mark.parametrize("name", ["search then answer", "client tool", "crlf", "error"])
def test_loop_same_bytes_at_every_cut(name, pool, monkeypatch):
    rounds = SCRIPTS[name]
    expect = run(rounds, whole, pool, False, monkeypatch)
    first = b"".join(rounds[0])
    for i in range(1, len(first)):
        pieces, bodies, queries = run(
            rounds, lambda d, i=i: cut(d, [i]) if d == first else [d], pool)
        assert (b"".join(pieces), bodies, queries) == \
            (b"".join(expect[0]), expect[1], expect[2]), i


@settings(max_examples=40, deadline=None)
@given(offsets, st.sampled_from(sorted(SCRIPTS)))
def test_loop_same_bytes_however_cut(cuts, name):
    with cf.ThreadPoolExecutor(1) as p, pytest.MonkeyPatch.context() as mp:
        expect = run(SCRIPTS[name], whole, p, False, mp)
        got = run(SCRIPTS[name], lambda d: cut(d, cuts), p)
    assert (b"".join(got[0]), got[1], got[2]) == (b"".join(expect[0]), expect[1], expect[2])


def test_loop_writes_once_per_read_and_parses_no_plain_chunk(pool, monkeypatch):
    def no_parse(whole):
        raise AssertionError("a plain answer's text was parsed")
    monkeypatch.setattr(chat, "_text_of", no_parse)
    pieces, _, _ = run([ANSWER], whole, pool)
    # one read: the comments, the plain chunks unchanged, the usage in one write; the
    # finish (held back), usage and [DONE] in another
    assert len(pieces) == 2 and pieces[1].endswith(sse.DONE)
    assert pieces[0].startswith(LOADING + ROLE + b"".join(text("Hel", "lo")))
    pieces, _, _ = run([ANSWER], lambda d: reference_events(d)[0], pool)
    assert pieces[:4] == [LOADING, ROLE, *text("Hel", "lo")]


def test_the_first_chunk_goes_out_unparsed(pool, monkeypatch):
    """It lies between the backend's first token and the client: the stream's
    head (id, created, model) is read from it only when a chunk of ours needs it."""
    parsed = []
    real = chat.guard.answer_json
    monkeypatch.setattr(chat.guard, "answer_json", lambda raw: parsed.append(raw) or real(raw))
    ad = adapter(Upstream([ANSWER], lambda d: reference_events(d)[0]), Searx(), pool)
    out = rounds._stream(ad, ad.call(stream=True))
    assert [next(out), next(out), next(out)] == [LOADING, ROLE, text("Hel")[0]]
    assert parsed == []
    assert b"".join(out).endswith(sse.DONE)    # the head, when needed: the slow path's bytes


def plain(whole: bytes) -> bool:
    """Whether every event of `whole` is plain (chat._plain judges one event, as the
    reader made it)."""
    evs = [ev for read in sse.read([whole]) for ev in read]
    return bool(evs) and all(chat._plain(ev) for ev in evs)


def test_plain_is_strict():
    assert plain(b"".join(text("a", "b")))
    for e in (ROLE + FINISH, FINISH, USAGE, LOADING, sse.DONE, call(0, "x"), SPACED[1],
              chunk({"reasoning": "r"}), sse.emit({"choices": []}),
              sse.emit({"error": {"message": "x"}, "choices": [{"delta": {}}]})):
        assert not plain(e), e
    # Framing is the reader's (common/sse.py): a comment line in the event, a blank
    # line before or after it leave the same plain chunk, which the slow path would
    # pass unchanged too (the loop's tests above: "blank lines", "crlf").
    for e in (text("a")[0].replace(b"\n\n", b"\n: c\n\n"), text("a")[0] + b"\n\n",
              b"\n\n" + text("a")[0], text("a")[0].replace(b"\n", b"\r\n")):
        assert plain(e), e


# ------------------------------------------------ native Messages: message_start first

def _native(with_start: bool) -> bytes:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1",'
             b'"usage":{"input_tokens":7,"output_tokens":1}}}\n\n')
    rest = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"text","text":""}}\n\n'
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    return b": loading model m (1 s)\n\n" + (start if with_start else b"") + rest


@pytest.mark.parametrize("with_start", [True, False])
def test_a_native_messages_stream_begins_with_message_start_however_it_is_cut(with_start):
    from proxy.dialects.anthropic import with_message_start
    whole = _native(with_start)
    for cut in range(1, len(whole)):
        out = b"".join(with_message_start([whole[:cut], whole[cut:]], "m"))
        evs = [e for e in sse.events(out) if e.data is not None]
        assert [e.name for e in evs][:2] == ["message_start", "content_block_start"], cut
        assert out.startswith(b": loading model m (1 s)\n\n")
        if with_start:
            assert out == whole, cut            # nothing to add: the bytes as they came
        else:
            assert json.loads(evs[0].data)["message"]["model"] == "m"
            assert out.endswith(whole[len(b": loading model m (1 s)\n\n"):])


def test_comments_before_the_first_event_pass_at_once():
    from proxy.dialects.anthropic import with_message_start
    gen = iter(with_message_start(iter([b": loading model m (1 s)\n\n", b": loading model m (2 s)\n\n"]), "m"))
    assert next(gen) == b": loading model m (1 s)\n\n"
    assert next(gen) == b": loading model m (2 s)\n\n"


def test_a_stream_that_begins_with_an_error_stays_as_it_is():
    from proxy.dialects.anthropic import with_message_start
    err = (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
           b'"message":"boom"}}\n\n')
    assert b"".join(with_message_start([err], "m")) == err


def test_a_responses_stream_renames_the_flattened_calls_however_it_is_cut():
    """Codex's namespace tools (responses.flatten): the events that carry a call of
    one are remade in Codex's shape, every other event passes byte for byte."""
    from proxy.dialects.responses import renamed_stream
    delta = sse.event("response.output_text.delta",
                      {"type": "response.output_text.delta", "delta": "ok"})
    call = {"type": "function_call", "call_id": "c1", "name": "ns__run", "arguments": "{}"}
    done = sse.event("response.output_item.done",
                     {"type": "response.output_item.done", "output_index": 0, "item": call})
    whole = b": keep-alive\n\n" + delta + done + sse.DONE
    for cut in range(1, len(whole)):
        out = b"".join(renamed_stream([b"", whole[:cut], whole[cut:]], {"ns__run": ("ns", "run")}))
        assert out.startswith(b": keep-alive\n\n" + delta) and out.endswith(sse.DONE), cut
        evs = [e for e in sse.events(out) if e.data is not None and not e.is_done]
        assert [e.name for e in evs] == ["response.output_text.delta",
                                         "response.output_item.done"]
        assert json.loads(evs[1].data)["item"] == {**call, "name": "run", "namespace": "ns"}
