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
    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS keys (id BIGSERIAL PRIMARY KEY, name TEXT NOT NULL, "
        "hash TEXT NOT NULL UNIQUE, role TEXT NOT NULL, models TEXT NOT NULL, "
        "max_concurrent INTEGER, rpm INTEGER, tokens_per_day BIGINT, "
        "weight DOUBLE PRECISION NOT NULL DEFAULT 1, created DOUBLE PRECISION NOT NULL, "
        "revoked DOUBLE PRECISION)",
        "CREATE UNIQUE INDEX IF NOT EXISTS keys_active_name ON keys (name) "
        "WHERE revoked IS NULL",
        "CREATE TABLE IF NOT EXISTS minute_counts (key_id BIGINT NOT NULL, "
        "minute BIGINT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (key_id, minute))",
        "CREATE TABLE IF NOT EXISTS key_usage (key_id BIGINT NOT NULL, day BIGINT NOT NULL, "
        "model TEXT NOT NULL, requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL, "
        "cached_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL, "
        "queue_wait_seconds DOUBLE PRECISION NOT NULL, "
        "load_seconds DOUBLE PRECISION NOT NULL, PRIMARY KEY (key_id, day, model))",
        "CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, "
        "seen DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS leases (id TEXT PRIMARY KEY, key_id BIGINT NOT NULL, "
        "owner TEXT NOT NULL, started DOUBLE PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS leases_key ON leases (key_id)",
    )

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
