"""The proxy's routes: module-level views of one blueprint. The parts they use
(settings, upstream, catalog, searx, metrics, executor) are the app's, in
`current_app.extensions["proxy"]` (create_app puts them there)."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, g, jsonify, request

from common import guard
from common.errors import ApiError
from common.failures import reason
from common.streaming import forward_headers, iter_upstream, relay

from . import dialects
from .record import noting_waits
from .keys import policy
from .keys.auth import check_model, identity

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
            "endpoints": [d.wire.path for d in dialects.ALL] + ["/v1/models"]}


@bp.get("/metrics")
def metrics():
    key = identity(request.environ)
    return parts()["metrics"].response(None if key is None or key.admin else key.name)


# ------------------------------------------------------------ the dialects

def _serving(d: dialects.Dialect):
    def view():
        return dialects.handle(d, parts(), request, g.record)
    return view


# Each dialect's routes (Anthropic's /v1/v1/messages too: common/dialects.py).
for _d in dialects.ALL:
    _view = _serving(_d)
    for _path in _d.paths:
        bp.add_url_rule(_path, _d.name, _view, methods=["POST"])


# ------------------------------------------------------------ pass-through

@bp.route("/v1/<rest:rest>", methods=ALL_METHODS)
def passthrough(rest=None):
    target = _unaliased(guard.raw_target(request.environ))
    path, _, query = target.partition("?")
    data = request.get_data() if request.method not in ("GET", "HEAD") else None
    rec = g.record
    key = identity(request.environ)
    if data and key is not None and request.path.startswith("/v1/"):
        rec.model = _model_of(data)             # the key's usage row names it
        check_model(request.environ, rec.model, parts()["catalog"])
    r = parts()["upstream"].request(request.method, path, query=query,
                                    headers=forward_headers(request.headers),
                                    data=data or None, environ=request.environ)
    rec.note_header(r.headers)
    if key is not None and "*" not in key.models and request.method == "GET" \
            and path == "/v1/models" and r.status_code == 200:
        return _in_scope(r, key)
    if rec.dialect is not None and \
            r.headers.get("content-type", "").startswith("text/event-stream"):
        # A listed request's stream (/v1/completions): its queue wait noted.
        return relay(r, body=noting_waits(iter_upstream(r), rec))
    return relay(r)


def _in_scope(r, key) -> Response:
    """The upstream's model list with only the models `key` may use (an entry
    passes when its id or one of its aliases matches the key's list)."""
    try:
        body = guard.answer_json(r.content)
    except ValueError:
        body = None
    finally:
        r.close()
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ApiError("the model list could not be read", 502, code="bad_upstream")
    body["data"] = [m for m in body["data"] if isinstance(m, dict) and isinstance(
        m.get("id"), str) and policy.may_use(key.models, m["id"], [
            a for a in m.get("aliases") or () if isinstance(a, str)])]
    return jsonify(body)


def _model_of(data: bytes) -> str | None:
    """The `model` a forwarded JSON body names (None: none, or not JSON)."""
    try:
        body = guard.loads(data)
    except ApiError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _unaliased(target: str) -> str:
    """A path under a dialect's alias (/v1/v1/messages/count_tokens: the anthropic
    SDK with base_url=.../v1) under its route instead."""
    for d in dialects.ALL:
        for alias in d.paths[1:]:
            if target.startswith(alias):
                return d.wire.path + target[len(alias):]
    return target


for _i, _rule in enumerate(ADMIN_ROUTES):
    bp.add_url_rule(_rule, f"admin{_i}", passthrough, methods=ALL_METHODS)
