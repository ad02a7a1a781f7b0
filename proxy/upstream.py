"""The one pooled HTTP client to BACKEND_URL: forwarding, and small JSON helpers.

Connect timeout short, read timeout unbounded (cold starts and long generations).
Connection failures become a 502 in the OpenAI envelope naming the URL.
Forwarding goes through common.streaming.pooled_request: a requests.Response for
callers, at about half of requests' per-call CPU.
"""
from __future__ import annotations

import logging
import threading
import time

import requests
from requests.adapters import HTTPAdapter

from common.disconnect import ClientGone, call_watching_client, watch_connections
from common.errors import ApiError
from common.streaming import pooled_request

log = logging.getLogger("proxy.upstream")


class Upstream:
    def __init__(self, base_url: str, connect_timeout: float = 10.0, pool_size: int = 1000):
        self.base_url = base_url.rstrip("/")
        self.connect_timeout = connect_timeout
        s = requests.Session()
        s.trust_env = False            # never route backend traffic through env proxies
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
        s.mount("http://", adapter)
        s.mount("https://", adapter)
        self.session = watch_connections(s)

    def request(self, method: str, path: str, *, query: str = "", headers=None, data=None,
                stream: bool = True, read_timeout: float | None = None,
                environ: dict | None = None, read_body: bool = False) -> requests.Response:
        """Send one request upstream. Raises ApiError(502) if the upstream cannot be reached.

        With the client's WSGI `environ`, the wait for the answer's headers (and,
        with read_body, its whole body) gives up when the client disconnects:
        the upstream connection is closed, so the model stops generating.
        """
        url = self.base_url + path
        if query:
            url += "?" + query

        def send() -> requests.Response:
            r = pooled_request(self.session, method, url, headers=headers, data=data,
                               timeout=(self.connect_timeout, read_timeout))
            if read_body or not stream:
                r.content
            return r

        try:
            return call_watching_client(send, environ) if environ is not None else send()
        except ClientGone:
            raise ApiError("client disconnected before the answer", 499,
                           code="client_closed") from None
        except requests.exceptions.ConnectTimeout as e:
            raise ApiError(f"upstream {self.base_url} unreachable: connect timed out after "
                           f"{self.connect_timeout:g} s ({url})", 502,
                           code="upstream_unreachable") from e
        except requests.exceptions.ConnectionError as e:
            raise ApiError(f"upstream {self.base_url} unreachable: {_reason(e)} ({url})", 502,
                           code="upstream_unreachable") from e
        except requests.exceptions.ReadTimeout as e:
            raise ApiError(f"upstream {self.base_url} timed out ({url})", 504,
                           code="upstream_timeout") from e
        except requests.RequestException as e:
            raise ApiError(f"upstream {self.base_url} request failed: {e} ({url})", 502,
                           code="upstream_error") from e


def _reason(e: Exception) -> str:
    text = str(e)
    for needle in ("Connection refused", "Name or service not known", "No route to host",
                   "Temporary failure in name resolution", "Connection reset"):
        if needle in text:
            return needle.lower()
    return text[:300]


class ModelCatalog:
    """A short-lived cache of the upstream's GET /v1/models.

    The swapper adds system_prompt / max_tokens_floor / aliases per model; a plain
    llama-server or vLLM does not (then lookups find nothing, which is fine). A failed
    fetch is cached too, so an unreachable upstream never slows chat requests down.
    """

    def __init__(self, upstream: Upstream, ttl: float = 30.0):
        self.upstream = upstream
        self.ttl = ttl
        self._lock = threading.Lock()
        self._by_name: dict[str, dict] = {}
        self._expires = 0.0

    def lookup(self, model: str | None) -> dict:
        if not model:
            return {}
        now = time.monotonic()
        if now >= self._expires:
            with self._lock:
                if now >= self._expires:
                    self._by_name = self._fetch()
                    self._expires = time.monotonic() + self.ttl
        return self._by_name.get(model, {})

    def _fetch(self) -> dict[str, dict]:
        try:
            r = self.upstream.session.get(self.upstream.base_url + "/v1/models",
                                          timeout=(min(self.upstream.connect_timeout, 2.0), 5.0))
            if r.status_code != 200:
                return {}
            entries = r.json().get("data") or []
        except Exception as e:  # noqa: BLE001 - never fail a chat request over this
            log.debug("could not fetch /v1/models: %s", e)
            return {}
        out: dict[str, dict] = {}
        for m in entries:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                continue
            out[m["id"]] = m
            for alias in m.get("aliases") or []:
                if isinstance(alias, str):
                    out.setdefault(alias, m)
        return out
