"""The swapper's HTTP API: routes only. State lives in the scheduler; Docker
effects in the runtime (performed by the driver)."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from flask import Flask, Response, jsonify, request, stream_with_context

from common.errors import ApiError, install_error_handlers
from common.streaming import NO_BUFFERING

from .driver import Driver
from .events import EventHub
from .fanout import FANOUT_PATHS, FanOut, requested_n, serves_natively
from .forward import Forwarder
from .lease import Admission
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
        if name is None and request.is_json:
            name = (request.get_json(silent=True) or {}).get("model")
        spec = resolve(name)
        t0 = time.monotonic()
        sw.admission.admit(spec.id, request.environ).finish(200)
        return jsonify({"loaded": spec.id, "running": sw.scheduler.model,
                        "seconds": round(time.monotonic() - t0, 3)})

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
    @app.route("/upstream/<name>/", defaults={"path": ""},
               methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    @app.route("/upstream/<name>/<path:path>",
               methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    def upstream(name: str, path: str):
        spec = resolve(name)
        return pass_through(spec, path, request.get_data(cache=False))

    @app.route("/v1/<path:path>", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def v1(path: str):
        body = request.get_data(cache=False)
        name = None
        stream = False
        if body and request.mimetype in ("application/json", "") and body.lstrip()[:1] == b"{":
            try:
                payload = json.loads(body)
            except ValueError as e:
                raise ApiError(f"request body is not valid JSON: {e}", 400) from None
            name = payload.get("model")
            stream = payload.get("stream") is True
            if name is not None and not isinstance(name, str):
                raise ApiError("'model' must be a string", 400)
            spec = resolve(name)
            n = requested_n(payload, settings.max_n) if f"v1/{path}" in FANOUT_PATHS else 1
            if name != spec.id:
                # Backends know the model by its id (vLLM: --served-model-name).
                payload["model"] = spec.id
                body = json.dumps(payload).encode()
            if n > 1 and not serves_natively(spec, n):
                return sw.fanout.run(spec, f"v1/{path}", request.query_string.decode(),
                                     request.headers, payload, n, request.environ)
        else:
            spec = resolve(None)
        return pass_through(spec, f"v1/{path}", body, stream)

    def pass_through(spec: ModelSpec, path: str, body: bytes, stream: bool = False):
        return sw.forwarder.forward(spec.id, request.method, path,
                                    request.query_string.decode(), request.headers, body or None,
                                    request.environ, stream)

    return app
