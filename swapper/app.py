"""The swapper's HTTP API: routes only. State lives in the scheduler; Docker
effects in the runtime (performed by the driver)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from flask import Flask, Response, jsonify, request, stream_with_context

from common.errors import ApiError, install_error_handlers
from common import guard
from common.guard import harden
from common.hotpath import install
from common.streaming import NO_BUFFERING

from .driver import Driver
from . import intake
from .events import EventHub
from .fanout import FANOUT_PATHS, FanOut, requested_n, serves_natively
from .forward import Forwarder
from .lease import Admission, Lease
from .metrics import SwapperMetrics
from .registry import ModelSpec, Registry
from .runtime import DockerRuntime, Runtime
from .scheduler import Scheduler
from .settings import Settings

log = logging.getLogger("swapper")


@dataclass
class Parts:
    """The parts of one swapper process, wired together."""
    settings: Settings
    registry: Registry
    scheduler: Scheduler
    runtime: Runtime
    driver: Driver
    admission: Admission
    forwarder: Forwarder
    fanout: FanOut
    metrics: SwapperMetrics
    events: EventHub


def build(settings: Settings, runtime: Runtime | None = None) -> Parts:
    registry = Registry.load(settings.backends_dir, settings.env, settings.default_model)
    scheduler = Scheduler(lambda m: registry.models[m].slots, max_queue=settings.max_queue,
                          backoff_base=settings.backoff_base, backoff_max=settings.backoff_max)
    runtime = runtime or DockerRuntime(settings, registry)
    metrics = SwapperMetrics(scheduler.snapshot)
    events = EventHub()
    scheduler.subscribe(events.publish)
    driver = Driver(scheduler, runtime, registry, settings, metrics)
    admission = Admission(scheduler, driver, metrics)
    forwarder = Forwarder(admission, settings)
    return Parts(settings, registry, scheduler, runtime, driver, admission, forwarder,
                 FanOut(forwarder), metrics, events)


def create_app(settings: Settings | None = None, runtime: Runtime | None = None) -> Flask:
    settings = settings or Settings.from_env()
    sw = build(settings, runtime)
    sw.driver.start()

    app = Flask("swapper")
    app.extensions["swapper"] = sw          # the parts, for tests and debugging
    harden(app)
    install_error_handlers(app)

    def resolve(name: str | None) -> ModelSpec:
        spec = sw.registry.resolve(name)
        if spec is None:
            known = ", ".join(f"{m.id}" + (f" ({', '.join(m.aliases)})" if m.aliases else "")
                              for m in sw.registry)
            raise ApiError(f"model '{name}' is not registered; known models: {known}", 404,
                           code="model_not_found")
        return spec

    def refuse_head(what: str) -> None:
        """A HEAD must not act (Flask answers HEAD on every GET route)."""
        if request.method == "HEAD":
            raise ApiError(f"{request.path} {what}: use POST (HEAD changes nothing)", 405,
                           headers={"Allow": "GET, POST"})

    # ------------------------------------------------------------- status
    @app.get("/healthz")
    def healthz():
        snap = sw.scheduler.snapshot()
        docker_ok = sw.runtime.ping()
        body = {"status": "ok" if docker_ok else "degraded", "docker": docker_ok,
                "model": snap["model"], "state": snap["state"],
                "queued": snap["queued"], "in_flight": snap["in_flight"]}
        if not docker_ok:
            body["message"] = "the Docker engine is unreachable (is /var/run/docker.sock mounted?)"
        return jsonify(body), 200 if docker_ok else 503

    @app.get("/running")
    def running():
        snap = sw.scheduler.snapshot()
        backend = snap.pop("backend")
        spec = sw.registry.models.get(snap["model"]) if snap["model"] else None
        snap["since_seconds"] = round(time.monotonic() - snap.pop("since"), 3)
        snap["backend"] = {"container": backend.name, "url": backend.url} if backend else None
        snap["slots"] = spec.slots if spec else None
        snap["last_load_seconds"] = sw.driver.last_load_seconds
        snap["published"] = f"{settings.publish_bind}:{settings.publish_port}"
        return jsonify(snap)

    @app.get("/metrics")
    def metrics():
        return sw.metrics.response()

    def described(spec: ModelSpec) -> dict:
        return {**spec.public(), "status": sw.scheduler.model_status(spec.id)}

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list", "data": [described(m) for m in sw.registry]})

    @app.get("/v1/models/<path:name>")
    def model(name: str):
        return jsonify(described(resolve(name)))

    @app.get("/events")
    def events():
        snap = sw.scheduler.snapshot()
        state = {"model": snap["model"], "state": snap["state"],
                 "models": {m.id: sw.scheduler.model_status(m.id) for m in sw.registry}}
        return Response(sw.events.stream(state, settings.keepalive_interval),
                        mimetype="text/event-stream", headers=NO_BUFFERING)

    # ------------------------------------------- llama.cpp router-compatible API
    @app.get("/models")
    def router_models():
        return jsonify({"object": "list", "data": [described(m) for m in sw.registry]})

    def router_model() -> ModelSpec:
        payload = request.get_json(force=True, silent=True)
        name = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError('send {"model": "<id or alias>"}', 400, param="model")
        return resolve(name)

    @app.post("/models/load")
    def router_load():
        spec = router_model()
        sw.admission.admit(spec.id, request.environ).finish(200)
        return jsonify({"success": True, "model": spec.id})

    @app.post("/models/unload")
    def router_unload():
        spec = router_model()
        if sw.scheduler.model == spec.id:
            sw.admission.unload(request.environ)
        return jsonify({"success": True, "model": spec.id})

    # ----------------------------------------------------------- load/unload
    @app.route("/load", methods=["GET", "POST"])
    @app.route("/load/<path:name>", methods=["GET", "POST"])
    def load(name: str | None = None):
        refuse_head("loads a model")
        spec = resolve(intake.load_target(name, request.get_data(cache=False)))
        t0 = time.monotonic()
        lease = sw.admission.admit(spec.id, request.environ)
        try:
            seconds = round(time.monotonic() - t0, 3)
            upstream_status = _health_status(sw, lease, spec)
        finally:
            lease.finish(200)
        running = sw.scheduler.model
        return jsonify({"loaded": spec.id, "running": [running] if running else [],
                        "seconds": seconds, "upstream_status": upstream_status})

    @app.route("/unload", methods=["GET", "POST"])
    def unload():
        refuse_head("unloads the model")
        previous = sw.scheduler.model
        sw.admission.unload(request.environ)
        return jsonify({"unloaded": True, "previous": previous})

    # ------------------------------------------------------------------ logs
    @app.get("/logs")
    @app.get("/logs/<path:name>")
    def logs(name: str | None = None):
        spec = resolve(name or sw.scheduler.model or None)
        tail = request.args.get("tail", type=int) or 200
        return Response(sw.runtime.logs(spec.id, tail), mimetype="text/plain")

    @app.get("/logs/<path:name>/stream")
    def logs_stream(name: str):
        spec = resolve(name)
        tail = request.args.get("tail", type=int) or 100
        return Response(stream_with_context(sw.runtime.follow_logs(spec.id, tail)),
                        mimetype="text/plain", headers={"X-Accel-Buffering": "no",
                                                        "Cache-Control": "no-cache"})

    # -------------------------------------------------------------- traffic
    @app.route("/upstream/<name>", defaults={"path": ""},
               methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    @app.route("/upstream/<name>/<path:path>",
               methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    def upstream(name: str, path: str):
        spec = resolve(name)
        return pass_through(spec, path, request.get_data(cache=False))

    @app.route("/v1/<path:path>", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                           "OPTIONS"])
    def v1(path: str):
        return v1_answer(request._get_current_object(), path)

    def hot_v1(req):                  # POST /v1/...: common.hotpath, around Flask
        return v1_answer(req, req.environ["PATH_INFO"][4:])

    install(app, lambda path: hot_v1 if path.startswith("/v1/") else None)

    def v1_answer(req, path: str):
        """A /v1/<path> request answered: by the backend (or n of its answers)."""
        method = req.method
        if method == "OPTIONS":
            allowed = intake.allowed_methods(path)
            if allowed is None:
                intake.route_of(path, "OPTIONS")        # raises the 404
            return Response(status=204, headers={"Allow": ", ".join(allowed)})
        body = req.get_data(cache=False)
        parsed = intake.parse_v1(path, method, body)
        spec = resolve(intake.target_model(parsed, method, path, sw.scheduler.model))
        intake.require_vision(spec.id, spec.vision, parsed.route, parsed.payload)
        payload = parsed.payload
        stream = payload is not None and payload.get("stream") is True
        if payload is not None:
            n = requested_n(payload, settings.max_n) if f"v1/{path}" in FANOUT_PATHS else 1
            if payload.get("model") != spec.id:
                # Backends know the model by its id (vLLM: --served-model-name).
                payload["model"] = spec.id
                body = guard.dumps(payload)
            if n > 1 and not serves_natively(spec, n):
                return sw.fanout.run(spec, f"v1/{path}", req.query_string.decode(),
                                     req.headers, payload, n, req.environ)
        headers = req.headers
        if payload is not None and req.mimetype != "application/json":
            # A JSON body sent as a form (curl -d): tell the backend what it is.
            headers = {**dict(headers), "Content-Type": "application/json"}
        return pass_through(spec, f"v1/{path}", body, headers, stream, req)

    def pass_through(spec: ModelSpec, path: str, body: bytes, headers=None,
                     stream: bool = False, req=None):
        if req is None:
            req = request._get_current_object()
        return sw.forwarder.forward(spec.id, req.method, path, req.query_string.decode(),
                                    req.headers if headers is None else headers,
                                    body or None, req.environ, stream)

    return app


def _health_status(sw: Parts, lease: Lease, spec: ModelSpec) -> int | None:
    """The HTTP status of the loaded backend's health path (None: no answer)."""
    try:
        r = sw.forwarder.client.request("GET", sw.forwarder.url(lease, spec.health_path, ""),
                                        timeout=(sw.settings.connect_timeout, 10))
        r.close()
        return r.status_code
    except Exception:  # noqa: BLE001 - reported as null, the load itself succeeded
        return None
