"""Keys for a team (issue 35): each key has a name, a role (`use`, `admin`), the
models it may use and optional limits, in a database (docs/keys.md).

- policy.py: the pure parts (scope matching, limit decisions, failed-auth counts);
- store.py: the Store interface and its SQL core; sqlite.py, postgres.py: the two
  databases;
- auth.py: the door's check (KeyAuth), the model scope check, and the request's
  key (`identity(environ)`, `environ[auth.KEY]`);
- usage.py: usage per key, counted from each request's record at its end;
- admin.py: GET/POST /admin/keys..., GET /admin/usage; cli.py: `python -m proxy.keys`.
"""
from __future__ import annotations

import atexit
import logging
from urllib.parse import urlsplit

from .store import Store

log = logging.getLogger("proxy.keys")


def open_store(settings) -> Store | None:
    """The store the settings name (PostgreSQL when KEYS_DATABASE_URL is set, else
    SQLite at KEYS_DB), or None: no store, the door is API_KEY's alone. Nothing
    is asked of the database here: an unreachable one is the requests' 503."""
    if settings.KEYS_DATABASE_URL:
        from .postgres import PostgresStore
        u = urlsplit(settings.KEYS_DATABASE_URL)
        log.info("keys: PostgreSQL at %s%s", u.hostname or "(socket)", u.path)  # no password
        return _closed_at_exit(PostgresStore(settings.KEYS_DATABASE_URL))
    if settings.KEYS_DB:
        from .sqlite import SqliteStore
        log.info("keys: SQLite at %s", settings.KEYS_DB)
        return _closed_at_exit(SqliteStore(settings.KEYS_DB))
    return None


def _closed_at_exit(store: Store) -> Store:
    """At the process's exit the store writes the usage rows it still holds (the
    database was down) once more, then closes its connections."""
    atexit.register(store.close)
    return store
