"""The door's key check with a key store (proxy/app.py installs KeyAuth in place
of KeyCheck when KEYS_DB or KEYS_DATABASE_URL is set), the model scope check,
and the hook the rest of a request reads its key from.

Order of a request at the door, before its body is read:

1. `/healthz` and the console's page and assets pass, as without keys.
2. An address with AUTH_FAILURES_PER_MINUTE failed checks in the last minute is
   refused (429, Retry-After) without its key being looked at, unless that key
   passed here in the last ten minutes (policy.FailedAuth: behind a NAT the team
   shares one address).
3. `API_KEY`, when set and sent, passes as an admin (identity `@api-key`): the
   database is not asked.
4. A token is looked up by its digest: a key passes. Otherwise, when the store
   has never had a key, the door is what it was without a store (open, or
   API_KEY's 401); revoking the last key does not reopen it. The store's answers
   are cached per worker for at most CACHE_SECONDS (1 s): a revoked key is
   refused within a second on every worker.
5. No key, or one the store does not know: 401 (counted against the address).
6. An admin route (ADMIN_PATHS) with a `use` key: 403.
7. A model request (POST under /v1/) of a key with limits is admitted by the
   store (429 with Retry-After over a limit); its lease, when it took one, is
   released when the answer's iterable is closed, however the request ends (a
   client gone mid-stream included). The request's usage row is written from
   its record when it ends (proxy/app.py `before`, proxy/keys/usage.py): in the
   release's transaction when it holds a lease (LastWrite), else on its own.
8. The database unreachable at any step that needs it: 503, Retry-After: 1
   (nothing is served unchecked); the next request asks again.

The key is then `environ[KEY]` (a policy.Key: name, role, models, weight; also
`identity(environ)`): upstream.py sends its name, weight and model scope to the
swapper on the internal hop (tenant_headers), the dialects check the model
against its scope (`check_model`), the activity list shows its name.
"""
from __future__ import annotations

import hmac
import logging
import threading
import time

from common import scope
from common.errors import ApiError, error_response
from common.guard import close_connection
from common.origins import has_body

from . import policy
from .policy import API_KEY_IDENTITY, FailedAuth, Key
from .store import Limited, Store, StoreDown

log = logging.getLogger("proxy.keys")

KEY = "coding_stack.key"                # environ: the request's policy.Key
LAST_WRITE = "coding_stack.last_write"  # environ: a leased request's LastWrite
TENANT_HEADER = "X-Coding-Stack-Tenant"
WEIGHT_HEADER = "X-Coding-Stack-Weight"
# What tenant_headers may send the swapper: the proxy drops clients' copies.
HOP_HEADERS = (TENANT_HEADER, WEIGHT_HEADER, scope.MODELS_HEADER)
CACHE_SECONDS = 1.0
CACHE_MAX = 10000
ADMIN_PATHS = ("/load", "/unload", "/admin", "/upstream", "/logs")


def identity(environ: dict | None) -> Key | None:
    """The key the request came with (None: the door needed none)."""
    return environ.get(KEY) if environ is not None else None


def tenant_headers(environ: dict | None) -> dict[str, str]:
    """What the proxy tells the swapper of the request's key (internal hop only)."""
    key = identity(environ)
    if key is None:
        return {}
    out = {TENANT_HEADER: key.name, WEIGHT_HEADER: repr(float(key.weight))}
    models = scope.header_value(key.models)
    if models is not None:
        out[scope.MODELS_HEADER] = models
    return out


def is_admin_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PATHS)


def is_model_request(environ: dict) -> bool:
    return environ.get("REQUEST_METHOD") == "POST" and \
        environ.get("PATH_INFO", "").startswith("/v1/")


def token_of(environ: dict) -> str:
    auth = environ.get("HTTP_AUTHORIZATION", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else \
        environ.get("HTTP_X_API_KEY", "")


class Ending:
    """An answer's iterable whose close() (the server calls it however the answer
    ended: done, failed, or the client gone) runs `end` after the inner close,
    even when that raises."""

    __slots__ = ("inner", "end")

    def __init__(self, inner, end):
        self.inner, self.end = inner, end

    def __iter__(self):
        return iter(self.inner)

    def close(self):
        try:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()
        finally:
            self.end()


class LastWrite:
    """What a request's end writes with its lease's release (`usage`: the model
    and policy.Spent of its usage row), while `open` (until the door's end)."""

    __slots__ = ("open", "usage")

    def __init__(self):
        self.open = True
        self.usage = None


def last_write(environ: dict) -> LastWrite | None:
    return environ.get(LAST_WRITE)


class Cached:
    """The store's answers, per worker, for at most CACHE_SECONDS."""

    def __init__(self, store: Store, clock=time.monotonic, ttl: float = CACHE_SECONDS):
        self.store, self.clock, self.ttl = store, clock, ttl
        self._keys: dict[str, tuple[float, Key | None]] = {}
        self._any: tuple[float, bool] | None = None
        self._lock = threading.Lock()

    def has_keys(self) -> bool:
        now = self.clock()
        if self._any is not None and self._any[0] > now:
            return self._any[1]
        value = self.store.has_keys()
        self._any = (now + self.ttl, value)
        return value

    def by_token(self, token: str) -> Key | None:
        now = self.clock()
        hit = self._keys.get(token)
        if hit is not None and hit[0] > now:
            return hit[1]
        key = self.store.by_token(token)
        with self._lock:
            if len(self._keys) >= CACHE_MAX:
                self._keys.clear()
            self._keys[token] = (now + self.ttl, key)
        return key


class KeyAuth:
    """WSGI middleware: the door's key check with a store (see the module's doc)."""

    def __init__(self, app, store: Store, api_key: str, on_refusal, shape, is_public,
                 failures_per_minute: int = 30, clock=time.monotonic):
        self.app = app
        self.store = store
        self.cache = Cached(store, clock)
        self.api_key = api_key.encode()
        self.on_refusal = on_refusal
        self.shape = shape
        self.is_public = is_public
        self.failures = FailedAuth(failures_per_minute, clock)

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz" or self.is_public(path):
            return self.app(environ, start_response)
        addr = environ.get("REMOTE_ADDR", "")
        token = token_of(environ)
        wait = self.failures.blocked(addr)
        if wait is not None and not self.failures.known(token):
            return self._refuse(environ, start_response, 429, "too many failed key checks "
                                f"from this address: try again in {wait} s",
                                "too_many_auth_failures", {"Retry-After": str(wait)})
        if self.api_key and token and hmac.compare_digest(
                token.encode("utf-8", "replace"), self.api_key):
            environ[KEY] = API_KEY_IDENTITY
            self.failures.passed(token)
            return self.app(environ, start_response)
        try:
            # A key first: one made a moment ago passes on a worker that still
            # holds "no keys yet" (its token is new to this worker's cache).
            key = self.cache.by_token(token) if token else None
            if key is None and not self.cache.has_keys():
                if self.api_key:
                    return self._unauthorized(environ, start_response, addr)
                return self.app(environ, start_response)
        except StoreDown as e:
            return self._down(environ, start_response, e)
        if key is None:
            return self._unauthorized(environ, start_response, addr)
        if is_admin_path(path) and not key.admin:
            return self._refuse(environ, start_response, 403,
                                f"key '{key.name}' may not use {path}: it needs role admin",
                                "admin_only")
        environ[KEY] = key
        self.failures.passed(token)
        lease = None
        if key.limited and is_model_request(environ):
            try:
                lease = self.store.admit(key)
            except Limited as e:
                r = e.refusal
                return self._refuse(environ, start_response, 429, r.message,
                                    f"{r.limit}_exceeded", {"Retry-After": str(r.retry_after)})
            except StoreDown as e:
                return self._down(environ, start_response, e)
        return self._served(environ, start_response, key, lease)

    def _served(self, environ, start_response, key: Key, lease: str | None):
        done = False
        last = None
        if lease is not None:
            # The request's usage row, when its record ends first (it does: the
            # answer's close, inside Ending's), goes in the release's transaction.
            environ[LAST_WRITE] = last = LastWrite()

        def end():
            nonlocal done
            if done:
                return
            done = True
            if last is None:
                self.store.finish(key, lease)
                return
            last.open = False
            self.store.finish(key, lease, last.usage)
        try:
            inner = self.app(environ, start_response)
        except BaseException:
            end()
            raise
        return Ending(inner, end)

    def _unauthorized(self, environ, start_response, addr: str):
        self.failures.failed(addr)
        return self._refuse(environ, start_response, 401, "missing or wrong API key: send "
                            "'Authorization: Bearer <key>'", "invalid_api_key",
                            {"WWW-Authenticate": "Bearer"})

    def _down(self, environ, start_response, e: StoreDown):
        log.error("key database unreachable: %s", e)
        return self._refuse(environ, start_response, 503, "the key database is unreachable: "
                            "no request is served unchecked; try again shortly",
                            "key_store_unavailable", {"Retry-After": "1"})

    def _refuse(self, environ, start_response, status: int, message: str, code: str,
                headers: dict | None = None):
        self.on_refusal(environ, status)
        if has_body(environ):
            close_connection(environ)       # its body is never read
        resp = error_response(message, status, code=code, headers=headers)
        return self.shape(environ, resp)(environ, start_response)


def check_model(environ: dict, requested: str | None, catalog) -> None:
    """ApiError(403) when the request's key may not use the model it names
    (policy.may_use: the name, and the catalog's id and aliases for it). A name
    the catalog does not know (an agent's tier name, `claude-opus-4-8`; a typo)
    goes on to the swapper, which alone maps tier names to registry models: it
    maps it within the scope tenant_headers tells it (common/scope.py), and
    refuses what is outside it (403) or unknown (404)."""
    key = identity(environ)
    if key is None or "*" in key.models:
        return
    known: list[str] = []
    if requested:
        entry = catalog.lookup(requested)
        if not (isinstance(entry, dict) and isinstance(entry.get("id"), str)):
            return                      # not the catalog's: the swapper's to map or refuse
        known = [entry["id"], *(a for a in entry.get("aliases") or () if isinstance(a, str))]
    if not policy.may_use(key.models, requested, known):
        what = f"model '{requested}'" if requested else "a request naming no model"
        raise ApiError(f"key '{key.name}' may not use {what}: it may use "
                       f"{', '.join(key.models)}", 403, code="model_not_allowed")
