"""`n` completions of one prompt on every backend.

A backend that can answer `n` itself gets the request as it is: vLLM always,
llama-server while `n` fits its slots (it shares the prompt's processing across
them). Otherwise the `n` generations run as separate upstream requests of the
same prompt (the backend's prefix cache makes the prompt cheap after the first)
and are merged into one OpenAI response: choices 0..n-1, summed usage, each
choice with its own finish_reason; streamed, one SSE stream whose chunks carry
each choice's index and one final [DONE]. The whole request holds one place in
the swapper's queue, so no other model can be swapped in between generations.
One failed generation fails the request (no silent partial success).
"""
from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import requests
from flask import Response

from common.errors import ApiError, error_body
from common.sse import DONE, emit, iter_events
from common.streaming import NO_BUFFERING, forward_headers

from .forward import Forwarder
from .registry import ModelSpec
from .scheduler import Ticket

FANOUT_PATHS = ("v1/chat/completions", "v1/completions")


def requested_n(payload: dict, max_n: int) -> int:
    """The request's `n` (1 when absent); 400 when it is not 1..max_n."""
    n = payload.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(f"'n' must be an integer from 1 to {max_n}, got {n!r}", 400,
                       code="invalid_n")
    if not 1 <= n <= max_n:
        raise ApiError(f"'n' must be from 1 to {max_n} (MAX_N), got {n}", 400, code="invalid_n")
    return n


def serves_natively(spec: ModelSpec, n: int) -> bool:
    if spec.native_n is not None:
        return spec.native_n
    return spec.kind == "vllm" or n <= spec.slots


def sum_usage(total: dict | None, usage: dict | None) -> dict | None:
    """Add numeric fields (nested details too)."""
    if not usage:
        return total
    out = dict(total or {})
    for k, v in usage.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = out.get(k, 0) + v
        elif isinstance(v, dict):
            out[k] = sum_usage(out.get(k) if isinstance(out.get(k), dict) else None, v)
    return out


def _bodies(payload: dict, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        p = {k: v for k, v in payload.items() if k != "n"}
        if isinstance(p.get("seed"), int):
            p["seed"] = p["seed"] + i       # same seed n times = n identical choices
        out.append(json.dumps(p).encode())
    return out


class FanOut:
    def __init__(self, forwarder: Forwarder):
        self.fw = forwarder

    def run(self, ticket: Ticket, spec: ModelSpec, path: str, query: str, headers,
            payload: dict, n: int) -> Response:
        bodies = _bodies(payload, n)
        url = self.fw.url(ticket, path, query)

        def open_one(i: int):
            try:
                return self.fw.session.request(
                    "POST", url, data=bodies[i], headers=_json_headers(headers), stream=True,
                    timeout=(self.fw.settings.connect_timeout, None))
            except requests.RequestException as e:
                return e

        stream = bool(payload.get("stream"))
        # Streams are only opened here (headers); non-streaming generations are
        # read whole inside the pool, so its width bounds how many the backend
        # works on at once.
        with ThreadPoolExecutor(max(1, min(n, spec.slots))) as pool:
            if stream:
                results = list(pool.map(open_one, range(n)))
            else:
                results = list(pool.map(lambda i: _read(open_one(i)), range(n)))

        # One failed generation fails the request: close the rest, free the slot.
        error = next((i for i, r in enumerate(results) if isinstance(r, Exception)), None)
        bad = None if error is not None else \
            next((r for r in results if r.status_code != 200), None)
        if error is not None or bad is not None:
            for r in results:
                if not isinstance(r, Exception) and r is not bad:
                    r.close()
            status = bad.status_code if bad is not None else 502
            self.fw.scheduler.release(ticket, ok=status < 500)
            self.fw.metrics.request_done(spec.id, status)
            if bad is not None:
                return _as_response(bad)
            self.fw.driver.check(ticket.backend)
            raise ApiError(f"model '{spec.id}': generation {error + 1} of {n} failed: "
                           f"{results[error]}", 502, type_="upstream_error",
                           code="backend_failed")
        if not stream:
            self.fw.scheduler.release(ticket, ok=True)
            self.fw.metrics.request_done(spec.id, 200)
            return Response(json.dumps(_merge([r.json() for r in results])),
                            mimetype="application/json")
        return Response(self._merge_streams(ticket, spec, results),
                        mimetype="text/event-stream", headers=NO_BUFFERING,
                        direct_passthrough=True)

    def _merge_streams(self, ticket: Ticket, spec: ModelSpec, ups: list[requests.Response]):
        """Interleave n SSE streams as they arrive into one."""
        q: queue.Queue = queue.Queue()
        stop = threading.Event()

        def reader(i: int, up: requests.Response):
            try:
                for ev in iter_events(up.iter_content(chunk_size=None)):
                    if stop.is_set():
                        return
                    if ev.data is not None:
                        q.put((i, ev.data))
                q.put((i, None))
            except Exception as e:        # broken upstream: fail the whole request
                q.put((i, e))

        threads = [threading.Thread(target=reader, args=(i, up), daemon=True)
                   for i, up in enumerate(ups)]
        for t in threads:
            t.start()
        ok = False
        try:
            open_ = len(ups)
            usage = None
            first_id = created = None
            while open_:
                i, item = q.get()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, Exception):
                    err = error_body(f"model '{spec.id}': generation {i + 1} of {len(ups)} "
                                     f"broke off: {item}", 502, type_="upstream_error",
                                     code="backend_failed")
                    yield emit(err)
                    return
                if item.strip() == "[DONE]":
                    continue
                try:
                    chunk = json.loads(item)
                except ValueError:
                    continue
                if "error" in chunk:
                    yield emit(chunk)
                    return
                if first_id is None:
                    first_id, created = chunk.get("id"), chunk.get("created")
                chunk["id"], chunk["created"] = first_id, created
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = sum_usage(usage, chunk["usage"])   # one summed chunk at the end
                    continue
                for c in chunk.get("choices") or []:
                    c["index"] = i
                if chunk.get("usage"):
                    usage = sum_usage(usage, chunk.pop("usage"))
                yield emit(chunk)
            if usage is not None:
                yield emit({"id": first_id, "object": "chat.completion.chunk", "created": created,
                            "model": spec.id, "choices": [], "usage": usage})
            yield DONE
            ok = True
        finally:
            stop.set()
            for up in ups:
                up.close()
            self.fw.scheduler.release(ticket, ok=ok)
            self.fw.metrics.request_done(spec.id, 200 if ok else 502)
            if not ok:
                self.fw.driver.check(ticket.backend)


def _read(r):
    """Read a non-streaming response whole (inside the pool)."""
    if isinstance(r, Exception):
        return r
    try:
        r.content
    except requests.RequestException as e:
        return e
    return r


def _json_headers(headers) -> dict:
    h = forward_headers(headers)
    h["Content-Type"] = "application/json"
    return h


def _as_response(r: requests.Response) -> Response:
    return Response(r.content, status=r.status_code,
                    mimetype=r.headers.get("content-type", "application/json"))


def _merge(bodies: list[dict]) -> dict:
    """n single-choice responses -> one response with choices 0..n-1."""
    out = dict(bodies[0])
    choices, usage = [], None
    for i, b in enumerate(bodies):
        for c in b.get("choices") or []:
            c = dict(c)
            c["index"] = i
            choices.append(c)
        usage = sum_usage(usage, b.get("usage"))
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    out.pop("timings", None)
    return out
