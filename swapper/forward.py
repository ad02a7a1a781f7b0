"""Forward a request to the resident backend and relay the answer back without
buffering.

A request that never reached the backend -- the connection was refused, or
closed before any answer (llama-server closes a kept-alive connection after a
streamed answer; a backend that just died) -- is sent once more: on a fresh
connection when the backend still runs, or after the crash is handled (the
request queues again, and the model is started again). Anything else that
fails is answered with an error of its cause (common.failures).

A streamed request to a llama.cpp backend is sent asking for its prompt
progress (swapper/progress.py, unless PREFILL_PROGRESS=0 or the client asked
itself): its answer's progress chunks become SSE comments in words
(`: processing the prompt: 4,096 of 18,112 tokens (22 %), ~41 s left`), the rest
of the answer as llama-server sends it without progress.

Every path ends the request's lease exactly once: `LeasedBody.close()` for a
relayed answer (read to the end or not: HEAD never reads it), `open()` itself
for a failure before the answer.
"""
from __future__ import annotations

import logging

import requests
from flask import Response

from common import queuewait
from common.disconnect import ClientGone, sent_once_more
from common.errors import ApiError, error_body
from common.failures import classify, failure, message_of, reason, status_of
from common.http1 import Client
from common.dialects import error_event
from common.sse import comment, emit
from common.streaming import (NO_BUFFERING, Relayed, answer_headers, forward_headers,
                              iter_upstream)

from .conversations import Conversation
from .kvcache import ANSWER_TAIL
from .lease import Admission, Lease, waiting_for
from .progress import Relay
from .runtime import with_backend_key
from .settings import Settings
from .tenants import without_tenant

log = logging.getLogger("swapper.forward")


class Forwarder:
    def __init__(self, admission: Admission, settings: Settings):
        self.admission = admission
        self.settings = settings
        self.client = Client(128, fresh_after_stream=True)

    @staticmethod
    def url(lease: Lease, path: str, query: str) -> str:
        """Where a request for `path` goes on the lease's backend."""
        return f"{lease.backend.url}/{path.lstrip('/')}" + (f"?{query}" if query else "")

    def forward(self, model: str, method: str, path: str, query: str, headers,
                body: bytes | None, environ: dict, stream: bool = False,
                progress: bool = False, conversation: Conversation | None = None
                ) -> Relayed | Response:
        """The backend's answer to the request. A streamed request that has to
        wait (a load, a swap, a drain, the queue) is answered at once: an SSE
        stream of progress comments every KEEPALIVE_INTERVAL until the backend's
        own events follow, or an error event ends it. `progress`: the body asks
        llama-server for its prompt progress (progress.ask), made comments here.
        `conversation`: the request's, told to the prompt-cache keeper once the
        backend takes it (swapper/kvcache.py)."""
        words = path if progress else None
        if not stream:
            return relay(*self.open(model, method, path, query, headers, body, environ,
                                    conversation=conversation), progress=words)
        (lease,) = self.admission.queue(model, environ)
        try:
            admitted = self.admission.wait(lease, environ, timeout=0.05)
        except BaseException:
            self.admission.leave([lease])
            raise
        if admitted:
            return relay(*self.open(model, method, path, query, headers, body, environ,
                                    lease=lease, conversation=conversation), progress=words)
        events = self._waiting_stream(lease, method, path, query, headers, body, environ,
                                      words, conversation)
        return Response(events, mimetype="text/event-stream", headers=NO_BUFFERING,
                        direct_passthrough=True)

    def _waiting_stream(self, lease: Lease, method: str, path: str, query: str, headers,
                        body: bytes | None, environ: dict, progress: str | None = None,
                        conversation: Conversation | None = None):
        answer = None
        try:
            interval = self.settings.KEEPALIVE_INTERVAL
            admission, scheduler = self.admission, self.admission.scheduler
            yield comment(waiting_for(scheduler.snapshot(), lease.model))
            while not admission.wait(lease, environ, timeout=interval):
                yield comment(waiting_for(scheduler.snapshot(), lease.model))
            yield queuewait.comment(lease.ticket.wait_seconds or 0.0,
                                    lease.ticket.load_seconds)
            lease, upstream = self.open(lease.model, method, path, query, headers, body,
                                        environ, lease=lease, conversation=conversation)
            answer = LeasedBody(lease, upstream, progress)
            if upstream.status_code != 200:
                yield error_event(path, message_of(upstream.content, upstream.status_code),
                                  upstream.status_code,
                                  "backend_error")
                return
            yield from answer
        except ApiError as e:
            yield error_event(path, e.message, e.status, e.code, e.type)
        finally:
            if answer is not None:
                answer.close()
            elif lease.ticket.state == "admitted":     # the client left before the answer
                lease.finish(status_of("client_gone"), "client_gone")
            else:
                self.admission.leave([lease])

    def open(self, model: str, method: str, path: str, query: str, headers,
             body: bytes | None, environ: dict, lease: Lease | None = None,
             conversation: Conversation | None = None) -> tuple[Lease, requests.Response]:
        """Admit (unless `lease` is given), send, and wait for the answer's
        headers (for a non-streaming answer: until generation ends). A client
        that leaves meanwhile closes the upstream connection, so the backend
        stops. Returns the lease (still open) and the answer; raises ApiError
        with the lease finished."""
        fwd = forward_headers(headers)
        without_tenant(fwd)             # the proxy's word to the swapper, not the backend's
        held = [lease or self.admission.admit(model, environ)]    # the try's lease

        def send(fresh: bool) -> requests.Response:
            lease = held[0]
            lease.conversation = conversation
            if lease.kv is not None and conversation is not None:
                lease.kv.served(lease.model, conversation)
            return self._send(method, self.url(lease, path, query), body,
                              with_backend_key(fwd, lease.backend), fresh)

        def failed(e: BaseException, retry: bool) -> ApiError | None:
            lease = held[0]
            if isinstance(e, ClientGone):
                lease.finish(status_of("client_gone"), "client_gone")
                return failure("client_gone", "client disconnected before the answer")
            cause = classify(e)
            alive = lease.finish(status_of(cause), cause)
            if retry:
                log.info("model %s: request did not reach the backend (%s; container %s): "
                         "sending it again", model, reason(e),
                         "running" if alive else "dead, restarting it")
                held[0] = self.admission.admit(model, environ)   # a crash: its restart
                # the load seconds of the try before are the request's too
                held[0].ticket.load_seconds += lease.ticket.load_seconds
                return None
            msg = (f"backend of model '{model}' did not answer at "
                   f"{self.url(lease, path, query)}: {reason(e)}")
            if not alive:
                msg += (" (its container died; the next request starts it again)\n"
                        + self.admission.driver.runtime.logs(model))
            return failure(cause, msg)

        answer = sent_once_more(send, environ, failed)
        return held[0], answer

    def _send(self, method: str, url: str, body, headers: dict, fresh: bool) -> requests.Response:
        # fresh: a new connection, closed after this answer (the pooled one may be stale).
        return self.client.request(method, url, headers=headers, body=body,
                                   timeout=(self.settings.CONNECT_TIMEOUT, None), fresh=fresh)


class LeasedBody:
    """An upstream answer relayed chunk by chunk as it arrives. Its close()
    (called by the WSGI server whether or not the body was read) closes the
    upstream connection -- the backend stops generating for a client that left
    -- and finishes the lease. `progress`: the request's path when it asked for
    llama-server's prompt progress, whose chunks are made comments (progress.Relay)."""

    def __init__(self, lease: Lease, upstream: requests.Response, progress: str | None = None):
        self.lease = lease
        self.upstream = upstream
        self._started = False
        self._progress = Relay(progress) if progress is not None \
            and upstream.status_code == 200 and upstream.headers.get(
                "content-type", "").startswith("text/event-stream") else None
        self._chunks = iter_upstream(upstream, on_close=self._ended, on_break=self._broke)
        # The first answer after a restore: its tail tells what the restore bought.
        kv = lease.kv
        self._key = lease.conversation.key if lease.conversation is not None else None
        self._kv = kv if upstream.status_code == 200 and kv is not None \
            and kv.awaits_answer(lease.model, self._key) else None
        self._tail = bytearray()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        self._started = True
        try:
            chunk = next(self._chunks)
        except StopIteration:
            if self._progress is None:
                raise
            chunk, self._progress = self._progress.rest(), None
            if not chunk:
                raise
        else:
            if self._progress is not None:
                chunk = self._progress.feed(chunk)
                if self._progress.done:         # the prefill is over: bytes pass as they come
                    self._progress = None
        if self._kv is not None:
            self._tail += chunk
            if len(self._tail) > 2 * ANSWER_TAIL:
                del self._tail[:-ANSWER_TAIL]
        return chunk

    def _ended(self, complete: bool) -> None:
        if complete:
            self.lease.finish(self.upstream.status_code)
            if self._kv is not None:
                try:
                    self._kv.answered(self.lease.model, bytes(self._tail), self._key)
                except Exception:         # a count must never fail an answer
                    log.exception("reading the first answer after a restore failed")
        else:                          # the client went away mid-body
            self.lease.finish(status_of("client_gone"), "client_gone")

    def _broke(self, exc: Exception) -> bytes:
        cause = classify(exc)
        if cause == "closed_early":
            cause = "broke_off"
        alive = self.lease.finish(status_of(cause), cause)
        if not self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return b""
        what = "the backend container died" if not alive else \
            f"the backend broke off: {reason(exc)}"
        return emit(error_body(f"model '{self.lease.model}': {what} mid-response", 502,
                               type_="upstream_error", code="backend_failed"))

    def close(self) -> None:
        self._chunks.close()
        self.upstream.close()
        if not self._started:          # HEAD, or a client gone before the body
            self.lease.finish(self.upstream.status_code)


def relay(lease: Lease, upstream: requests.Response, progress: str | None = None) -> Relayed:
    """The upstream's answer, its status and headers as they came, its body as it
    comes (`progress`: see LeasedBody)."""
    headers = answer_headers(upstream)
    headers.update(NO_BUFFERING)
    headers[queuewait.HEADER] = queuewait.header_value(lease.ticket.wait_seconds or 0.0)
    headers[queuewait.LOAD_HEADER] = queuewait.header_value(lease.ticket.load_seconds)
    return Relayed(upstream.status_code, headers, LeasedBody(lease, upstream, progress))
