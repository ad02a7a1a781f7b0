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
The answer's X-Load-Seconds is the members' shares of the load they waited for,
summed (common/queuewait.py): the request's share, for its key's usage.
"""
from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import requests
from flask import Response

from common import queuewait
from common.errors import ApiError, error_body
from common.failures import classify, failure, reason, status_of
from common.sse import DONE, emit, iter_events
from common.streaming import NO_BUFFERING, forward_headers, iter_body

from .forward import Forwarder, relay
from .lease import Lease
from .registry import ModelSpec

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
    """Runs the n member requests of one request, each on a lease of its own
    (accounted against the model's slots like any other request), all queued
    together so they share one epoch: no other model is swapped in between."""

    def __init__(self, forwarder: Forwarder):
        self.fw = forwarder
        self.admission = forwarder.admission

    def run(self, spec: ModelSpec, path: str, query: str, headers, payload: dict, n: int,
            environ: dict) -> Response:
        bodies = _bodies(payload, n)
        hdrs = _json_headers(headers)
        leases = self.admission.admit_many(spec.id, n, environ)

        def open_member(i: int) -> tuple[Lease, requests.Response]:
            if i:
                self.admission.wait(leases[i], environ)
            leases[i], r = self.fw.open(spec.id, "POST", path, query, hdrs, bodies[i], environ,
                                        lease=leases[i])
            return leases[i], r

        if payload.get("stream"):
            return self._stream(spec, n, leases, open_member)

        def whole(i: int):
            try:
                lease, r = open_member(i)
            except ApiError as e:
                return e
            try:
                r.content
            except requests.RequestException as e:
                cause = classify(e)
                lease.finish(status_of(cause), cause)
                return failure(cause, f"model '{spec.id}': generation {i + 1} of {n} "
                                      f"failed: {reason(e)}")
            lease.finish(r.status_code)
            return r

        # Each member waits for its own slot, so the model's slots bound how
        # many the backend works on at once.
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(whole, range(n)))
        for r in results:
            if isinstance(r, ApiError):
                raise r
        bad = next((r for r in results if r.status_code != 200), None)
        if bad is not None:
            return Response(bad.content, status=bad.status_code, headers=_told(leases),
                            mimetype=bad.headers.get("content-type", "application/json"))
        return Response(json.dumps(_merge([r.json() for r in results])),
                        mimetype="application/json", headers=_told(leases))

    def _stream(self, spec: ModelSpec, n: int, leases: list[Lease], open_member) -> Response:
        # The first member answers (or fails) before the response starts, so
        # a request that cannot be served gets its error status.
        try:
            first = open_member(0)
        except BaseException:
            self.admission.leave(leases[1:])
            raise
        if first[1].status_code != 200:
            self.admission.leave(leases[1:])
            return relay(*first)
        # All members were in the load's epoch: their shares are known once the
        # first is admitted.
        return Response(self._merge_streams(spec, n, leases, first, open_member),
                        mimetype="text/event-stream", headers={**NO_BUFFERING,
                                                               **_told(leases)},
                        direct_passthrough=True)

    def _merge_streams(self, spec: ModelSpec, n: int, leases: list[Lease], first,
                       open_member):
        """Interleave n SSE streams as they arrive into one."""
        q: queue.Queue = queue.Queue()
        stop = threading.Event()
        ups: dict[int, requests.Response] = {}

        def member(i: int):
            lease = None
            end: object = RuntimeError("the generation ended without a word")
            try:
                lease, up = first if i == 0 else open_member(i)
                ups[i] = up
                if stop.is_set():
                    return
                if up.status_code != 200:
                    end = RuntimeError(f"the backend answered {up.status_code}: "
                                       f"{up.text[:300]}")
                    return
                for ev in iter_events(iter_body(up)):
                    if stop.is_set():
                        return
                    if ev.data is not None:
                        q.put((i, ev.data))
                end = None
            except ApiError as e:
                end = e
            except BaseException as e:    # broken upstream, or anything: fail the request
                if lease is not None and not stop.is_set():
                    cause = classify(e)
                    lease.finish(status_of(cause), cause)
                end = e if isinstance(e, Exception) else RuntimeError(repr(e))
                if not isinstance(e, Exception):
                    raise
            finally:
                q.put((i, end))           # whatever ended it, the merge hears of it
                if i in ups:
                    ups[i].close()
                if lease is not None:
                    if end is None:
                        lease.finish(200)
                    else:
                        lease.finish(status_of("client_gone"), "client_gone")

        threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        try:
            open_ = n
            usage = None
            first_id = created = None
            while open_:
                i, item = q.get()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, Exception):
                    err = error_body(f"model '{spec.id}': generation {i + 1} of {n} "
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
        finally:
            stop.set()
            self.admission.leave(leases)    # members still queued leave the queue
            for up in list(ups.values()):
                up.close()


def _told(leases: list[Lease]) -> dict:
    """The members' load seconds, summed: the request's share of its load."""
    return {queuewait.LOAD_HEADER: queuewait.header_value(
        sum(lease.ticket.load_seconds for lease in leases))}


def _json_headers(headers) -> dict:
    h = forward_headers(headers)
    h["Content-Type"] = "application/json"
    return h


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
