"""A lease cannot leak (issue 20): an exception of any type raised at any step
between admission and the answer's close -- forwarding, relaying, the waiting
stream, a fan-out and its merge -- leaves no slot taken and no ticket queued,
and the next request for the model is served. On the fake runtime with a
scripted backend; `/running` is the scheduler's snapshot."""
import threading

import pytest

from tests.support.chat import Reply, ScriptedChat
from tests.support.swapper_app import ask, make_app, settled


class Odd(Exception):
    """Not an ApiError, not a requests error: nothing expects it."""


class Killed(BaseException):
    """Not even an Exception (as GreenletExit is not)."""


# where (a dotted name), and which requests cross it
POINTS = [
    ("swapper.forward.forward_headers", "all"),
    ("swapper.forward.Forwarder._send", "all"),
    ("swapper.routes.guard.raw_tail", "all"),
    ("swapper.metrics.SwapperMetrics.queued", "all"),       # once admitted
    ("swapper.forward.answer_headers", "n1"),
    ("swapper.forward.iter_upstream", "n1"),
    ("swapper.fanout._bodies", "fan"),
    ("swapper.fanout.sum_usage", "fan-whole"),
    ("swapper.fanout._merge", "fan-whole"),
    ("swapper.fanout.iter_events", "fan-stream"),
]

CASES = [("n1", False, 1), ("n1", True, 1), ("fan-whole", False, 2), ("fan-stream", True, 2)]


@pytest.fixture
def chat():
    with ScriptedChat() as c:
        yield c


def injected(monkeypatch, where: str, exc: type) -> list:
    hits = []

    def boom(*a, **kw):
        hits.append(where)
        raise exc(f"injected at {where}")
    monkeypatch.setattr(where, boom)
    return hits


def served_after(app, chat, client) -> None:
    snap = settled(app)
    assert snap["in_flight"] == 0 and snap["queued"] == 0, snap
    chat.script(Reply("after"))
    r = ask(client)
    assert r.status_code == 200, r.data
    assert r.json["choices"][0]["message"]["content"] == "after"


# every point with every request that crosses it
CROSSINGS = [pytest.param(where, stream, n, id=f"{where.rsplit('.', 1)[1]}-{case}"
                          + ("-stream" if stream else ""))
             for where, kind in POINTS for case, stream, n in CASES
             if kind in ("all", case) or (kind == "fan" and case.startswith("fan"))]


# A fan-out member's thread that dies of Killed is reported by pytest: expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("exc", [Odd, Killed], ids=["exception", "base-exception"])
@pytest.mark.parametrize("where,stream,n", CROSSINGS)
def test_an_exception_at_any_step_frees_every_slot(chat, monkeypatch, where, stream, n, exc):
    app, _ = make_app({"tiny-b": chat.url})
    c = app.test_client()
    chat.script(*[Reply("x")] * n)
    hits = injected(monkeypatch, where, exc)
    try:
        r = ask(c, stream=stream, n=n)
        assert hits, f"{where} was not crossed"
        assert r.status_code >= 400 or b'"error"' in r.data, r.data
    except Killed:
        assert hits
    monkeypatch.undo()
    served_after(app, chat, c)


@pytest.mark.parametrize("where", ["swapper.forward.comment", "swapper.forward.waiting_for"])
def test_an_exception_in_the_waiting_stream_leaves_the_queue(chat, monkeypatch, where):
    """A streamed request that waits for a swap is answered by progress comments
    at once; what breaks them takes the request out of the queue."""
    app, runtime = make_app({"tiny-a": chat.url, "tiny-b": chat.url})
    c = app.test_client()
    chat.script(Reply("resident"))
    assert ask(c, "tiny-a").status_code == 200
    runtime.stop_gate = threading.Event()           # the swap to tiny-b waits on it
    hits = injected(monkeypatch, where, Odd)
    with pytest.raises(Odd):             # mid-body: the server can only hang up
        ask(c, "tiny-b", stream=True)
    assert hits
    monkeypatch.undo()
    runtime.stop_gate.set()
    served_after(app, chat, c)
