"""The swapper's HTTP API: module-level views in three blueprints. State lives in
the scheduler; Docker effects in the runtime (performed by the driver); the
parts of the process are `current_app.extensions["swapper"]` (swapper.app).

- status: what the swapper is doing (/healthz, /running, /metrics, /v1/models,
  /events, the llama.cpp router's /models);
- control: loads, unloads and logs;
- traffic: requests for a model's backend (/v1/..., /upstream/<model>/...),
  forwarded with the request target as the client sent it (still
  percent-encoded): nothing decoded is written into a request line.
"""
from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context

from common import guard
from common.errors import ApiError
from common.scope import matches as in_scope
from common.streaming import NO_BUFFERING

from . import intake
from . import progress as prefill
from .fanout import FANOUT_PATHS, requested_n, serves_natively
from .conversations import Conversation, conversation_of
from .lease import OPERATOR, SESSION, Lease
from .registry import ModelSpec
from .runtime import auth_headers
from .sessions import session_of
from .tenants import scope_of

status = Blueprint("status", __name__)
control = Blueprint("control", __name__)
traffic = Blueprint("traffic", __name__)

TRAFFIC_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def parts():
    """The swapper's parts (swapper.app.Parts)."""
    return current_app.extensions["swapper"]


def resolve(name: str | None, scope: tuple[str, ...] | None = None, **resident) -> ModelSpec:
    """The registry model named (id or alias; None: the default), else a 404
    naming the known ones. With `resident=` (a request's `model`), names that
    the registry's model_patterns map (agents' tier names) resolve too, within
    the key's `scope` (swapper/tenants.scope_of; None: every model); a model
    outside it is a 403, and the 404 names only the models inside it."""
    sw = parts()
    allowed = None if scope is None else \
        (lambda spec: in_scope(scope, (spec.id, *spec.aliases)))
    spec = sw.registry.resolve(name, allowed=allowed, **resident)
    if spec is None:
        known = ", ".join(f"{m.id}" + (f" ({', '.join(m.aliases)})" if m.aliases else "")
                          for m in sw.registry if allowed is None or allowed(m))
        raise ApiError(f"model '{name}' is not registered; known models: {known}", 404,
                       code="model_not_found")
    if allowed is not None and not allowed(spec):
        what = f"model '{name}' ({spec.id})" if name and name != spec.id else f"model '{spec.id}'"
        raise ApiError(f"this key may not use {what}: it may use {', '.join(scope)}", 403,
                       code="model_not_allowed")
    return spec


def refuse_read(what: str, instead: str) -> None:
    """A state change acts on POST only: a GET or HEAD (a link, an <img>, a
    prefetch: anything a web page can make a browser send) changes nothing."""
    if request.method in ("GET", "HEAD"):
        raise ApiError(f"{request.method} {request.path} changes nothing: POST {what} "
                       f"({instead})", 405, code="method_not_allowed",
                       headers={"Allow": "POST"})


def described(spec: ModelSpec) -> dict:
    return {**spec.public(), "status": parts().scheduler.model_status(spec.id)}


# ------------------------------------------------------------------ status
@status.get("/healthz")
def healthz():
    sw = parts()
    snap = sw.scheduler.snapshot()
    docker_ok = sw.runtime.ping()
    body = {"status": "ok" if docker_ok else "degraded", "docker": docker_ok,
            "model": snap["model"], "state": snap["state"],
            "queued": snap["queued"], "in_flight": snap["in_flight"]}
    if not docker_ok:
        body["message"] = "the Docker engine is unreachable (is /var/run/docker.sock mounted?)"
    return jsonify(body), 200 if docker_ok else 503


@status.get("/running")
def running():
    sw = parts()
    snap = sw.scheduler.snapshot()
    backend = snap.pop("backend")
    spec = sw.registry.models.get(snap["model"]) if snap["model"] else None
    snap["since_seconds"] = round(time.monotonic() - snap.pop("since"), 3)
    snap["backend"] = {"container": backend.name, "url": backend.url} if backend else None
    snap["slots"] = spec.slots if spec else None
    snap["last_load_seconds"] = sw.driver.last_load_seconds
    # what the last swap cost by phase, and the serving share (swapper/swaps.py)
    snap["swaps"] = sw.driver.ledger.status()
    snap["kv_cache"] = sw.driver.kv.kept()          # None: KV_CACHE_DIR unset
    snap["published"] = f"{sw.settings.BACKEND_BIND}:{sw.settings.BACKEND_PUBLISH_PORT}"
    return jsonify(snap)


@status.get("/metrics")
def metrics():
    return parts().metrics.response()


@status.get("/v1/models")
@status.get("/models")                   # the llama.cpp router's
def models():
    return jsonify({"object": "list", "data": [described(m) for m in parts().registry]})


@status.get("/v1/models/<path:name>")
def model(name: str):
    return jsonify(described(resolve(name)))


@status.get("/events")
def events():
    sw = parts()
    snap = sw.scheduler.snapshot()
    state = {"model": snap["model"], "state": snap["state"],
             "models": {m.id: sw.scheduler.model_status(m.id) for m in sw.registry}}
    return Response(sw.events.stream(state, sw.settings.KEEPALIVE_INTERVAL),
                    mimetype="text/event-stream", headers=NO_BUFFERING)


# ----------------------------------------------------------------- control
def router_model() -> ModelSpec:
    """The model of a llama.cpp router request: {"model": "<id or alias>"}."""
    payload = request.get_json(force=True, silent=True)
    name = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError('send {"model": "<id or alias>"}', 400, param="model")
    return resolve(name)


@control.post("/models/load")
def router_load():
    spec = router_model()
    request.environ[OPERATOR] = True
    parts().admission.admit(spec.id, request.environ).finish(200)
    return jsonify({"success": True, "model": spec.id})


@control.post("/models/unload")
def router_unload():
    spec = router_model()
    sw = parts()
    if sw.scheduler.model == spec.id:
        sw.admission.unload(request.environ)
    return jsonify({"success": True, "model": spec.id})


@control.route("/load", methods=["GET", "POST"])
@control.route("/load/<path:name>", methods=["GET", "POST"])
def load(name: str | None = None):
    refuse_read("/load/<model> loads a model", "GET /running shows what is loaded")
    sw = parts()
    spec = resolve(intake.load_target(name, request.get_data(cache=False)))
    t0 = time.monotonic()
    request.environ[OPERATOR] = True        # the operator's decision: no hold delays it
    lease = sw.admission.admit(spec.id, request.environ)
    seconds = round(time.monotonic() - t0, 3)
    upstream_status = _health_status(lease, spec)
    lease.finish(200)
    running_now = sw.scheduler.model
    return jsonify({"loaded": spec.id, "running": [running_now] if running_now else [],
                    "seconds": seconds, "upstream_status": upstream_status})


@control.route("/unload", methods=["GET", "POST"])
def unload():
    refuse_read("/unload unloads the model", "GET /running shows what is loaded")
    sw = parts()
    previous = sw.scheduler.model
    sw.admission.unload(request.environ)
    return jsonify({"unloaded": True, "previous": previous})


@control.get("/logs")
@control.get("/logs/<path:name>")
def logs(name: str | None = None):
    sw = parts()
    spec = resolve(name or sw.scheduler.model or None)
    tail = request.args.get("tail", type=int) or 200
    return Response(sw.runtime.logs(spec.id, tail), mimetype="text/plain")


@control.get("/logs/<path:name>/stream")
def logs_stream(name: str):
    spec = resolve(name)
    tail = request.args.get("tail", type=int) or 100
    return Response(stream_with_context(parts().runtime.follow_logs(spec.id, tail)),
                    mimetype="text/plain", headers=NO_BUFFERING)


def _health_status(lease: Lease, spec: ModelSpec) -> int | None:
    """The HTTP status of the loaded backend's health path (None: no answer)."""
    fw = parts().forwarder
    try:
        r = fw.client.request("GET", fw.url(lease, spec.health_path, ""),
                              headers=auth_headers(lease.backend),
                              timeout=(fw.settings.CONNECT_TIMEOUT, 10))
        r.close()
        return r.status_code
    except Exception:  # noqa: BLE001 - reported as null, the load itself succeeded
        return None


# ----------------------------------------------------------------- traffic
@traffic.route("/upstream/<name>", defaults={"path": ""}, methods=TRAFFIC_METHODS)
@traffic.route("/upstream/<name>/<rest:path>", methods=TRAFFIC_METHODS)
def upstream(name: str, path: str):
    """A read-only path of a model's backend, as sent: /upstream/<model>/<target>
    (intake.UPSTREAM_ROUTES; anything else is refused before it is admitted)."""
    spec = resolve(name)
    tail, query = guard.raw_tail(request.environ, 2)
    if request.method == "OPTIONS" and (allowed := intake.upstream_methods(tail)):
        return Response(status=204, headers={"Allow": ", ".join(allowed)})
    intake.check_upstream(tail, request.method)
    return _pass_through(spec, tail, query, request.get_data(cache=False))


@traffic.route("/v1/<rest:path>", methods=TRAFFIC_METHODS)
def v1(path: str):
    """A /v1/<path> request answered: by the backend (or n of its answers)."""
    sw = parts()
    method = request.method
    if method == "OPTIONS":
        allowed = intake.allowed_methods(path)
        if allowed is None:
            intake.route_of(path, "OPTIONS")        # raises the 404
        return Response(status=204, headers={"Allow": ", ".join(allowed)})
    body = request.get_data(cache=False)
    parsed = intake.parse_v1(path, method, body)
    resident = sw.scheduler.model
    name = intake.target_model(parsed, method, path, resident)
    spec = resolve(name, scope_of(request.environ), resident=resident)
    if name is not None and name != spec.id and (p := sw.registry.mapping(name)):
        sw.metrics.mapped(p.match, spec.id)
    intake.require_vision(spec.id, spec.vision, parsed.route, parsed.payload)
    payload = parsed.payload
    request.environ[SESSION] = session_of(request.headers, payload, request.remote_addr)
    tail, query = guard.raw_tail(request.environ, 1)
    target = "v1/" + tail
    stream = payload is not None and payload.get("stream") is True
    headers = request.headers
    progress = False
    if payload is not None:
        n = requested_n(payload, sw.settings.MAX_N) if f"v1/{path}" in FANOUT_PATHS else 1
        changed = payload.get("model") != spec.id
        if changed:
            # Backends know the model by its id (vLLM: --served-model-name).
            payload["model"] = spec.id
        if n > 1 and not serves_natively(spec, n):
            return sw.fanout.run(spec, target, query, headers, payload, n,
                                 request.environ)
        # llama-server's prompt progress, made comments (swapper/progress.py).
        progress = sw.settings.PREFILL_PROGRESS and prefill.ask(spec.kind, target, payload,
                                                                stream)
        if changed or progress:
            body = guard.dumps(payload)
        if request.mimetype != "application/json":
            # A JSON body sent as a form (curl -d): tell the backend what it is.
            headers = {**dict(headers), "Content-Type": "application/json"}
    # Which conversation it is, for the prompt caches across swaps (swapper/kvcache.py).
    conversation = conversation_of(parsed.route, target, payload, body) \
        if sw.driver.kv.enabled(spec) else None
    return _pass_through(spec, target, query, body, headers, stream, progress, conversation)


def _pass_through(spec: ModelSpec, target: str, query: str, body: bytes, headers=None,
                  stream: bool = False, progress: bool = False,
                  conversation: Conversation | None = None):
    return parts().forwarder.forward(spec.id, request.method, target, query,
                                     request.headers if headers is None else headers,
                                     body or None, request.environ, stream, progress,
                                     conversation)
