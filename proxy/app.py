"""The proxy's Flask app: routes only. create_app(settings) is the factory."""
from __future__ import annotations

import concurrent.futures as cf
import hmac
import logging
import time

from flask import Flask, Response, request

from common.errors import error_response, install_error_handlers
from common.failures import reason
from common import guard
from common.guard import harden
from common.hotpath import install
from common.streaming import forward_headers, relay, sse_response

from . import dialects, normalize
from .metrics import MODEL, NOT_READ, T0, Metrics
from .search import loop
from .search.searxng import SearxngClient
from .settings import Settings
from .upstream import ModelCatalog, Upstream, streamed

ADMIN_ROUTES = ("/load", "/load/<path:model>", "/unload", "/running",
                "/upstream/<path:rest>", "/logs", "/logs/<path:rest>", "/events",
                "/models", "/models/<path:rest>")
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.LOG_LEVEL.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.MAX_BODY_BYTES    # the guard's and Flask's
    harden(app)
    install_error_handlers(app)

    upstream = Upstream(settings.BACKEND_URL, settings.CONNECT_TIMEOUT,
                        api_key=settings.API_KEY)
    catalog = ModelCatalog(upstream, settings.MODELS_TTL)
    searx = SearxngClient(settings.SEARXNG_URL, settings.SEARXNG_RESULTS,
                          settings.SEARXNG_TIMEOUT)
    metrics = Metrics(resolve=lambda name: catalog.lookup(name).get("id"))
    executor = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="search")
    app.extensions["proxy"] = dict(settings=settings, upstream=upstream, metrics=metrics,
                                   catalog=catalog, searx=searx, executor=executor)

    # ------------------------------------------------------------ cross-cutting

    # Around every request, Flask's routes and the hot ones (common.hotpath) alike.
    def before(req):
        req.environ[T0] = time.perf_counter()
        if settings.API_KEY and req.path != "/healthz":
            headers = req.headers
            auth = headers.get("Authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else \
                headers.get("x-api-key", "")
            if not token or not hmac.compare_digest(token.encode(), settings.API_KEY.encode()):
                return error_response("missing or wrong API key: send "
                                      "'Authorization: Bearer <API_KEY>'", 401,
                                      code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
        return None

    def after(resp: Response, req) -> Response:
        resp = dialects.anthropic_errors(resp, req.path)
        env = req.environ
        return metrics.observe(resp, req, env.get(T0), env.get(MODEL, NOT_READ))

    app.before_request(lambda: before(request._get_current_object()))
    app.after_request(lambda resp: after(resp, request._get_current_object()))

    # ------------------------------------------------------------ own routes

    @app.get("/healthz")
    def healthz():
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

    @app.get("/metrics")
    def metrics_route():
        return metrics.response()

    def chat(req):
        raw = req.get_data()
        body = normalize.parse_chat_body(raw)
        changed = False
        model = req.environ[MODEL] = body.get("model")
        first_role = body["messages"][0].get("role")
        if settings.INJECT_SYSTEM and first_role not in ("system", "developer"):
            text = catalog.lookup(model).get("system_prompt") or settings.SYSTEM_PROMPT
            changed |= normalize.inject_system_prompt(body, text)
        search = loop.should_inject(body, settings)
        if search:
            loop.inject_tool(body)          # before the floor: web_search is a tool too
        if body.get("tools") and (body.get("max_tokens") or body.get("max_completion_tokens")):
            floor = catalog.lookup(model).get("max_tokens_floor") or \
                settings.TOOL_MAX_TOKENS_FLOOR
            changed |= normalize.apply_token_floor(body, floor)
        stream = bool(body.get("stream"))

        if search:
            s = loop.SearchSession(body, settings=settings, upstream=upstream, searx=searx,
                                   metrics=metrics, executor=executor, headers=req.headers,
                                   environ=req.environ)
            if not stream:
                return loop.run_nonstream(s)
            first = s.call_model(stream=True)
            if first.status_code != 200:
                return relay(first)          # the upstream's error, untouched
            return sse_response(loop.run_stream(s, first))

        data = guard.dumps(body) if changed else raw
        r = upstream.request("POST", "/v1/chat/completions", headers=forward_headers(
            req.headers), data=data, stream=True, environ=req.environ,
            read_body=not stream)
        if stream:
            return relay(r, body=normalize.normalize_sse(streamed(r, req.environ)))
        content = normalize.normalize_completion_bytes(r.content)
        r.close()
        return Response(content, status=r.status_code, headers=forward_headers(r.headers))

    # Anthropic Messages (Claude Code) and OpenAI Responses (Codex). /v1/v1/messages:
    # the anthropic SDK appends /v1/messages to its base URL, so base_url=<proxy>/v1
    # (the form the OpenAI SDK wants) must work too.
    ext = app.extensions["proxy"]
    hot = {"/v1/chat/completions": chat,
           "/v1/responses": lambda req: dialects.handle(dialects.RESPONSES, ext, req)}
    for path in dialects.MESSAGES_PATHS:
        hot[path] = lambda req: dialects.handle(dialects.MESSAGES, ext, req)
    # Flask serves them too (another method's 405, a trailing slash); POST on these
    # paths is served hot, around Flask.
    for path, view in hot.items():
        app.add_url_rule(path, "hot" + path.replace("/", "_"), methods=["POST"],
                         view_func=lambda view=view: view(request._get_current_object()))
    install(app, hot.get, before=before, after=after)

    # ------------------------------------------------------------ pass-through

    def passthrough(**_):
        env = request.environ
        target = env.get("RAW_URI") or env.get("REQUEST_URI") or ""
        if not target.startswith("/"):           # absent, or absolute-form request target
            target = request.full_path
        path, _, query = target.partition("?")
        if path.startswith(dialects.MESSAGES_PATHS[1]):   # anthropic SDK, base_url=.../v1
            path = path[3:]
        data = request.get_data() if request.method not in ("GET", "HEAD") else None
        r = upstream.request(request.method, path, query=query,
                             headers=forward_headers(request.headers), data=data or None,
                             environ=request.environ)
        return relay(r)

    app.add_url_rule("/v1/<path:rest>", "v1", passthrough, methods=ALL_METHODS)

    for i, rule in enumerate(ADMIN_ROUTES):
        app.add_url_rule(rule, f"admin{i}", passthrough, methods=ALL_METHODS)

    return app

