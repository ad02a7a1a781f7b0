"""The one model <-> SearXNG round loop, for every dialect, streamed or not.

A dialect is an adapter (proxy/dialects/base.Adapter): it builds each round's
body, reads a turn from a whole answer or from a stream (relaying what the
client sees of it), says what the client sees of our searches, and how an
answer ends or fails. This loop owns what they share: the rounds, the decision
(engine.decide), the budget, keep-alives, hang-ups, the upstream's errors, and
closing every answer.

Keep-alives: a stream waits for its first round's head at most KEEPALIVE_INTERVAL
(an error answered by then keeps its status: a 400 an agent acts on, backend_error);
after that the stream starts and carries an SSE comment every KEEPALIVE_INTERVAL
while the backend prefills (no head, or no event yet), while SearXNG works, and
while a later round prefills -- Claude Code drops a stream silent for 300 s and
sends it again.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Iterator

import requests
from flask import Response

from common import sse
from common.disconnect import ClientGone
from common.errors import ApiError
from common.streaming import forward_headers, headers_now, sse_response

from .. import agents
from ..upstream import Background, waited
from .engine import Step, decide, new_id

TRUNCATED = "the upstream stream ended without a finish"


def serve(ad, stream: bool) -> Response:
    """The client's answer to a request with search: the rounds, then the answer."""
    if not stream:
        try:
            return _whole(ad)
        finally:
            ad.searcher.done()
    interval = ad.settings.KEEPALIVE_INTERVAL
    task = Background(lambda: ad.call(stream=True))
    if not task.wait(interval):
        # no head yet (llama-server sends it after the prefill): the stream starts now
        return sse_response(sse.Body(_late(ad, task, interval)))
    try:
        first = task.result()
    except BaseException:
        ad.searcher.done()
        raise
    if first.status_code != 200:
        ad.searcher.done()
        return as_is(first)
    return sse_response(_stream(ad, first))


def backend_error(status: int, raw: bytes) -> tuple[int, bytes]:
    """The backend's error as the client gets it (agents.backend_error: a template
    exception or a prompt over the context is a 400 saying what to do)."""
    mapped = agents.backend_error(status, raw) if status >= 400 else None
    return mapped if mapped is not None else (status, raw)


def as_is(r: requests.Response) -> Response:
    """An upstream's answer, as it came, or as backend_error makes it (an error:
    the after-hook shapes it for /v1/messages). The straight path's too."""
    content = r.content
    r.close()
    status, mapped = backend_error(r.status_code, content)
    if mapped is not content:
        return Response(mapped, status=status, mimetype="application/json")
    return Response(content, status=r.status_code, headers=forward_headers(r.headers))


def late(task, interval: float, fail, failed, then) -> sse.Body:
    """A stream whose head had not come within one keep-alive interval (the rounds'
    first call, or the straight path's only one): comments until it comes (nothing
    of the dialect's is sent yet), then `then(r)`, the answer (its events). An
    error raised meanwhile is `fail(message, status, code)` (a client gone hears
    nothing), an error answer `failed(raw, status)`: the dialect's error events,
    the status being sent already."""
    return sse.Body(_waiting(task, interval, fail, failed, then))


def _waiting(task, interval: float, fail, failed, then) -> Iterator[list[sse.Event]]:
    yield sse.keepalive()
    try:
        r = yield from waited(task, interval, sse.keepalive)
    except ApiError as e:
        if e.status != 499:                 # a client gone hears nothing
            yield fail(e.message, e.status, e.code)
        return
    if r.status_code != 200:
        try:
            raw = r.content
        finally:
            r.close()
        yield failed(raw, r.status_code)
        return
    yield from sse.events_of(then(r))


def _late(ad, task, interval: float) -> Iterator[list[sse.Event]]:
    """The rounds of a stream whose first round had no head within one keep-alive
    interval (late); its error (or a refusal an agent can act on, backend_error) as
    the dialect's error event."""
    streaming = False

    def begun(first):
        nonlocal streaming
        streaming = True
        return _stream(ad, first)
    try:
        yield from sse.events_of(late(task, interval, lambda m, s, c: ad.fail(m, s, c or "error"),
                                      ad.fail_answer, begun))
    finally:
        if not streaming:
            ad.searcher.done()              # else _rounds', at its end


def _whole(ad) -> Response:
    while True:
        r = ad.call(stream=False)
        if r.status_code != 200:
            return as_is(r)
        turn = ad.turn_of(r)
        if isinstance(turn, Response):
            return turn                 # an answer that needs nothing of ours
        step = decide(turn, ad.searcher.budget_left)
        if step is Step.SEARCH:
            _name(ad, turn.ours)
            ad.searching(turn.ours)
            ad.searched(turn, ad.searcher.run(turn.ours))
        elif step is Step.EXHAUSTED:
            raise ApiError(ad.searcher.exhausted_message(), 502,
                           code="search_budget_exhausted")
        else:
            return ad.answer(turn)


def _stream(ad, first: requests.Response) -> sse.Body:
    """The rounds of a stream, relayed: the client's events (one list a write)."""
    return sse.Body(_rounds(ad, first))


def _rounds(ad, first: requests.Response) -> Iterator[list[sse.Event]]:
    resp = first
    try:
        if headers_now(first):
            yield []                    # the head now, while the backend works
        while True:
            turn = yield from ad.relay(resp)
            if turn is None:
                return                  # the relay ended the stream (an error event)
            resp.end()                  # at its logical end: the connection serves the next
            step = decide(turn, ad.searcher.budget_left)
            if step is Step.SEARCH:
                yield from _search(ad, turn)
                # the next round's prefill (our results are new tokens): kept alive
                resp = yield from waited(lambda: ad.call(stream=True),
                                         ad.settings.KEEPALIVE_INTERVAL,
                                         lambda: ad.keepalive)
                if resp.status_code != 200:
                    yield ad.fail_answer(resp.content, resp.status_code)
                    return
            elif step is Step.TRUNCATED:
                yield ad.fail(TRUNCATED, 502, "upstream_stream_truncated")
                return
            elif step is Step.EXHAUSTED:
                yield ad.fail(ad.searcher.exhausted_message(), 502, "search_budget_exhausted")
                return
            else:
                yield ad.end(turn)
                return
    except ClientGone:
        return                          # nobody to tell; the upstream is closed below
    except ApiError as e:
        yield ad.fail(e.message, e.status, e.code or "error")
    except requests.RequestException as e:
        yield ad.fail(f"upstream stream failed: {e}", 502, "upstream_error")
    finally:
        resp.close()
        ad.searcher.done()


def _search(ad, turn) -> Iterator[list[sse.Event]]:
    """Answer our calls, the client's stream kept alive while SearXNG works."""
    calls = turn.ours
    _name(ad, calls)
    planned = ad.searcher.start(calls)
    out = ad.searching(calls)
    if out:
        yield out
    futs = ad.searcher.futures(planned)
    while futs:
        _, pending = cf.wait(futs, timeout=ad.settings.KEEPALIVE_INTERVAL)
        futs = list(pending)
        if futs:
            yield ad.keepalive
    out = ad.searched(turn, ad.searcher.finish(calls, planned))
    if out:
        yield out


def _name(ad, calls) -> None:
    """The ids the client sees for our calls (Anthropic srvtoolu_, Responses ws_)."""
    if ad.call_prefix:
        for c in calls:
            c.client_id = ad.call_prefix + new_id("")[:24]
