"""One request's record: made when the request arrives (the app's before-request
hook), filled while it is served and by the writer as its answer goes out
(common.sse.Body: first byte, first token, usage), read once at its end by the
metrics and the activity list (proxy/metrics.py, proxy/activity.py).

What it holds: `t0` (perf_counter at arrival), the route label, the dialect (None:
a request the activity list does not show), the method, the model the body named
(once a handler read it), the status and whether it streamed, the first byte and
the first token (seconds after t0), the answer's usage (its dialect's reader:
common/dialects.py, streamed or not: the last value of each field wins), the
search rounds, the queue wait (the swapper's word, common.queuewait: its
X-Queue-Wait header or its `: queue-wait` comment before a stream's events, summed
over search rounds), the load seconds charged to it (its share of the loads it
waited for: X-Load-Seconds or `: load-seconds`, read and summed the same way; None
from a swapper that does not tell them), and `who` (the request's key, proxy/keys: its name is listed,
its usage counted by the reader proxy/app.py `before` adds to `on_end`:
proxy/keys/usage.py).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterable, Iterator

from common import guard, queuewait, sse
from common.dialects import cached_tokens, count, openai_usage

log = logging.getLogger("proxy.record")

NOT_READ = object()     # the handler did not read the requested model
# Non-streamed answers larger than this are not parsed for usage.
MAX_JSON_BYTES = 8 * 1024 * 1024


class Record:
    __slots__ = ("t0", "route", "dialect", "method", "time", "model", "status", "stream",
                 "first_byte", "seconds", "rounds", "queue_wait", "load_seconds", "who", "usage",
                 "answered", "prompt", "cached", "completion", "per_second", "timed_prompt",
                 "timed_cached", "timed_completion", "first_data", "last_data", "on_end",
                 "_ended", "_rest", "body")

    def __init__(self, route: str, dialect: str | None = None, method: str | None = None,
                 t0: float | None = None, clock=time.time):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.route, self.dialect, self.method = route, dialect, method
        self.time = round(clock(), 3)
        self.model = NOT_READ
        self.body = b""         # the request's body, when no handler read its model
        self.status = self.stream = None
        self.first_byte = self.seconds = None
        self.rounds = self.queue_wait = self.load_seconds = None
        self.who = None
        self.usage: Callable | None = None       # the dialect's usage reader: tokens counted
        self.answered = self.prompt = self.completion = self.per_second = None
        self.cached = None      # of the prompt tokens, those the backend's cache served
        self.timed_prompt = self.timed_completion = self.timed_cached = None
        self.first_data = self.last_data = None
        self.on_end: list[Callable[["Record"], None]] = []     # its readers, in order
        self._ended = False
        self._rest: list | None = None        # set: reading failed, read no more

    # ------------------------------------------------------------ while served

    def note_wait(self, seconds: float | None) -> None:
        """The swapper said the request waited `seconds` (None: it said nothing)."""
        if seconds is not None:
            self.queue_wait = round((self.queue_wait or 0.0) + seconds, 3)

    def note_load(self, seconds: float | None) -> None:
        """The swapper said `seconds` of a load were charged to the request (its
        share; None: it said nothing)."""
        if seconds is not None:
            self.load_seconds = round((self.load_seconds or 0.0) + seconds, 3)

    def note_header(self, headers) -> None:
        """An upstream answer's X-Queue-Wait and X-Load-Seconds."""
        self.note_wait(queuewait.from_header(headers.get(queuewait.HEADER)))
        self.note_load(queuewait.from_header(headers.get(queuewait.LOAD_HEADER)))

    # ------------------------------------------------------------ as the answer goes

    def sent(self, evs: list[sse.Event], now: float) -> None:
        """The writer handed these events on at `now` (perf_counter)."""
        if self.first_byte is None:
            self.first_byte = now - self.t0
        if self.usage is None or self._rest is not None:
            return              # no tokens counted here (or reading them failed once)
        if not _safely(lambda: self._read(evs, now)):
            self._rest = []     # never break a stream over it: read no more

    def _read(self, evs: list[sse.Event], now: float) -> None:
        for ev in evs:
            if ev.progress or ev.data is None or ev.is_done:
                continue        # a wait's progress is not the answer's first token
            self.event(ev, now)

    def event(self, ev: sse.Event, now: float) -> None:
        """One data event of a token route's answer."""
        first = self.first_data is None
        if first:
            self.first_data = now
        raw = ev.raw
        if first or b'"usage"' in raw or b'"timings"' in raw:
            obj = ev.json
            if obj is None:
                return
            self.read(obj)
            if b'"usage"' in raw and not _has_text(obj):
                return          # a usage-only event comes after the last token
        self.last_data = now

    def passing(self, pieces: Iterable[bytes], collect: bool) -> Iterator[bytes]:
        """A streamed answer that is not an event stream, as it goes: its first byte
        noted, its body kept (`collect`: up to MAX_JSON_BYTES) for its usage."""
        body: list[bytes] | None = [] if collect else None
        size = 0
        try:
            for chunk in pieces:
                now = time.perf_counter()
                yield chunk
                if chunk:
                    if self.first_byte is None:
                        self.first_byte = now - self.t0
                    if body is not None:
                        size += len(chunk)
                        if size <= MAX_JSON_BYTES:
                            body.append(chunk)
            if body is not None and size <= MAX_JSON_BYTES:
                _safely(lambda: self.json(b"".join(body)))
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()                       # the upstream first; then the bookkeeping
            self.end()

    def whole(self, pieces, seconds: float) -> None:
        """A whole answer (its bytes, when its usage counts), gone at `seconds`."""
        self.first_byte = seconds
        if self.usage is not None:
            body = b"".join(pieces)
            if b'"usage"' in body or b'"timings"' in body:
                self.json(body)
        self.end(seconds)

    def json(self, body: bytes) -> None:
        try:
            obj = guard.answer_json(body)
        except ValueError:
            return
        self.read(obj)

    def read(self, obj) -> None:
        if not isinstance(obj, dict):
            return
        for holder in (obj, obj.get("message"), obj.get("response")):
            if not isinstance(holder, dict):
                continue
            if self.answered is None and isinstance(holder.get("model"), str):
                self.answered = holder["model"]
            usage = holder.get("usage")
            if isinstance(usage, dict):
                p, c = (self.usage or openai_usage)(usage)
                self.prompt = p if p is not None else self.prompt
                self.completion = c if c is not None else self.completion
                cached = cached_tokens(usage)
                self.cached = cached if cached is not None else self.cached
        timings = obj.get("timings")        # llama.cpp: also in streams without usage
        if isinstance(timings, dict):
            rate = timings.get("predicted_per_second")
            if isinstance(rate, (int, float)) and rate > 0:
                self.per_second = float(rate)
            n, cached = count(timings.get("prompt_n")), count(timings.get("cache_n")) or 0
            self.timed_prompt = None if n is None else n + cached
            self.timed_cached = None if n is None else cached
            self.timed_completion = count(timings.get("predicted_n"))

    # ------------------------------------------------------------ the end

    def end(self, seconds: float | None = None) -> None:
        """The answer has gone (or the client went): the record is complete; its
        readers (on_end: the metrics, then the activity list; a key's token count)
        read it, once; one that fails does not keep the next from it."""
        if self._ended:
            return
        self._ended = True
        self.seconds = time.perf_counter() - self.t0 if seconds is None else seconds
        if self.prompt is None and self.completion is None:
            # A stream without usage (the client did not ask for it): llama.cpp's timings
            # count the same tokens.
            self.prompt, self.completion = self.timed_prompt, self.timed_completion
        if self.cached is None:
            self.cached = self.timed_cached     # llama.cpp's cache_n (its usage may not say)
        for reader in self.on_end:
            _safely(lambda: reader(self))

    @property
    def first_token(self) -> float | None:
        """Seconds to the answer's first data event (a wait's progress is not one)."""
        return None if self.first_data is None else self.first_data - self.t0

    @property
    def rate(self) -> float | None:
        """Tokens per second: the backend's own figure, or completion tokens over the
        time between the first and the last data event."""
        if self.per_second is not None:
            return self.per_second
        if self.completion and self.completion > 1 and self.first_data is not None \
                and self.last_data is not None and self.last_data > self.first_data:
            return (self.completion - 1) / (self.last_data - self.first_data)
        return None

    def requested(self) -> str | None:
        """The model the request named (None: none)."""
        return self.model if self.model is not NOT_READ else None


def noting_waits(pieces: Iterable, record: Record | None) -> sse.Body:
    """A streamed answer from the swapper (bytes, or an earlier stage's events) as
    it comes; a queue-wait comment (and its load-seconds line) before its first
    event's data is noted in the request's record (then the rest passes
    untouched)."""
    return sse.Body(_noting(sse.events_of(pieces), record))


def _noting(batches, record: Record | None) -> Iterator[list[sse.Event]]:
    try:
        if record is not None:
            for evs in batches:
                yield evs
                if _noted(evs, record):
                    break
        yield from batches
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _noted(evs: list[sse.Event], record: Record) -> bool:
    """The waits the comments before the first event with data tell, noted; True
    once that event has come."""
    for ev in evs:
        if ev.data is not None:
            return True
        if not ev.blank:
            wait, load = queuewait.from_event(ev)
            record.note_wait(wait)
            record.note_load(load)
    return False


def requested_model(body: bytes) -> str | None:
    """The model a request's body names (for a request whose handler did not read it)."""
    if not body or b'"model"' not in body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) and model else None


def _has_text(obj: dict) -> bool:
    for ch in obj.get("choices") or []:
        if isinstance(ch, dict) and (ch.get("delta") or ch.get("text")):
            return True
    return False


def _safely(fn) -> bool:
    """Run a bookkeeping step; a bug in it is logged, never the client's problem."""
    try:
        fn()
        return True
    except Exception:  # noqa: BLE001
        log.exception("record: could not read an answer")
        return False
