"""The proxy's routes: module-level views of one blueprint. The parts they use
(settings, upstream, catalog, searx, metrics, executor) are the app's, in
`current_app.extensions["proxy"]` (create_app puts them there)."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

from flask import Blueprint, current_app, request
from werkzeug.routing import PathConverter

from common.errors import ApiError
from common.failures import reason
from common.streaming import forward_headers, relay

from . import dialects

bp = Blueprint("proxy", __name__)

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
# The swapper's own routes, reachable through the proxy.
ADMIN_ROUTES = ("/load", "/load/<rest:rest>", "/unload", "/running",
                "/upstream/<rest:rest>", "/logs", "/logs/<rest:rest>", "/events",
                "/models", "/models/<rest:rest>")


def parts() -> dict:
    return current_app.extensions["proxy"]


# ------------------------------------------------------------ own routes

@bp.get("/healthz")
def healthz():
    settings, upstream = parts()["settings"], parts()["upstream"]
    up = {"url": settings.BACKEND_URL}
    try:
        r = upstream.client.request("GET", settings.BACKEND_URL + "/healthz",
                                    timeout=(1.0, 1.5))
        r.content
        up["http_status"] = r.status_code
        up["status"] = "ok" if r.status_code == 200 else "unhealthy"
        try:
            up["body"] = r.json()
        except ValueError:
            up["body"] = r.text[:500]
    except Exception as e:  # noqa: BLE001
        up["status"] = "unreachable"
        up["error"] = reason(e)
    return {"status": "ok", "service": "proxy", "upstream": up}


@bp.get("/metrics")
def metrics():
    return parts()["metrics"].response()


# ------------------------------------------------------------ the dialects

@bp.post("/v1/chat/completions")
def chat():
    return dialects.handle(dialects.CHAT, parts(), request)


# Anthropic Messages (Claude Code) and OpenAI Responses (Codex). /v1/v1/messages:
# the anthropic SDK appends /v1/messages to its base URL, so base_url=<proxy>/v1
# (the form the OpenAI SDK wants) must work too.
@bp.post("/v1/messages")
@bp.post("/v1/v1/messages")
def messages():
    return dialects.handle(dialects.MESSAGES, parts(), request)


@bp.post("/v1/responses")
def responses():
    return dialects.handle(dialects.RESPONSES, parts(), request)


# ------------------------------------------------------------ pass-through

# What may be written into the next request line: printable ASCII, percent
# escapes as they came (never decoded), no fragment.
_TARGET = re.compile(r"/[!-\"$-~]*")


def raw_target() -> str:
    """The request target as the client sent it, still percent-encoded (path and
    query); ApiError(400) when it could not be written into a request line as is."""
    env = request.environ
    target = env.get("RAW_URI") or env.get("REQUEST_URI") or ""
    if "://" in target and not target.startswith("/"):   # absolute-form
        u = urlsplit(target)
        target = u.path + ("?" + u.query if u.query else "")
    if not _TARGET.fullmatch(target):
        raise ApiError("invalid request target: only printable ASCII (percent-encode the "
                       "rest), no '#'", 400, code="invalid_path")
    return target


class Rest(PathConverter):
    """The rest of a forwarded path, whatever it decodes to (werkzeug's `path`
    stops at a decoded line break): what is forwarded is the raw target."""
    regex = "[^/][\\s\\S]*?"


@bp.record_once
def _converter(state) -> None:
    state.app.url_map.converters["rest"] = Rest


@bp.route("/v1/<rest:rest>", methods=ALL_METHODS)
def passthrough(rest=None):
    target = raw_target()
    if target.startswith(dialects.MESSAGES_PATHS[1]):      # anthropic SDK, base_url=.../v1
        target = target[3:]
    path, _, query = target.partition("?")
    data = request.get_data() if request.method not in ("GET", "HEAD") else None
    r = parts()["upstream"].request(request.method, path, query=query,
                                    headers=forward_headers(request.headers),
                                    data=data or None, environ=request.environ)
    return relay(r)


for _i, _rule in enumerate(ADMIN_ROUTES):
    bp.add_url_rule(_rule, f"admin{_i}", passthrough, methods=ALL_METHODS)
