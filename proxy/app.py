"""The proxy's Flask app. create_app(settings) configures it: the parts the views
use (in app.extensions["proxy"]), the request guard, the error envelope, one set
of hooks (auth, timing, Anthropic error shapes, metrics, the activity list), the
routes' blueprint and the console's (/ui)."""
from __future__ import annotations

import concurrent.futures as cf
import hmac
import logging
import time

from flask import Flask, Response, current_app, request

from common.errors import error_response, install_error_handlers
from common.guard import harden

from . import console, dialects
from .activity import Activity
from .metrics import MODEL, NOT_READ, T0, Metrics, route_label
from .routes import bp
from .search.searxng import SearxngClient
from .settings import Settings
from .upstream import ModelCatalog, Upstream


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.LOG_LEVEL.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = settings.MAX_BODY_BYTES    # the guard's and Flask's
    harden(app)
    install_error_handlers(app)

    upstream = Upstream(settings.BACKEND_URL, settings.CONNECT_TIMEOUT,
                        api_key=settings.API_KEY)
    catalog = ModelCatalog(upstream, settings.MODELS_TTL)
    activity = Activity()
    app.extensions["proxy"] = dict(
        settings=settings, upstream=upstream, catalog=catalog,
        searx=SearxngClient(settings.SEARXNG_URL, settings.SEARXNG_RESULTS,
                            settings.SEARXNG_TIMEOUT),
        metrics=Metrics(resolve=lambda name: catalog.lookup(name).get("id"), activity=activity),
        activity=activity,
        executor=cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="search"))
    app.before_request(before)
    app.after_request(after)
    app.register_blueprint(bp)
    app.register_blueprint(console.bp)
    return app


def before():
    """T0 of the request's time, its activity record, then the API key (every route
    but /healthz and the console's page and assets: its data calls send the key)."""
    request.environ[T0] = time.perf_counter()
    parts = current_app.extensions["proxy"]
    parts["activity"].begin(request.environ, route_label(request.path))
    api_key = parts["settings"].API_KEY
    if api_key and request.path != "/healthz" and not console.is_public(request.path):
        headers = request.headers
        auth = headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else \
            headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.encode(), api_key.encode()):
            return error_response("missing or wrong API key: send "
                                  "'Authorization: Bearer <API_KEY>'", 401,
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


def after(resp: Response) -> Response:
    """Every answer: in Anthropic's error shape on /v1/messages, then counted."""
    resp = dialects.anthropic_errors(resp, request.path)
    env = request.environ
    return current_app.extensions["proxy"]["metrics"].observe(
        resp, request, env.get(T0), env.get(MODEL, NOT_READ))
