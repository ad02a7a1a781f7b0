"""Per-request work Flask does that neither service needs, configured away.

Both apps answer every request in a few hundred microseconds of Python, so
Flask's fixed costs show: `lean(app)` removes the ones that change nothing
for these apps.

- Sessions: neither app uses `flask.session` (no secret key). Flask's default
  interface still tries to open a signed-cookie session on every request and,
  finding no key, builds a fresh NullSession. Here every request gets the same
  read-only NullSession (writing to it fails as before) and nothing is saved,
  as before.
- `ensure_sync`: Flask asks `inspect.iscoroutinefunction` about each hook and
  view on every request. A function found to be plain stays plain, so the
  answer is kept for it; an `async def` one is still wrapped each time.
"""
from __future__ import annotations

from flask import Flask
from flask.sessions import NullSession, SessionInterface


class NoSessions(SessionInterface):
    """One shared NullSession for every request; never saved."""

    def __init__(self):
        self._null = self.null_session_class()

    def open_session(self, app, request):
        return self._null

    def make_null_session(self, app):
        return self._null

    def save_session(self, app, session, response) -> None:
        return None


def lean(app: Flask) -> None:
    app.session_interface = NoSessions()
    ensure_sync = app.ensure_sync
    plain: set = set()          # functions known not to be coroutine functions

    def cached_ensure_sync(func):
        try:
            if func in plain:
                return func
        except TypeError:           # an unhashable callable: asked every time
            return ensure_sync(func)
        wrapped = ensure_sync(func)
        if wrapped is func and len(plain) < 4096:
            plain.add(func)
        return wrapped

    app.ensure_sync = cached_ensure_sync
