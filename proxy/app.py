"""The proxy's Flask app: routes only. create_app(settings) is the factory."""
from __future__ import annotations

import concurrent.futures as cf
import hmac
import json
import logging
import time

from flask import Flask, Response, g, request
from werkzeug.exceptions import RequestEntityTooLarge

from common.errors import ApiError, error_response, install_error_handlers
from common.guard import harden
from common.streaming import forward_headers, iter_upstream, relay

from . import normalize
from .metrics import Metrics
from .search import loop
from .search.searxng import SearxngClient
from .settings import Settings
from .upstream import ModelCatalog, Upstream, _reason

ADMIN_ROUTES = ("/load", "/load/<path:model>", "/unload", "/running",
                "/upstream/<path:rest>", "/logs", "/logs/<path:rest>")
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
_V1_ROUTES = {"chat", "completions", "embeddings", "models", "responses", "messages"}


def route_label(path: str) -> str:
    """Bounded metric label for a path."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        if len(parts) > 1 and parts[1] in _V1_ROUTES:
            return "/v1/" + ("chat/completions" if parts[1] == "chat" else parts[1])
        return "/v1/other"
    if parts[0] in ("load", "unload", "running", "upstream", "logs", "healthz", "metrics"):
        return "/" + parts[0]
    return "other"


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.LOG_LEVEL.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__)
    harden(app, settings.MAX_BODY_BYTES)
    app.config["MAX_CONTENT_LENGTH"] = settings.MAX_BODY_BYTES
    install_error_handlers(app)

    upstream = Upstream(settings.BACKEND_URL, settings.CONNECT_TIMEOUT)
    catalog = ModelCatalog(upstream, settings.MODELS_TTL)
    searx = SearxngClient(settings.SEARXNG_URL, settings.SEARXNG_RESULTS,
                          settings.SEARXNG_TIMEOUT)
    metrics = Metrics()
    executor = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="search")
    app.extensions["proxy"] = dict(settings=settings, upstream=upstream, metrics=metrics,
                                   catalog=catalog, searx=searx, executor=executor)

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(e):
        return error_response(f"request body too large: the limit is "
                              f"{settings.MAX_BODY_BYTES} bytes (MAX_BODY_BYTES)", 413,
                              code="body_too_large")

    # ------------------------------------------------------------ cross-cutting

    @app.before_request
    def _before():
        g.t0 = time.perf_counter()
        if settings.API_KEY and request.path != "/healthz":
            auth = request.headers.get("Authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else \
                request.headers.get("x-api-key", "")
            if not token or not hmac.compare_digest(token.encode(), settings.API_KEY.encode()):
                return error_response("missing or wrong API key: send "
                                      "'Authorization: Bearer <API_KEY>'", 401,
                                      code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})

    @app.after_request
    def _after(resp: Response):
        route = route_label(request.path)
        metrics.request(route, request.method, resp.status_code)
        t0 = g.get("t0")
        if t0 is None:
            return resp
        if resp.is_streamed:
            resp.response = _observe_first_byte(resp.response, metrics, route, t0)
        else:
            metrics.first_byte(route, time.perf_counter() - t0)
        return resp

    # ------------------------------------------------------------ own routes

    @app.get("/healthz")
    def healthz():
        up = {"url": settings.BACKEND_URL}
        try:
            r = upstream.session.get(settings.BACKEND_URL + "/healthz",
                                     timeout=(1.0, 1.5))
            up["http_status"] = r.status_code
            up["status"] = "ok" if r.status_code == 200 else "unhealthy"
            try:
                up["body"] = r.json()
            except ValueError:
                up["body"] = r.text[:500]
        except Exception as e:  # noqa: BLE001
            up["status"] = "unreachable"
            up["error"] = _reason(e)
        return {"status": "ok", "service": "proxy", "upstream": up}

    @app.get("/metrics")
    def metrics_route():
        return Response(metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    def chat():
        raw = request.get_data()
        body = normalize.parse_chat_body(raw)
        if isinstance(body.get("n"), int) and body["n"] > settings.MAX_N:
            raise ApiError(f"'n' is {body['n']}; this server allows at most {settings.MAX_N} "
                           "(MAX_N)", 400, code="invalid_request", param="n")
        changed = False
        if settings.DEFAULT_MODEL and not body.get("model"):
            body["model"] = settings.DEFAULT_MODEL
            changed = True
        model = body.get("model")
        first_role = body["messages"][0].get("role")
        if settings.INJECT_SYSTEM and first_role not in ("system", "developer"):
            text = catalog.lookup(model).get("system_prompt") or settings.SYSTEM_PROMPT
            changed |= normalize.inject_system_prompt(body, text)
        if body.get("tools") and (body.get("max_tokens") or body.get("max_completion_tokens")):
            floor = catalog.lookup(model).get("max_tokens_floor") or \
                settings.TOOL_MAX_TOKENS_FLOOR
            changed |= normalize.apply_token_floor(body, floor)
        stream = bool(body.get("stream"))

        if loop.should_inject(body, settings):
            loop.inject_tool(body)
            s = loop.SearchSession(body, settings=settings, upstream=upstream, searx=searx,
                                   metrics=metrics, executor=executor, headers=request.headers)
            if not stream:
                return loop.run_nonstream(s)
            first = s.call_model(stream=True)
            if first.status_code != 200:
                return relay(first)          # the upstream's error, untouched
            return loop.stream_response(s, first)

        data = json.dumps(body, ensure_ascii=False).encode() if changed else raw
        r = upstream.request("POST", "/v1/chat/completions", headers=forward_headers(
            request.headers), data=data, stream=True, environ=request.environ,
            read_body=not stream)
        if stream:
            return relay(r, body=normalize.normalize_sse(iter_upstream(r)))
        content = normalize.normalize_completion_bytes(r.content)
        r.close()
        return Response(content, status=r.status_code, headers=forward_headers(r.headers))

    # ------------------------------------------------------------ pass-through

    def passthrough(**_):
        env = request.environ
        target = env.get("RAW_URI") or env.get("REQUEST_URI") or ""
        if not target.startswith("/"):           # absent, or absolute-form request target
            target = request.full_path
        path, _, query = target.partition("?")
        data = request.get_data() if request.method not in ("GET", "HEAD") else None
        r = upstream.request(request.method, path, query=query,
                             headers=forward_headers(request.headers), data=data or None,
                             environ=request.environ)
        return relay(r)

    app.add_url_rule("/v1/<path:rest>", "v1", passthrough, methods=ALL_METHODS)
    for i, rule in enumerate(ADMIN_ROUTES):
        app.add_url_rule(rule, f"admin{i}", passthrough, methods=ALL_METHODS)

    return app


def _observe_first_byte(inner, metrics: Metrics, route: str, t0: float):
    first = True
    try:
        for chunk in inner:
            if first and chunk:
                metrics.first_byte(route, time.perf_counter() - t0)
                first = False
            yield chunk
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()
