"""The proxy's Prometheus series, written through one method per event.

The app calls `observe(response, request, t0)` once per request (after_request);
it counts the request and follows the body to its end: first byte, first token,
duration, and the answer's `usage` (tokens by model), for every dialect
(chat/completions, Anthropic Messages, Responses), streamed or not. The model
label is the model the client asked for, resolved to its id through the
upstream's /v1/models aliases (a backend reports its own name, e.g. a GGUF
path); without one (the swapper picks the model), what the answer names. The search loop calls
`search(kind)` and `rounds(n)`. Names and labels are listed in docs/api.md's
metrics table. With several workers the values live in prometheus_client's
multiprocess files (see common/metrics.py), so a scrape answers for the proxy.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterable, Iterator

from prometheus_client import Counter, Histogram

from common import guard
from common import metrics as common
from common import sse
from common.dialects import WIRES, count, openai_usage

from .progress import SENDING
from .search.searxng import FAILURE_KINDS

log = logging.getLogger("proxy.metrics")

# Routes whose successful answers carry generated tokens -> their usage reader.
TOKEN_ROUTES: dict[str, Callable] = {**{w.path: w.usage for w in WIRES},
                                     "/v1/completions": openai_usage}
# The first part under /v1/ of a labelled route -> its label.
_V1_ROUTES = {**{w.path.split("/")[2]: w.path for w in WIRES},
              **{r: "/v1/" + r for r in ("completions", "embeddings", "models")}}
_OWN_ROUTES = {"load", "unload", "running", "upstream", "logs", "healthz", "metrics",
               "events", "models"}
# Non-streamed answers larger than this are not parsed for usage.
MAX_JSON_BYTES = 8 * 1024 * 1024


def route_label(path: str) -> str:
    """Bounded metric label for a path."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        return _V1_ROUTES.get(parts[1], "/v1/other") if len(parts) > 1 else "/v1/other"
    if parts[0] in _OWN_ROUTES:
        return "/" + parts[0]
    return "other"


# The `method` label: these, else "other" (a method is any token a client sends).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


NAME_CHARS = 100        # a model name kept in an activity record, at most


def short(name):
    """A model name as a record keeps it: the client's string, cut to NAME_CHARS
    (a request may name a 10 MB model; the ring keeps 200 records)."""
    return name[:NAME_CHARS] if isinstance(name, str) else None


NOT_READ = object()     # observe(): the handler did not read the requested model

# What a request's handlers tell its metrics, in its WSGI environ.
T0 = "coding_stack.t0"            # perf_counter() when it arrived
MODEL = "coding_stack.model"      # the model its body named (None: none), once read
ACTIVITY = "coding_stack.activity"  # its record for the console's activity list (proxy.activity)


class Metrics:
    def __init__(self, resolve: Callable[[str], str | None] | None = None, activity=None):
        """`resolve(name)`: a model's id for an alias (None when unknown).
        `activity` (proxy.activity.Activity): told of each listed request at its end."""
        self.collectors = r = common.new_registry()
        self._activity = activity
        self._bounded = common.BoundedLabel()
        self._resolve = resolve
        self._resolved: dict[str, str] = {}     # name -> id, once known (bounded below)
        self._requests = Counter(
            "proxy_requests", "HTTP requests answered, by route, method and status.",
            ("route", "method", "status"), registry=r)
        self._duration = Histogram(
            "proxy_request_duration_seconds", "Seconds from a request's arrival to the last "
            "byte of its answer, by route.", ("route",), buckets=common.DURATION_BUCKETS,
            registry=r)
        self._first_byte = Histogram(
            "proxy_time_to_first_byte_seconds", "Seconds to the first byte of the answer "
            "(SSE keep-alive comments included), by route.", ("route",),
            buckets=common.LATENCY_BUCKETS, registry=r)
        self._first_token = Histogram(
            "proxy_time_to_first_token_seconds", "Streamed answers: seconds to the first "
            "data event, by model.", ("model",), buckets=common.LATENCY_BUCKETS, registry=r)
        self._prompt_tokens = Counter(
            "proxy_prompt_tokens", "Prompt (input) tokens of answered requests, by model, "
            "from the answer's usage.", ("model",), registry=r)
        self._completion_tokens = Counter(
            "proxy_completion_tokens", "Completion (output) tokens of answered requests, by "
            "model, from the answer's usage.", ("model",), registry=r)
        self._decode_rate = Histogram(
            "proxy_decode_tokens_per_second", "Generation speed per answer, by model: the "
            "backend's own figure (llama.cpp timings) or, for streams, completion tokens "
            "over the time between the first and the last data event.", ("model",),
            buckets=common.TOKENS_PER_SECOND_BUCKETS, registry=r)
        self._searches = Counter(
            "proxy_searches", "Web searches sent to SearXNG.", registry=r)
        self._search_failures = Counter(
            "proxy_search_failures", "Failed web searches, by kind.", ("kind",), registry=r)
        for kind in FAILURE_KINDS:
            self._search_failures.labels(kind)
        self._search_rounds = Histogram(
            "proxy_search_rounds", "Search rounds per chat request with web_search.",
            buckets=common.COUNT_BUCKETS, registry=r)
        # The children each request writes, looked up once per label values.
        self._requests_of = common.Children(self._requests)
        self._duration_of = common.Children(self._duration)
        self._first_byte_of = common.Children(self._first_byte)
        self._first_token_of = common.Children(self._first_token)
        self._prompt_tokens_of = common.Children(self._prompt_tokens)
        self._completion_tokens_of = common.Children(self._completion_tokens)
        self._decode_rate_of = common.Children(self._decode_rate)

    # ------------------------------------------------------------- requests
    def observe(self, resp, request, t0: float | None, model=NOT_READ):
        """Count a response to a Flask `request` that arrived at `t0` (perf_counter)
        and follow its body; returns it (body wrapped if streamed). `model`: the
        model the request named (None: none), when its handler has read it; else
        it is read from the body at the end."""
        route = route_label(request.path)
        self._requests_of(route, method_label(request.method), str(resp.status_code)).inc()
        if t0 is None:
            return resp
        answer = None
        if route in TOKEN_ROUTES and resp.status_code == 200:
            # The handler has read the body: this is Werkzeug's cached copy.
            answer = _Answer(self, t0, request.get_data() if model is NOT_READ else model,
                             TOKEN_ROUTES[route])
        rec = request.environ.get(ACTIVITY) if self._activity is not None else None
        if rec is not None:
            rec.update(status=resp.status_code, model=None if model is NOT_READ else short(model),
                       stream=(resp.mimetype or "") == "text/event-stream")
        if resp.is_streamed:
            is_sse = (resp.mimetype or "") == "text/event-stream"
            resp.response = self._follow(resp.response, route, t0, answer, is_sse, rec,
                                         request.environ)
            return resp
        # A whole answer is counted once it has gone (the response's close):
        # the bookkeeping, its usage parsed included, never delays it.
        seconds = time.perf_counter() - t0
        pieces = resp.response if answer is not None else ()     # its bytes (no cycle)
        resp.call_on_close(lambda: _safely(lambda: self._whole(route, seconds, answer, pieces,
                                                               rec)))
        return resp

    def refused(self, environ: dict, status: int) -> None:
        """A request the door refused (common.origins, the API key) before the app ran."""
        self._requests_of(route_label(environ.get("PATH_INFO", "")),
                          method_label(environ.get("REQUEST_METHOD", "")), str(status)).inc()

    def _whole(self, route: str, seconds: float, answer, pieces, rec=None) -> None:
        self._first_byte_of(route).observe(seconds)
        self._duration_of(route).observe(seconds)
        if answer is not None:
            body = b"".join(pieces)
            if b'"usage"' in body or b'"timings"' in body:
                answer.json(body)
            answer.done()
        if rec is not None:
            self._ended(rec, seconds, answer)

    def _ended(self, rec: dict, seconds: float, answer) -> None:
        """The request's activity record, complete: to the ring."""
        rec["seconds"] = round(seconds, 3)
        if answer is not None:
            rec.update(model=short(answer.label or rec.get("model") or answer.model),
                       ttft=None if answer.first_token is None else round(answer.first_token, 3),
                       prompt_tokens=answer.prompt, completion_tokens=answer.completion,
                       tokens_per_second=None if answer.rate is None else round(answer.rate, 1))
        self._activity.record(rec)

    def _follow(self, inner: Iterable[bytes], route: str, t0: float, answer, is_sse: bool,
                rec: dict | None = None, environ: dict | None = None) -> Iterator[bytes]:
        first = True
        parser = sse.Parser() if answer is not None and is_sse else None
        body: list[bytes] | None = [] if answer is not None and not is_sse else None
        size = 0
        clean = True            # no partial event held by the parser
        try:
            for chunk in inner:
                # The chunk goes first; what it says is read once it has gone.
                now = time.perf_counter()
                yield chunk
                if chunk:
                    if first:
                        self._first_byte_of(route).observe(now - t0)
                        first = False
                    if environ is not None and environ.get(SENDING):
                        pass                # a wait's progress (whole events): no token
                    elif parser is not None:
                        if clean and answer.first_data is not None and chunk.endswith(b"\n\n") \
                                and b'"usage"' not in chunk and b'"timings"' not in chunk:
                            # whole events with nothing to read: only the time counts
                            if b"data:" in chunk and b"[DONE]" not in chunk:
                                answer.last_data = now
                        elif not _safely(lambda: [answer.event(ev, now)
                                                  for ev in parser.feed(chunk)]):
                            parser = answer = None          # never break a stream over it
                        else:
                            clean = chunk.endswith(b"\n\n")
                    elif body is not None:
                        size += len(chunk)
                        if size <= MAX_JSON_BYTES:
                            body.append(chunk)
            if parser is not None:
                end = time.perf_counter()
                _safely(lambda: [answer.event(ev, end) for ev in parser.flush()])
            elif body is not None and size <= MAX_JSON_BYTES:
                _safely(lambda: answer.json(b"".join(body)))
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()                       # the upstream first; then the bookkeeping
            seconds = time.perf_counter() - t0
            self._duration_of(route).observe(seconds)
            if answer is not None:
                _safely(answer.done)
            if rec is not None:
                _safely(lambda: self._ended(rec, seconds, answer))

    def model_label(self, requested: str | None, answered: str | None) -> str:
        name = requested
        if name and self._resolve is not None:
            known = self._resolved.get(name)
            if known is None:
                try:
                    known = self._resolve(name)
                except Exception:  # noqa: BLE001 - a label must never fail a request
                    known = None
                if known and len(self._resolved) < 256:
                    self._resolved[name] = known
            name = known or name
        return self._bounded(name or answered)

    def tokens(self, model: str, prompt: int | None, completion: int | None,
               per_second: float | None = None, first_token: float | None = None) -> None:
        """What one answer said about its tokens (any of them may be unknown)."""
        label = model
        if prompt:
            self._prompt_tokens_of(label).inc(prompt)
        if completion:
            self._completion_tokens_of(label).inc(completion)
        if per_second:
            self._decode_rate_of(label).observe(per_second)
        if first_token is not None:
            self._first_token_of(label).observe(first_token)

    # ------------------------------------------------------------- search
    def search(self, failure_kind: str | None) -> None:
        """One SearXNG request ended; `failure_kind` None when it succeeded."""
        self._searches.inc()
        if failure_kind:
            self._search_failures.labels(failure_kind).inc()

    def rounds(self, n: int) -> None:
        """A chat request with web_search ended after `n` search rounds."""
        self._search_rounds.observe(n)
        if self._activity is not None:
            self._activity.rounds(n)

    def response(self):
        return common.response(self.collectors)


class _Answer:
    """What a successful answer's body says about its model and tokens, in its
    route's dialect (`usage`: the dialect's reader, common/dialects.py), streamed or
    not: the last value of each usage field wins (streams repeat or grow them)."""

    __slots__ = ("metrics", "t0", "requested", "usage", "model", "prompt", "completion",
                 "per_second", "timed_prompt", "timed_completion", "first_data", "last_data",
                 "ended", "rate", "first_token", "label")

    def __init__(self, metrics: Metrics, t0: float, requested: bytes | str | None,
                 usage: Callable = openai_usage):
        # requested: the model the request named, or its body to read it from
        self.metrics, self.t0, self.requested, self.usage = metrics, t0, requested, usage
        self.model = self.prompt = self.completion = self.per_second = None
        self.timed_prompt = self.timed_completion = None
        self.first_data = self.last_data = None
        self.ended = False
        self.rate = self.first_token = self.label = None       # what done() concluded

    def event(self, ev: sse.Event, now: float) -> None:
        if ev.data is None or ev.is_done:
            return
        first = self.first_data is None
        if first:
            self.first_data = now
        raw = ev.raw
        if first or b'"usage"' in raw or b'"timings"' in raw:
            try:
                obj = guard.answer_json(ev.data)
            except ValueError:
                return
            self.read(obj)
            if b'"usage"' in raw and not _has_text(obj):
                return          # a usage-only event comes after the last token
        self.last_data = now

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
            if self.model is None and isinstance(holder.get("model"), str):
                self.model = holder["model"]
            usage = holder.get("usage")
            if isinstance(usage, dict):
                p, c = self.usage(usage)
                self.prompt = p if p is not None else self.prompt
                self.completion = c if c is not None else self.completion
        timings = obj.get("timings")        # llama.cpp: also in streams without usage
        if isinstance(timings, dict):
            rate = timings.get("predicted_per_second")
            if isinstance(rate, (int, float)) and rate > 0:
                self.per_second = float(rate)
            n, cached = count(timings.get("prompt_n")), count(timings.get("cache_n")) or 0
            self.timed_prompt = None if n is None else n + cached
            self.timed_completion = count(timings.get("predicted_n"))

    def done(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.prompt is None and self.completion is None:
            # A stream without usage (the client did not ask for it): llama.cpp's timings
            # count the same tokens.
            self.prompt, self.completion = self.timed_prompt, self.timed_completion
        rate = self.per_second
        if rate is None and self.completion and self.completion > 1 \
                and self.first_data is not None and self.last_data is not None \
                and self.last_data > self.first_data:
            rate = (self.completion - 1) / (self.last_data - self.first_data)
        first_token = None if self.first_data is None else self.first_data - self.t0
        self.rate, self.first_token = rate, first_token
        if self.prompt is None and self.completion is None and first_token is None:
            return
        requested = self.requested
        if isinstance(requested, bytes):
            requested = _requested_model(requested)
        self.label = model = self.metrics.model_label(requested, self.model)
        self.metrics.tokens(model, self.prompt, self.completion, rate, first_token)


def _safely(fn) -> bool:
    """Run a bookkeeping step; a bug in it is logged, never the client's problem."""
    try:
        fn()
        return True
    except Exception:  # noqa: BLE001
        log.exception("metrics: could not read an answer")
        return False


def _requested_model(body: bytes) -> str | None:
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
