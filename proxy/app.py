"""The proxy's Flask app. create_app(settings) configures it: the parts the views
use (in app.extensions["proxy"]), its door (outermost, before any body is read:
Host, Origin and Sec-Fetch checks and its own CORS, common.origins; then the API
key, or with a key store the keys' check: proxy/keys/auth.py), the request guard (common.guard: paths, body size and body-read deadline),
the error envelope, one set of hooks (timing, Anthropic error shapes, metrics, the
activity list), the routes' blueprint and the console's (/ui)."""
from __future__ import annotations

import concurrent.futures as cf
import hmac
import logging

from flask import Flask, Response, current_app, g, request

from common.errors import error_response, install_error_handlers
from common.guard import close_connection, harden
from common.origins import OriginGuard, has_body, split_list

from . import console, dialects, keys
from .activity import Activity
from .metrics import TOKEN_ROUTES, Metrics, route_label
from .record import NOT_READ, Record
from .routes import bp
from .search.searxng import SearxngClient
from .settings import Settings
from .upstream import ModelCatalog, Upstream
from .keys import admin as keys_admin
from .keys.auth import KeyAuth, identity, is_model_request, last_write
from .keys.usage import Counting


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.LOG_LEVEL.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = settings.MAX_BODY_BYTES    # the guard's and Flask's
    harden(app, body_timeout=settings.BODY_TIMEOUT)
    install_error_handlers(app)

    store = keys.open_store(settings)
    upstream = Upstream(settings.BACKEND_URL, settings.CONNECT_TIMEOUT,
                        api_key=settings.API_KEY, strip_auth=store is not None)
    catalog = ModelCatalog(upstream, settings.MODELS_TTL)
    activity = Activity()
    metrics = Metrics(resolve=lambda name: catalog.lookup(name).get("id"), activity=activity)
    app.extensions["proxy"] = dict(
        settings=settings, upstream=upstream, catalog=catalog,
        searx=SearxngClient(settings.SEARXNG_URL, settings.SEARXNG_RESULTS,
                            settings.SEARXNG_TIMEOUT),
        metrics=metrics,
        activity=activity, keys=store,
        usage=None if store is None else Counting(
            store, resolve=lambda name: catalog.lookup(name).get("id"), metrics=metrics),
        executor=cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="search"))
    app.before_request(before)
    app.after_request(after)
    app.register_blueprint(bp)
    app.register_blueprint(console.bp)
    app.register_blueprint(keys_admin.bp)
    # The door, outermost: nothing below runs (no body is read) for a refused request.
    refused = lambda environ, status: metrics.refused(environ, status)  # noqa: E731
    # With a key store, its check (proxy/keys/auth.py: API_KEY still an admin key);
    # without one, API_KEY's alone, as before.
    door = KeyAuth(app.wsgi_app, store, settings.API_KEY, refused, shaped, console.is_public,
                   settings.AUTH_FAILURES_PER_MINUTE) if store is not None else \
        KeyCheck(app.wsgi_app, settings.API_KEY, refused)
    app.wsgi_app = OriginGuard(
        door,
        allowed_hosts=split_list(settings.ALLOWED_HOSTS),
        cors_origins=split_list(settings.CORS_ORIGINS),
        public=lambda method, path: method in ("GET", "HEAD") and console.is_public(path),
        on_refusal=refused, shape=shaped)
    return app


class KeyCheck:
    """WSGI middleware: with API_KEY set, every route but /healthz and the console's
    page and assets (its data calls send the key) wants `Authorization: Bearer
    <key>` (or `x-api-key`). Checked before anything reads the body: a refused
    request's body is never read (its connection is closed)."""

    def __init__(self, app, api_key: str, on_refusal):
        self.app = app
        self.key = api_key.encode()
        self.on_refusal = on_refusal

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if self.key and path != "/healthz" and not console.is_public(path):
            auth = environ.get("HTTP_AUTHORIZATION", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else \
                environ.get("HTTP_X_API_KEY", "")
            if not token or not hmac.compare_digest(token.encode("utf-8", "replace"),
                                                    self.key):
                self.on_refusal(environ, 401)
                if has_body(environ):
                    close_connection(environ)       # its body is never read
                resp = error_response("missing or wrong API key: send "
                                      "'Authorization: Bearer <API_KEY>'", 401,
                                      code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                return shaped(environ, resp)(environ, start_response)
        return self.app(environ, start_response)


def shaped(environ: dict, resp: Response) -> Response:
    """A refusal of the door in its route's error shape (Anthropic's on /v1/messages)."""
    return dialects.shaped(resp, environ.get("PATH_INFO", ""))


def before():
    """The request's record (proxy/record.py), made as it arrives: its t0, route and
    dialect; the handlers fill it (passed to them by name), the writer as the
    answer goes, the metrics and the activity list read it at the end, and, for
    a model request of a key from the store, the key's usage (proxy/keys/usage.py)."""
    route = route_label(request.path)
    g.record = rec = Record(route, Activity.dialect(route), request.method)
    key = identity(request.environ)
    if key is not None:
        rec.who = key
        usage = current_app.extensions["proxy"]["usage"]
        if usage is not None and key.id is not None and is_model_request(request.environ):
            # a key of the store: its usage row counts the request once it has ended
            # (proxy/keys/usage.py; the daily token limit reads the same rows)
            rec.on_end.append(usage.reader(key, last_write(request.environ)))
    return None


def after(resp: Response) -> Response:
    """Every answer: in its dialect's error shape (Anthropic's on /v1/messages),
    then counted."""
    resp = dialects.shaped(resp, request.path)
    rec = g.get("record")
    if rec is None:
        rec = Record(route_label(request.path), None, request.method)
    if rec.model is NOT_READ and resp.status_code == 200 and rec.route in TOKEN_ROUTES:
        rec.body = request.get_data()   # the handler read it: Werkzeug's cached copy
    return current_app.extensions["proxy"]["metrics"].observe(resp, rec)
