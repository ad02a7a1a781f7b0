"""The one model <-> SearXNG round loop, for every dialect, streamed or not.

A dialect is an adapter (proxy/dialects/base.Adapter): it builds each round's
body, reads a turn from a whole answer or from a stream (relaying what the
client sees of it), says what the client sees of our searches, and how an
answer ends or fails. This loop owns what they share: the rounds, the decision
(engine.decide), the budget, keep-alives while SearXNG works, hang-ups, the
upstream's errors, and closing every answer.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Iterator

import requests
from flask import Response

from common.disconnect import ClientGone
from common.errors import ApiError
from common.streaming import forward_headers, headers_now, sse_response

from .engine import Step, decide, new_id

TRUNCATED = "the upstream stream ended without a finish"


def message_of(raw: bytes, status: int) -> str:
    """The message of an upstream's error answer, whatever its shape (OpenAI's
    envelope, Anthropic's, FastAPI's `detail`), else the start of its body."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or obj.get("message") or obj.get("detail")
    if isinstance(msg, str) and msg:
        return msg
    text = raw[:300].decode("utf-8", "replace").strip()
    return f"upstream answered HTTP {status}: {text}" if text else \
        f"upstream answered HTTP {status} with an empty body"


def serve(ad, stream: bool) -> Response:
    """The client's answer to a request with search: the rounds, then the answer."""
    if not stream:
        try:
            return _whole(ad)
        finally:
            ad.searcher.done()
    first = ad.call(stream=True)
    if first.status_code != 200:
        ad.searcher.done()
        return _as_is(first)
    return sse_response(_stream(ad, first))


def _as_is(r: requests.Response) -> Response:
    """An upstream's answer, as it came (its error: the after-hook shapes it)."""
    content = r.content
    r.close()
    return Response(content, status=r.status_code, headers=forward_headers(r.headers))


def _whole(ad) -> Response:
    while True:
        r = ad.call(stream=False)
        if r.status_code != 200:
            return _as_is(r)
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


def _stream(ad, first: requests.Response) -> Iterator[bytes]:
    resp = first
    try:
        if headers_now(first):
            yield b""                   # the head now, while the backend works
        while True:
            turn = yield from ad.relay(resp)
            if turn is None:
                return                  # the relay ended the stream (an error event)
            resp.end()                  # at its logical end: the connection serves the next
            step = decide(turn, ad.searcher.budget_left)
            if step is Step.SEARCH:
                yield from _search(ad, turn)
                resp = ad.call(stream=True)
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


def _search(ad, turn) -> Iterator[bytes]:
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
