"""The proxy's routes: module-level views of one blueprint. The parts they use
(settings, upstream, catalog, searx, metrics, executor) are the app's, in
`current_app.extensions["proxy"]` (create_app puts them there)."""
from __future__ import annotations

from flask import Blueprint, current_app, request

from common import guard
from common.failures import reason
from common.streaming import forward_headers, iter_upstream, relay

from . import dialects
from .activity import RECORD, noting_waits

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


@bp.route("/", methods=["GET", "HEAD"])
def root():
    """The base URL itself: Claude Code sends `HEAD <ANTHROPIC_BASE_URL>` when it
    starts (a reachability check); a 404 there reads as a broken endpoint."""
    return {"status": "ok", "service": "proxy",
            "endpoints": ["/v1/chat/completions", "/v1/messages", "/v1/responses",
                          "/v1/models"]}


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

@bp.route("/v1/<rest:rest>", methods=ALL_METHODS)
def passthrough(rest=None):
    target = guard.raw_target(request.environ)
    if target.startswith(dialects.MESSAGES_PATHS[1]):      # anthropic SDK, base_url=.../v1
        target = target[3:]
    path, _, query = target.partition("?")
    data = request.get_data() if request.method not in ("GET", "HEAD") else None
    r = parts()["upstream"].request(request.method, path, query=query,
                                    headers=forward_headers(request.headers),
                                    data=data or None, environ=request.environ)
    if request.environ.get(RECORD) is not None and \
            r.headers.get("content-type", "").startswith("text/event-stream"):
        # A listed request's stream (/v1/completions): its queue wait noted.
        return relay(r, body=noting_waits(iter_upstream(r), request.environ))
    return relay(r)


for _i, _rule in enumerate(ADMIN_ROUTES):
    bp.add_url_rule(_rule, f"admin{_i}", passthrough, methods=ALL_METHODS)
