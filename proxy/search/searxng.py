"""SearXNG JSON client with failure classification.

Each failure has a kind (for metrics and logs), a plain-words message for the model,
and a hint for the operator.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

log = logging.getLogger("proxy.search")

# SearXNG's limiter (botdetection) rejects the default python-requests agent and
# requests that do not look like a browser's.
BROWSER_HEADERS = {
    "User-Agent": ("Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
                   "Chrome/126.0 Safari/537.36"),
    "Accept": "application/json, text/html;q=0.9, */*;q=0.8",
    "Accept-Language": "en-US,en;q=0.9",
    "Accept-Encoding": "gzip, deflate",
}

FAILURE_KINDS = ("json_disabled", "rate_limited", "engines_failed", "unreachable", "timeout",
                 "bad_response")


@dataclass
class SearchOutcome:
    query: str
    ok: bool
    results: list[dict] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    infoboxes: list[dict] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    kind: str | None = None          # failure kind when not ok
    message: str = ""                # plain words for the model
    hint: str = ""                   # what the operator should do

    @property
    def empty(self) -> bool:
        return not (self.results or self.answers or self.infoboxes)


# The connections the current thread (greenlet, under gevent) opened or used in
# this search (what the search's deadline cuts), and that deadline's event.
_local = threading.local()

# A search is a GET: a connection that drops before its answer (a pooled keep-alive
# connection SearXNG closed as it was reused, a server restarting) is tried once
# more on a new one, within the same deadline. No retry on an HTTP status.
ONE_RETRY = Retry(total=1, connect=1, read=1, status=0, other=0, redirect=0,
                  allowed_methods=frozenset({"GET"}), raise_on_status=False)


def _track(conn) -> None:
    expired = getattr(_local, "expired", None)
    if expired is not None and expired.is_set():
        # a retry after the deadline cut the search: no new attempt
        raise urllib3.exceptions.ProtocolError("the search's deadline has passed")
    conns = getattr(_local, "conns", None)
    if conns is not None:
        conns.append(conn)


class _TrackedHTTP(urllib3.connection.HTTPConnection):
    def request(self, *args, **kwargs):
        _track(self)
        return super().request(*args, **kwargs)


class _TrackedHTTPS(urllib3.connection.HTTPSConnection):
    def request(self, *args, **kwargs):
        _track(self)
        return super().request(*args, **kwargs)


class _Pool(urllib3.HTTPConnectionPool):
    ConnectionCls = _TrackedHTTP


class _SPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPS


class SearxngClient:
    def __init__(self, base_url: str, results: int = 5, timeout: float = 10.0,
                 pool_size: int = 16):
        self.base_url = base_url.rstrip("/")
        self.max_results = results
        self.timeout = timeout
        s = requests.Session()
        s.trust_env = False
        s.headers.update(BROWSER_HEADERS)
        adapter = HTTPAdapter(pool_maxsize=pool_size, max_retries=ONE_RETRY)
        pm = adapter.poolmanager
        pm.pool_classes_by_scheme = {"http": _Pool, "https": _SPool}
        s.mount("http://", adapter)
        s.mount("https://", adapter)
        self.session = s

    def search(self, query: str) -> SearchOutcome:
        """One query, bounded as a whole by `timeout` seconds: connecting, the
        headers and the body together (a server that trickles bytes cannot hold
        it longer). At the deadline the connection is shut down."""
        conns: list = []
        expired = threading.Event()

        def cut() -> None:
            expired.set()
            for conn in conns:
                sock = getattr(conn, "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        _local.conns, _local.expired = conns, expired
        timer.start()
        try:
            return self._search(query, expired)
        finally:
            timer.cancel()
            _local.conns = _local.expired = None

    def _search(self, query: str, expired: threading.Event) -> SearchOutcome:
        url = self.base_url + "/search"
        timed_out = _fail(query, "timeout",
                          f"the search engine (SearXNG) did not answer within {self.timeout:g} s",
                          f"SearXNG at {self.base_url} is slow; raise SEARXNG_TIMEOUT or check it")
        try:
            r = self.session.get(url, params={"q": query, "format": "json"}, stream=True,
                                 timeout=(min(self.timeout, 5.0), self.timeout))
            try:
                body = r.content
            finally:
                r.close()
        except requests.exceptions.Timeout:
            return timed_out
        except requests.exceptions.ConnectionError as e:
            if expired.is_set():
                return timed_out
            return _fail(query, "unreachable",
                         "the search engine (SearXNG) is down or unreachable",
                         f"cannot connect to SearXNG at {self.base_url} ({_short(e)}); "
                         "check SEARXNG_URL and that SearXNG runs")
        except requests.RequestException as e:
            if expired.is_set():
                return timed_out
            return _fail(query, "unreachable", "the search engine (SearXNG) could not be reached",
                         f"request to SearXNG at {self.base_url} failed: {_short(e)}")
        if expired.is_set():
            return timed_out
        return classify(query, r.status_code, body, self.max_results)


def classify(query: str, status: int, body: bytes, max_results: int = 5) -> SearchOutcome:
    """Turn one SearXNG HTTP answer into an outcome (pure; unit-tested)."""
    if status == 403:
        return _fail(query, "json_disabled",
                     "the search engine (SearXNG) refused JSON output (HTTP 403)",
                     "SearXNG answers 403 to format=json: add `json` to `search.formats` "
                     "in its settings.yml and restart it")
    if status == 429:
        return _fail(query, "rate_limited",
                     "the search engine (SearXNG) rate-limited this request (HTTP 429)",
                     "SearXNG's limiter blocked the proxy: set `server.limiter: false` in "
                     "settings.yml or allow the proxy's address in limiter.toml (pass_ip)")
    if status != 200:
        return _fail(query, "bad_response",
                     f"the search engine (SearXNG) answered HTTP {status}",
                     f"SearXNG returned HTTP {status}: {body[:200]!r}")
    try:
        import json
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError:
        return _fail(query, "bad_response",
                     "the search engine (SearXNG) returned something that is not JSON",
                     "SearXNG returned non-JSON on format=json (is SEARXNG_URL really "
                     f"SearXNG?): {body[:120]!r}")
    results = [r for r in data.get("results") or [] if isinstance(r, dict) and r.get("url")]
    answers = []
    for a in data.get("answers") or []:
        if isinstance(a, str):
            answers.append(a)
        elif isinstance(a, dict) and a.get("answer"):
            answers.append(str(a["answer"]))
    infoboxes = [i for i in data.get("infoboxes") or [] if isinstance(i, dict)]
    suggestions = [s for s in data.get("suggestions") or [] if isinstance(s, str)]
    out = SearchOutcome(query=query, ok=True, results=results[:max_results], answers=answers,
                        infoboxes=infoboxes[:1], suggestions=suggestions[:5])
    if out.empty:
        failed = []
        for e in data.get("unresponsive_engines") or []:
            if isinstance(e, (list, tuple)) and e:
                failed.append(f"{e[0]} ({e[1]})" if len(e) > 1 and e[1] else str(e[0]))
            elif isinstance(e, str):
                failed.append(e)
        if failed:
            return _fail(query, "engines_failed",
                         "no results because the search engines failed: " + ", ".join(failed),
                         "every SearXNG engine failed for this query: " + ", ".join(failed)
                         + "; check SearXNG's outgoing network, or enable other engines")
        out.message = "no results"
    return out


def _fail(query: str, kind: str, message: str, hint: str) -> SearchOutcome:
    return SearchOutcome(query=query, ok=False, kind=kind, message=message, hint=hint)


def _short(e: Exception) -> str:
    t = str(e)
    return "connection refused" if "Connection refused" in t else t[:200]
