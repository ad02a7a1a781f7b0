"""Only the user's own clients reach a service: no web page on another origin can
use it or read from it. One WSGI middleware, outermost, before anything else runs
(no route, no body read, no upstream request):

- `Host`: a loopback name (`localhost`, `*.localhost`), an IP literal, or a name
  in ALLOWED_HOSTS (`*`: any). Anything else is a 421: a DNS-rebinding page (its
  own name resolved to 127.0.0.1) reaches the port, but under its own name. An
  absolute-form target's authority is checked the same way (it stands for Host).
- Browsers: a request carrying an `Origin` other than its own (scheme-less:
  `Origin`'s host and port against `Host`'s), `Origin: null`, or
  `Sec-Fetch-Site: cross-site` or `same-site` (another port of localhost is the
  same site, not the same origin) is refused with 403, unless the origin is in
  CORS_ORIGINS. curl, SDKs and agents send none of these and pass unchanged; the
  console at /ui (same origin) does too. `public(method, path)` names what
  anyone may fetch: the console's page and its assets (they hold no data).
- A browser's body (the request carries `Origin` or `Sec-Fetch-Site`) in a
  CORS-safelisted Content-Type (text/plain, a form, multipart, or none) is refused
  with 415: a body is JSON only when it says so. curl's `-d` (a form type, no
  Origin) is not a browser's.
- CORS is the service's own: every `Access-Control-*` field an app or an upstream
  put in an answer is dropped (llama-server copies any Origin into
  Access-Control-Allow-Origin, with credentials). An allowlisted origin gets
  `Access-Control-Allow-Origin` (its own, with `Vary: Origin`, never credentials),
  and its preflight (OPTIONS with Access-Control-Request-Method) is answered here,
  so a preflight never reaches a route (never a load, never a swap).

Every refusal is in the OpenAI envelope (`shape(environ, response)` may recast it:
the proxy's /v1/messages answers in Anthropic's error shape); `on_refusal(environ,
status)` is told (the proxy counts them).
"""
from __future__ import annotations

import ipaddress
from typing import Callable, Iterable
from urllib.parse import urlsplit

from .errors import error_response
from .guard import close_connection

# Content-Types a browser sends cross-origin without a preflight (Fetch standard).
SAFELISTED_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data",
                              "text/plain"})
PREFLIGHT_MAX_AGE = "600"
_BODY_METHODS_FREE = ("GET", "HEAD", "OPTIONS")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def split_list(value: str) -> tuple[str, ...]:
    """A comma- or space-separated setting, lowercased, empty entries dropped."""
    return tuple(v.strip().lower().rstrip("/") for v in value.replace(",", " ").split()
                 if v.strip())


def host_name(authority: str) -> str | None:
    """The host of `host[:port]` (IPv6 in brackets), lowercased, without a
    trailing dot; None when it is not an authority (a bad port, userinfo, a path)."""
    if not authority or any(c in authority for c in "/\\@?#% \t"):
        return None
    try:
        u = urlsplit("//" + authority)
        u.port                                    # a bad port raises ValueError
    except ValueError:
        return None
    return (u.hostname or "").rstrip(".") or None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _netloc(scheme: str, host: str) -> str:
    """`host[:port]` lowercased, the scheme's default port dropped."""
    host = host.lower()
    port = _DEFAULT_PORTS.get(scheme)
    if port and host.endswith(":" + port) and not host.endswith("]"):
        host = host[: -len(port) - 1]
    return host


class OriginGuard:
    """WSGI middleware: the Host, Origin and Sec-Fetch checks and the service's
    own CORS (see the module)."""

    def __init__(self, app, *, allowed_hosts: Iterable[str] = (),
                 cors_origins: Iterable[str] = (),
                 public: Callable[[str, str], bool] = lambda method, path: False,
                 on_refusal: Callable[[dict, int], None] | None = None,
                 shape: Callable[[dict, object], object] | None = None):
        self.app = app
        self.shape = shape      # shape(environ, response): a refusal in a route's own shape
        hosts = {h.lower().rstrip(".") for h in allowed_hosts}
        self.any_host = "*" in hosts
        self.hosts = frozenset(hosts - {"*"})
        self.cors = frozenset(o.lower().rstrip("/") for o in cors_origins)
        self.public = public
        self.on_refusal = on_refusal
        self._hosts: dict[str, bool] = {}       # Host field -> answered for (bounded)

    # ------------------------------------------------------------ checks
    def host_allowed(self, name: str | None) -> bool:
        if name is None:
            return False
        return (self.any_host or name == "localhost" or name.endswith(".localhost")
                or is_ip(name) or name in self.hosts)

    def _known_host(self, host: str) -> bool:
        """host_allowed for a Host field, remembered for the first 256 fields seen
        (a client sends the same one each time: parsing it costs ~20 us)."""
        ok = self._hosts.get(host)
        if ok is None:
            ok = self.host_allowed(host_name(host))
            if len(self._hosts) < 256:
                self._hosts[host] = ok
        return ok

    def refusal(self, environ: dict) -> tuple[int, str, str] | None:
        """(status, code, message) of a refused request, or None."""
        host = environ.get("HTTP_HOST")
        target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or ""
        if "://" in target and not target.startswith("/"):          # absolute-form
            authority = target.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
            if not self.host_allowed(host_name(authority)):
                return 421, "misdirected_request", (
                    f"this server does not answer for {authority[:100]!r}: add the name to "
                    "ALLOWED_HOSTS")
        if host is not None and not self._known_host(host):
            return 421, "misdirected_request", (
                f"this server does not answer for Host {host[:100]!r}: loopback names and "
                "IP addresses only, or a name listed in ALLOWED_HOSTS")
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "")
        origin = environ.get("HTTP_ORIGIN")
        site = (environ.get("HTTP_SEC_FETCH_SITE") or "").lower()
        if origin is not None or site in ("cross-site", "same-site"):
            if not self.public(method, path) and not self._allowed_origin(origin, host):
                shown = origin if origin is not None else f"Sec-Fetch-Site: {site}"
                return 403, "cross_origin_refused", (
                    f"a request from another origin ({shown[:100]}) is refused: web pages "
                    "cannot use this endpoint; list an origin in CORS_ORIGINS to allow it")
        # A browser: Origin or Sec-Fetch-Site (every browser sends the latter). Not
        # Sec-Fetch-Mode alone: Node's fetch (undici: the JS SDKs, Claude Code)
        # sends `sec-fetch-mode: cors` on every request.
        browser = origin is not None or bool(site)
        if browser and method not in _BODY_METHODS_FREE and has_body(environ):
            ctype = (environ.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()
            if not ctype or ctype in SAFELISTED_TYPES:
                return 415, "unsupported_media_type", (
                    f"a browser's request body must say what it is: send JSON as "
                    f"Content-Type: application/json (got {ctype or 'none'!r})")
        return None

    def _allowed_origin(self, origin: str | None, host: str | None) -> bool:
        """Same origin (by host and port: a TLS front end changes the scheme) or
        allowlisted. Without an Origin (a GET's Sec-Fetch-Site alone): never."""
        if origin is None:
            return False
        o = origin.strip().lower().rstrip("/")
        if o in self.cors:
            return True
        if o == "null" or host is None:
            return False
        try:
            u = urlsplit(o)
        except ValueError:
            return False
        if u.scheme not in _DEFAULT_PORTS or u.path or u.query:
            return False
        return _netloc(u.scheme, u.netloc) == _netloc(u.scheme, host)

    # ------------------------------------------------------------ WSGI
    def __call__(self, environ, start_response):
        refused = self.refusal(environ)
        if refused is not None:
            status, code, message = refused
            if self.on_refusal is not None:
                self.on_refusal(environ, status)
            if has_body(environ):
                close_connection(environ)       # its body is never read
            resp = error_response(message, status, code=code)
            if self.shape is not None:
                resp = self.shape(environ, resp)
            return resp(environ, start_response)
        origin = (environ.get("HTTP_ORIGIN") or "").strip().rstrip("/")
        cors = origin if origin and origin.lower() in self.cors else None
        if cors and environ.get("REQUEST_METHOD") == "OPTIONS" and \
                environ.get("HTTP_ACCESS_CONTROL_REQUEST_METHOD"):
            # An allowlisted origin's preflight: answered here, never routed.
            start_response("204 No Content", [
                ("Access-Control-Allow-Origin", cors), ("Vary", "Origin"),
                ("Access-Control-Allow-Methods", "GET, POST, PUT, PATCH, DELETE"),
                ("Access-Control-Allow-Headers",
                 environ.get("HTTP_ACCESS_CONTROL_REQUEST_HEADERS", "")[:1000]
                 or "Content-Type, Authorization"),
                ("Access-Control-Max-Age", PREFLIGHT_MAX_AGE), ("Content-Length", "0")])
            return [b""]

        def start(status, headers, exc_info=None):
            headers = [(k, v) for k, v in headers
                       if not k.lower().startswith("access-control-")]
            if cors:
                headers += [("Access-Control-Allow-Origin", cors), ("Vary", "Origin")]
            return start_response(status, headers, exc_info)

        return self.app(environ, start)


def has_body(environ: dict) -> bool:
    length = environ.get("CONTENT_LENGTH") or ""
    return (length not in ("", "0")) or \
        "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
