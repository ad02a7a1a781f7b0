"""The key store on PostgreSQL (KEYS_DATABASE_URL): for several proxies that
share keys and their limits (the fleet: every stack checks the same keys
itself, so the router passes them through; docs/keys.md). Driver: psycopg 3.

A few connections per process are kept (store.SqlStore's pool); one that
failed is dropped, so when the database comes back the next operation connects
again (one that fails at its transaction's first statement, after a restart of
the server, is replaced at once and the idle ones with it: no 503 for it). Connecting gives up after
CONNECT_TIMEOUT seconds: an unreachable database is a quick 503, not a hang.
An admission locks its key's row (SELECT ... FOR UPDATE) for the transaction,
so two proxies cannot both take a key's last slot. Under gunicorn's gevent
worker psycopg sees gevent's monkey-patching and waits cooperatively."""
from __future__ import annotations

import time

import psycopg

from .store import SqlStore

CONNECT_TIMEOUT = 2


class PostgresStore(SqlStore):
    MARK = "%s"
    STALE_CONNECTIONS = True
    TYPES = {"serial": "BIGSERIAL PRIMARY KEY", "int": "BIGINT", "real": "DOUBLE PRECISION"}

    def __init__(self, url: str, clock=time.time):
        super().__init__(clock)
        self.url = url

    def _connect(self):
        return psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT, autocommit=True)

    def _create(self, cur) -> None:
        cur.execute("BEGIN")
        # Two processes creating the schema at once: one at a time.
        cur.execute("SELECT pg_advisory_xact_lock(4035)")
        super()._create(cur)

    def _lock(self, cur, key_id):
        cur.execute("BEGIN")
        if key_id is not None:
            cur.execute("SELECT id FROM keys WHERE id = %s FOR UPDATE", (key_id,))
