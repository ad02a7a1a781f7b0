"""The proxy's Prometheus series, written through one method per event.

The app calls `observe(response, record)` once per request (after_request): it
counts the request and hands the request's record (proxy/record.py) to the
answer's writer, which fills it as the answer goes (first byte, first token, the
answer's `usage`, for every dialect, streamed or not); at the answer's end the
record comes back here (`_ended`): duration, tokens by model, and on to the
activity list. The model
label is the model the client asked for, resolved to its id through the
upstream's /v1/models aliases (a backend reports its own name, e.g. a GGUF
path); without one (the swapper picks the model), what the answer names. The search loop calls
`search(kind)` and `rounds(n)`. Names and labels are listed in docs/api.md's
metrics table. With several workers the values live in prometheus_client's
multiprocess files (see common/metrics.py), so a scrape answers for the proxy.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import Counter, Histogram

from common import metrics as common
from common import sse
from common.dialects import WIRES, openai_usage

from .record import NOT_READ, Record, requested_model
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


def route_label(path: str) -> str:
    """Bounded metric label for a path."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        return _V1_ROUTES.get(parts[1], "/v1/other") if len(parts) > 1 else "/v1/other"
    if parts[0] in _OWN_ROUTES:
        return "/" + parts[0]
    return "other"


# Keys named in the usage metrics' `key` label (per process), later ones `other`.
KEY_LABELS = 50

# The `method` label: these, else "other" (a method is any token a client sends).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


class Metrics:
    def __init__(self, resolve: Callable[[str], str | None] | None = None, activity=None):
        """`resolve(name)`: a model's id for an alias (None when unknown).
        `activity` (proxy.activity.Activity): handed each request's record at its end."""
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
        # Usage per key (proxy/keys/usage.py): the key's name as a bounded label.
        self._key_label = common.BoundedLabel(KEY_LABELS)
        self._key_requests = Counter(
            "proxy_key_requests", "Model requests of keys from the key store, by key and "
            f"model (the first {KEY_LABELS} key names, later ones `other`).", ("key", "model"),
            registry=r)
        self._key_prompt = Counter(
            "proxy_key_prompt_tokens", "Prompt tokens of keys' requests (cached ones "
            "included), by key and model.", ("key", "model"), registry=r)
        self._key_cached = Counter(
            "proxy_key_cached_tokens", "Prompt tokens the backend's cache served, of keys' "
            "requests, by key and model.", ("key", "model"), registry=r)
        self._key_completion = Counter(
            "proxy_key_completion_tokens", "Completion tokens of keys' requests, by key and "
            "model.", ("key", "model"), registry=r)
        self._key_wait = Counter(
            "proxy_key_queue_wait_seconds", "Seconds keys' requests waited in the swapper "
            "(queue, load, swap), by key and model.", ("key", "model"), registry=r)
        # The children each request writes, looked up once per label values.
        self._requests_of = common.Children(self._requests)
        self._duration_of = common.Children(self._duration)
        self._first_byte_of = common.Children(self._first_byte)
        self._first_token_of = common.Children(self._first_token)
        self._prompt_tokens_of = common.Children(self._prompt_tokens)
        self._completion_tokens_of = common.Children(self._completion_tokens)
        self._decode_rate_of = common.Children(self._decode_rate)
        self._key_of = [common.Children(m) for m in (
            self._key_requests, self._key_prompt, self._key_cached, self._key_completion,
            self._key_wait)]

    # ------------------------------------------------------------- requests
    def observe(self, resp, record: Record):
        """Count a response to the request of `record` (proxy/record.py, made at its
        arrival) and have the record filled as the answer goes (the writer:
        common.sse.Body) and read here at its end (`ended`); returns the response."""
        route = record.route
        self._requests_of(route, method_label(record.method), str(resp.status_code)).inc()
        record.status = resp.status_code
        record.stream = (resp.mimetype or "") == "text/event-stream"
        if route in TOKEN_ROUTES and resp.status_code == 200:
            record.usage = TOKEN_ROUTES[route]
        record.on_end.insert(0, self._ended)
        if resp.is_streamed:
            body = resp.response
            if record.stream and (isinstance(body, sse.Body) or record.usage is not None):
                if not isinstance(body, sse.Body):
                    # bytes of an event stream no stage read (a pass-through): the reader
                    body = resp.response = sse.Body(sse.read(body))
                body.sent, body.ended = record.sent, record.end
            else:
                resp.response = record.passing(body, collect=record.usage is not None
                                               and not record.stream)
            return resp
        # A whole answer is counted once it has gone (the response's close):
        # the bookkeeping, its usage parsed included, never delays it.
        seconds = time.perf_counter() - record.t0
        pieces = resp.response if record.usage is not None else ()     # its bytes (no cycle)
        resp.call_on_close(lambda: record.whole(pieces, seconds))
        return resp

    def refused(self, environ: dict, status: int) -> None:
        """A request the door refused (common.origins, the API key) before the app ran."""
        self._requests_of(route_label(environ.get("PATH_INFO", "")),
                          method_label(environ.get("REQUEST_METHOD", "")), str(status)).inc()

    def _ended(self, rec: Record) -> None:
        """A request's record, complete: its figures, then the activity list."""
        route = rec.route
        if rec.first_byte is not None:
            self._first_byte_of(route).observe(rec.first_byte)
        self._duration_of(route).observe(rec.seconds)
        label = None
        if rec.usage is not None:
            first_token, rate = rec.first_token, rec.rate
            if rec.prompt is not None or rec.completion is not None or first_token is not None:
                requested = rec.model
                if requested is NOT_READ:
                    requested = requested_model(rec.body) if rec.body else None
                label = self.model_label(requested, rec.answered)
                self.tokens(label, rec.prompt, rec.completion, rate, first_token)
        if self._activity is not None:
            self._activity.record(rec, label)

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

    def key_usage(self, key: str, model: str, spent) -> None:
        """One request of a key from the store ended (proxy/keys/usage.py)."""
        labels = (self._key_label(key), self._bounded(model or None))
        for child, value in zip(self._key_of, (
                spent.requests, spent.prompt_tokens, spent.cached_tokens,
                spent.completion_tokens, spent.queue_wait_seconds)):
            if value:
                child(*labels).inc(value)

    # ------------------------------------------------------------- search
    def search(self, failure_kind: str | None) -> None:
        """One SearXNG request ended; `failure_kind` None when it succeeded."""
        self._searches.inc()
        if failure_kind:
            self._search_failures.labels(failure_kind).inc()

    def rounds(self, n: int) -> None:
        """A chat request with web_search ended after `n` search rounds."""
        self._search_rounds.observe(n)

    def response(self, own_key: str | None = None):
        """GET /metrics. With `own_key` (a `use` key asked) the series labelled by key
        show that key's samples only: a team's keys do not see each other's usage."""
        if own_key is None:
            return common.response(self.collectors)
        return common.response(self.collectors, lambda family, labels: (
            not family.startswith("proxy_key_") or labels.get("key") == own_key))
