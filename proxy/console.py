"""The console: one page at /ui on the proxy's port, live from the stack's own APIs.

The page (proxy/static/console.*: plain HTML, JS and CSS, no build step, nothing
fetched from elsewhere) reads `/events` (the swapper's event stream, through the
proxy), `/v1/models`, `/running`, `/healthz`, `/logs/<model>/stream` and the
proxy's recent requests at `/ui/activity`; with an admin key and the key store
on, its Keys section uses the admin API (`/admin/keys`, `/admin/usage`: no route
of its own). With API_KEY set the page and its
assets load without the key (they hold no data); every data call, the activity
JSON included, needs it: the page asks for it, keeps it in the browser's
localStorage and sends it as `Authorization: Bearer`, never in a URL. A new
key's token is shown once and kept nowhere by the page.
"""
from __future__ import annotations

from pathlib import Path

from flask import Blueprint, current_app, jsonify, request, send_from_directory

from .activity import RING_SIZE
from .keys.auth import identity

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = frozenset({"console.js", "console.css"})

bp = Blueprint("console", __name__)


def is_public(path: str) -> bool:
    """The page and its assets: served without the API key (no data in them)."""
    if path in ("/ui", "/ui/"):
        return True
    head, _, name = path.rpartition("/")
    return head == "/ui/static" and name in ASSETS


def _no_store(resp):
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["X-Content-Type-Options"] = "nosniff"
    return resp


@bp.get("/ui")
def page():
    resp = send_from_directory(STATIC, "console.html", mimetype="text/html", max_age=0)
    # Nothing but this origin: no inline script, no other host, no framing.
    resp.headers["Content-Security-Policy"] = (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
    resp.headers["Referrer-Policy"] = "no-referrer"
    return _no_store(resp)


@bp.get("/ui/static/<name>")
def asset(name: str):
    if name not in ASSETS:
        return jsonify({"error": {"message": f"no console asset '{name}'",
                                  "type": "not_found_error", "code": "not_found"}}), 404
    mimetype = "text/javascript" if name.endswith(".js") else "text/css"
    return _no_store(send_from_directory(STATIC, name, mimetype=mimetype, max_age=0))


@bp.get("/ui/activity")
def activity():
    """The proxy's recent requests, oldest first: `?since=<seq>` for the newer ones."""
    since = request.args.get("since", type=int) or 0
    limit = request.args.get("limit", type=int)
    ring = current_app.extensions["proxy"]["activity"]
    key = identity(request.environ)
    own = None if key is None or key.admin else key.name    # a use key: its own requests
    entries, newest = ring.since(since, RING_SIZE if limit is None else max(limit, 0), own)
    return _no_store(jsonify({"object": "list", "data": entries, "newest": newest}))
