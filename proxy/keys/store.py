"""The key store: one small interface (Store), two implementations on one SQL
core (SqlStore): embedded SQLite (proxy/keys/sqlite.py, the default) and
PostgreSQL (proxy/keys/postgres.py, when several proxies share keys).

Keys are stored as the sha256 of their token (`cs-` + 43 URL-safe characters:
256 random bits); the token is shown once, when made, and never stored, logged
or put in a URL. A lookup is by the token's digest (an index), the digest then
compared in constant time (hmac.compare_digest).

The limits are counted in the database, so every gunicorn worker and every
proxy sharing it sees one count:

- requests per minute: a row per key and minute (`minute_counts`), incremented
  when a request is admitted;
- tokens per day: the sum of the key's prompt + completion tokens of the UTC
  day in the usage table (below);
- concurrent requests: a row per request being served (`leases`), inserted when
  it is admitted and deleted when it ends (auth.py's `finally`). Each row names
  the process that holds it (`owner`); each process marks itself alive every
  HEARTBEAT seconds (`owners`), and the rows of a process not seen for STALE
  seconds (it crashed) no longer count and are deleted. A delete that fails
  (the database unreachable) is retried by the heartbeat.

Admission (`admit`) reads the counts and writes the increments in one
transaction that holds the key's write lock (SQLite: BEGIN IMMEDIATE; PostgreSQL:
the key's row FOR UPDATE), so two workers cannot both take the last slot.

Usage per key (`key_usage`): a row per key, UTC day and model with its
counters (requests, prompt / cached / completion tokens, queue wait and load
seconds: policy.Spent), added to by one UPSERT statement per row when a
request ends (`add_usage`, from the request's record: proxy/keys/usage.py). A
write the database refuses (it is down) is kept in this process's memory,
summed per row (bounded: MAX_PENDING rows), and written with the next write
that succeeds or by the heartbeat, which retries it every HEARTBEAT seconds
until the database is back; `close()` (the process's exit) tries it once more.

Any failure to reach the database raises StoreDown (the door answers 503).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from . import policy
from .policy import SPENT_FIELDS, Key, Refusal, Spent, Usage

log = logging.getLogger("proxy.keys")

TOKEN_PREFIX = "cs-"
HEARTBEAT = 5.0         # seconds between a process's "alive" marks
STALE = 30.0            # a process not seen for this long holds no lease
POOL = 4                # idle connections kept per process
MAX_CONNECTIONS = 8     # open at once per process (PostgreSQL's own cap is ~100 in all)
CONNECTION_WAIT = 5.0   # seconds a request waits for one before it is a 503
MAX_PENDING = 10000     # usage rows kept in memory while the database is down

FIELDS = ("role", "models", "max_concurrent", "rpm", "tokens_per_day", "weight")


class StoreDown(Exception):
    """The key database cannot be reached (or answered an error)."""


class _Stale(Exception):
    """A pooled connection failed at its transaction's first statement."""


class Limited(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


class UnknownKey(LookupError):
    """No active key of that name."""


class NameTaken(ValueError):
    """An active key has that name already."""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class Store:
    """What the door, the admin routes and the CLI ask of a key store."""

    def create(self, name: str, *, role: str = "use", models=policy.ALL_MODELS,
               max_concurrent: int | None = None, rpm: int | None = None,
               tokens_per_day: int | None = None, weight: float = 1.0) -> tuple[Key, str]:
        """A new key and its token (the only time the token is seen)."""
        raise NotImplementedError

    def keys(self, revoked: bool = False) -> list[Key]:
        raise NotImplementedError

    def get(self, name: str) -> Key | None:
        """The active key of that name."""
        raise NotImplementedError

    def update(self, name: str, **fields) -> Key:
        raise NotImplementedError

    def revoke(self, name: str) -> Key:
        raise NotImplementedError

    def by_token(self, token: str) -> Key | None:
        """The active key whose token this is, else None."""
        raise NotImplementedError

    def has_keys(self) -> bool:
        """Whether any key was ever made, revoked ones included (none: the door works
        as without a store). Revoking the last key never opens the door."""
        raise NotImplementedError

    def admit(self, key: Key) -> str | None:
        """One more request of `key` starts: Limited when it is over a limit, else
        its lease (None: the key has no concurrency limit) to `release` at its end."""
        raise NotImplementedError

    def release(self, lease: str) -> None:
        raise NotImplementedError

    def add_usage(self, key: Key, model: str, spent: Spent, day: int | None = None) -> None:
        """A request of `key` on `model` ended and used `spent` (its UTC `day`: today
        when None). Never raises for the database: a write it refuses is kept and
        retried (the module's doc)."""
        raise NotImplementedError

    def usage_rows(self, name: str | None = None, model: str | None = None,
                   since: int | None = None, until: int | None = None) -> list[dict]:
        """The usage table's rows (key name, model, day, the counters) of the days
        from `since` to `until` (UTC day numbers, inclusive), per key name."""
        raise NotImplementedError

    def pending(self) -> int:
        """Usage rows kept in memory, not yet written (the database was down)."""
        return 0

    def finish(self, key: Key, lease: str | None, usage: tuple | None = None) -> None:
        """A request of `key` ended: its lease released and its usage row (`usage`:
        model, Spent) added, in one transaction; what fails is retried by the
        heartbeat."""
        if lease is not None:
            self.release(lease)
        if usage is not None:
            self.add_usage(key, *usage)

    def usage(self, key: Key) -> Usage:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _key_of(row) -> Key:
    (id_, name, role, models, conc, rpm, tpd, weight, created, revoked) = row
    return Key(name=name, role=role, models=tuple(json.loads(models)), max_concurrent=conc,
               rpm=rpm, tokens_per_day=tpd, weight=float(weight), created=float(created),
               revoked=None if revoked is None else float(revoked), id=id_)


def _checked(fields: dict) -> dict:
    """Fields of a key, validated (ValueError says which is wrong)."""
    out = {}
    for k, v in fields.items():
        if k not in FIELDS:
            raise ValueError(f"a key has no field {k!r} (its fields: {', '.join(FIELDS)})")
        if k == "role":
            if v not in policy.ROLES:
                raise ValueError(f"role must be one of {', '.join(policy.ROLES)}, not {v!r}")
        elif k == "models":
            if isinstance(v, str):
                v = v.split(",")
            v = list(policy.check_models(v))
        elif k == "weight":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                    or v != v or v == float("inf"):
                raise ValueError(f"weight must be a positive number, not {v!r}")
            v = float(v)
        elif v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{k} must be a whole number of at least 1, or none, not {v!r}")
        out[k] = v
    return out


COLUMNS = "id, name, role, models, max_concurrent, rpm, tokens_per_day, weight, created, revoked"


class SqlStore(Store):
    """The store's logic in SQL both databases run; a subclass gives its
    connections (`_conn`), its schema's types (TYPES), its parameter mark and how a
    write transaction locks (`_lock`)."""

    # The schema, once: each database names its types (TYPES: {serial} a key's id,
    # {int} a count that may grow past 2^31, {real} seconds).
    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS keys (id {serial}, name TEXT NOT NULL, "
        "hash TEXT NOT NULL UNIQUE, role TEXT NOT NULL, models TEXT NOT NULL, "
        "max_concurrent INTEGER, rpm INTEGER, tokens_per_day {int}, "
        "weight {real} NOT NULL DEFAULT 1, created {real} NOT NULL, revoked {real})",
        "CREATE UNIQUE INDEX IF NOT EXISTS keys_active_name ON keys (name) "
        "WHERE revoked IS NULL",
        "CREATE TABLE IF NOT EXISTS minute_counts (key_id {int} NOT NULL, "
        "minute {int} NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (key_id, minute))",
        "CREATE TABLE IF NOT EXISTS key_usage (key_id {int} NOT NULL, day {int} NOT NULL, "
        "model TEXT NOT NULL, requests {int} NOT NULL, prompt_tokens {int} NOT NULL, "
        "cached_tokens {int} NOT NULL, completion_tokens {int} NOT NULL, "
        "queue_wait_seconds {real} NOT NULL, load_seconds {real} NOT NULL, "
        "PRIMARY KEY (key_id, day, model))",
        "CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, seen {real} NOT NULL)",
        "CREATE TABLE IF NOT EXISTS leases (id TEXT PRIMARY KEY, key_id {int} NOT NULL, "
        "owner TEXT NOT NULL, started {real} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS leases_key ON leases (key_id)",
    )
    TYPES: dict[str, str] = {}
    MARK = "?"
    # Whether a pooled connection can go stale (a server that restarted drops it):
    # then one that fails at its first statement is replaced and the work done once
    # more on a new connection.
    STALE_CONNECTIONS = False

    def __init__(self, clock=time.time):
        self.clock = clock
        self.owner = uuid.uuid4().hex           # this process, for its leases
        self._ready = False
        self._ready_lock = threading.Lock()
        self._unreleased: set[str] = set()
        self._beating = False
        self._marked = float("-inf")        # when this process last marked itself alive
        self._pruned: dict[int, int] = {}   # key id -> the minute its old counts went
        self._pending: dict[tuple[int, int, str], Spent] = {}   # (key id, day, model)
        self._pending_lock = threading.Lock()
        self.dropped = 0                    # usage rows lost: MAX_PENDING was reached
        self._idle: queue.LifoQueue = queue.LifoQueue(maxsize=POOL)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    # -------------------------------------------------------------- plumbing
    def _connect(self):
        """A new DB-API connection, in autocommit mode (transactions are ours)."""
        raise NotImplementedError

    @contextmanager
    def _conn(self, fresh: bool = False) -> Iterator:
        """A connection of this process's small pool (LIFO, none shared between two
        greenlets at once, at most MAX_CONNECTIONS open), or a new one (`fresh`);
        one that failed is closed, so a database that comes back is connected to
        again."""
        if not self._slots.acquire(timeout=CONNECTION_WAIT):
            raise StoreDown(f"all {MAX_CONNECTIONS} of this process's database connections "
                            f"stayed busy for {CONNECTION_WAIT:g} s")
        conn = None
        ok = False
        try:
            try:
                if fresh:
                    raise queue.Empty
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self._connect()
            yield conn
            ok = True
        finally:
            try:
                if ok:
                    try:
                        self._idle.put_nowait(conn)
                        conn = None
                    except queue.Full:
                        pass
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001 - it is gone anyway
                        pass
            finally:
                self._slots.release()

    def _drop_idle(self) -> None:
        """Close the idle connections (made before the database restarted)."""
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                return
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - it is gone anyway
                pass

    def close(self) -> None:
        if self._pending:
            try:
                self._flush()
            except StoreDown as e:
                log.error("%d usage row(s) not written at exit: %s", len(self._pending), e)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def _lock(self, cur, key_id: int | None) -> None:
        """Begin a write transaction holding the lock `admit` needs."""
        raise NotImplementedError

    def _sql(self, q: str) -> str:
        return q if self.MARK == "?" else q.replace("?", self.MARK)

    def _run(self, fn, write: bool = False, key_id: int | None = None):
        """fn(cursor) in a transaction; StoreDown for any database failure. An
        answer fn raises on purpose (Limited, UnknownKey, ValueError) rolls back
        and keeps the connection."""
        self._ensure_schema()
        answer = None
        for fresh in (False, True):
            try:
                with self._conn(fresh) as conn:
                    cur = conn.cursor()
                    try:
                        if write:
                            self._lock(cur, key_id)
                        else:
                            cur.execute("BEGIN")
                    except Exception:
                        if fresh or not self.STALE_CONNECTIONS:
                            raise
                        # A pooled connection the database dropped (it restarted):
                        # nothing was done on it; the idle ones are as stale. Once
                        # more on a new connection.
                        self._drop_idle()
                        raise _Stale from None
                    try:
                        out = fn(cur)
                    except (Limited, UnknownKey, ValueError) as e:
                        conn.rollback()
                        answer = e
                    except BaseException:
                        conn.rollback()
                        raise
                    else:
                        conn.commit()
                break
            except _Stale:
                continue
            except Exception as e:  # noqa: BLE001 - any driver error is the database's
                raise StoreDown(f"{type(e).__name__}: {e}") from e
        if answer is not None:
            raise answer
        return out

    def _ensure_schema(self) -> None:
        if self._ready:
            return
        with self._ready_lock:
            if self._ready:
                return
            try:
                with self._conn() as conn:
                    cur = conn.cursor()
                    self._create(cur)
                    conn.commit()
            except Exception as e:  # noqa: BLE001
                raise StoreDown(f"{type(e).__name__}: {e}") from e
            self._ready = True

    def _create(self, cur) -> None:
        for stmt in self.SCHEMA:
            cur.execute(stmt.format(**self.TYPES))

    def _x(self, cur, q: str, args=()):
        cur.execute(self._sql(q), args)
        return cur

    # -------------------------------------------------------------- keys
    def create(self, name, *, role="use", models=policy.ALL_MODELS, max_concurrent=None,
               rpm=None, tokens_per_day=None, weight=1.0):
        policy.check_name(name)
        f = _checked(dict(role=role, models=models, max_concurrent=max_concurrent, rpm=rpm,
                          tokens_per_day=tokens_per_day, weight=weight))
        token = new_token()

        def go(cur):
            if self._x(cur, "SELECT 1 FROM keys WHERE name = ? AND revoked IS NULL",
                       (name,)).fetchone():
                raise NameTaken(f"a key named '{name}' exists already")
            self._x(cur, "INSERT INTO keys (name, hash, role, models, max_concurrent, rpm, "
                         "tokens_per_day, weight, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (name, digest(token), f["role"], json.dumps(f["models"]),
                     f["max_concurrent"], f["rpm"], f["tokens_per_day"], f["weight"],
                     self.clock()))
            return self._one(cur, name)
        return self._run(go, write=True), token

    def _one(self, cur, name: str) -> Key | None:
        row = self._x(cur, f"SELECT {COLUMNS} FROM keys WHERE name = ? AND revoked IS NULL",
                      (name,)).fetchone()
        return _key_of(row) if row else None

    def keys(self, revoked=False):
        q = f"SELECT {COLUMNS} FROM keys" + ("" if revoked else " WHERE revoked IS NULL") + \
            " ORDER BY name, created"
        return self._run(lambda cur: [_key_of(r) for r in self._x(cur, q).fetchall()])

    def get(self, name):
        return self._run(lambda cur: self._one(cur, name))

    def update(self, name, **fields):
        f = _checked(fields)
        if "models" in f:
            f["models"] = json.dumps(f["models"])

        def go(cur):
            if self._one(cur, name) is None:
                raise UnknownKey(f"no key named '{name}'")
            if f:
                sets = ", ".join(f"{k} = ?" for k in f)
                self._x(cur, f"UPDATE keys SET {sets} WHERE name = ? AND revoked IS NULL",
                        (*f.values(), name))
            return self._one(cur, name)
        return self._run(go, write=True)

    def revoke(self, name):
        def go(cur):
            key = self._one(cur, name)
            if key is None:
                raise UnknownKey(f"no key named '{name}'")
            self._x(cur, "UPDATE keys SET revoked = ? WHERE id = ?", (self.clock(), key.id))
            row = self._x(cur, f"SELECT {COLUMNS} FROM keys WHERE id = ?",
                          (key.id,)).fetchone()
            return _key_of(row)
        return self._run(go, write=True)

    def by_token(self, token):
        d = digest(token)

        def go(cur):
            row = self._x(cur, f"SELECT {COLUMNS}, hash FROM keys WHERE hash = ? "
                               "AND revoked IS NULL", (d,)).fetchone()
            return row
        row = self._run(go)
        if row is None or not hmac.compare_digest(row[-1], d):
            return None
        return _key_of(row[:-1])

    def has_keys(self):
        return self._run(lambda cur: self._x(
            cur, "SELECT 1 FROM keys LIMIT 1").fetchone() is not None)

    # -------------------------------------------------------------- limits
    def _usage(self, cur, key: Key, now: float) -> Usage:
        in_flight = this_minute = tokens = 0
        if key.max_concurrent is not None:
            in_flight = self._x(cur, "SELECT COUNT(*) FROM leases l JOIN owners o "
                                     "ON o.owner = l.owner WHERE l.key_id = ? AND o.seen >= ?",
                                (key.id, now - STALE)).fetchone()[0]
        if key.rpm is not None:
            row = self._x(cur, "SELECT n FROM minute_counts WHERE key_id = ? AND minute = ?",
                          (key.id, policy.minute_of(now))).fetchone()
            this_minute = row[0] if row else 0
        if key.tokens_per_day is not None:
            tokens = self._x(cur, "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) "
                                  "FROM key_usage WHERE key_id = ? AND day = ?",
                             (key.id, policy.day_of(now))).fetchone()[0]
        return Usage(int(in_flight), int(this_minute), int(tokens))

    def usage(self, key):
        return self._run(lambda cur: self._usage(cur, key, self.clock()))

    def admit(self, key):
        if not key.limited:
            return None
        now = self.clock()

        def go(cur):
            refusal = policy.decide(key, self._usage(cur, key, now), now)
            if refusal is not None:
                raise Limited(refusal)
            if key.rpm is not None:
                minute = policy.minute_of(now)
                self._x(cur, "INSERT INTO minute_counts (key_id, minute, n) VALUES (?, ?, 1) "
                             "ON CONFLICT (key_id, minute) DO UPDATE SET n = minute_counts.n + 1",
                        (key.id, minute))
                if self._pruned.get(key.id) != minute:
                    self._x(cur, "DELETE FROM minute_counts WHERE key_id = ? AND minute < ?",
                            (key.id, minute - 1))
                    self._pruned[key.id] = minute
            if key.max_concurrent is None:
                return None
            lease = uuid.uuid4().hex
            if now - self._marked >= HEARTBEAT:
                self._mark_alive(cur, now)
            self._x(cur, "INSERT INTO leases (id, key_id, owner, started) VALUES (?, ?, ?, ?)",
                    (lease, key.id, self.owner, now))
            return lease
        lease = self._run(go, write=True, key_id=key.id)
        if lease is not None:
            self._start_heartbeat()
        return lease

    def _mark_alive(self, cur, now: float) -> None:
        self._x(cur, "INSERT INTO owners (owner, seen) VALUES (?, ?) ON CONFLICT (owner) "
                     "DO UPDATE SET seen = excluded.seen", (self.owner, now))
        # (set before the commit: a rolled-back mark is made again by the next beat)
        self._marked = now

    def release(self, lease):
        try:
            self._run(lambda cur: self._x(cur, "DELETE FROM leases WHERE id = ?", (lease,)))
        except StoreDown as e:
            log.warning("could not release a concurrency lease (%s): retried by the heartbeat",
                        e)
            self._unreleased.add(lease)
            self._start_heartbeat()

    def finish(self, key, lease, usage=None):
        if usage is None or key.id is None:
            if lease is not None:
                self.release(lease)
            return
        row = (key.id, policy.day_of(self.clock()), usage[0])
        with self._pending_lock:
            rows = self._pending
            self._pending = {}
        rows[row] = rows[row] + usage[1] if row in rows else usage[1]

        def go(cur):
            if lease is not None:
                self._x(cur, "DELETE FROM leases WHERE id = ?", (lease,))
            self._upsert(cur, rows)
        try:
            self._run(go, write=True)
        except StoreDown as e:
            if lease is not None:
                self._unreleased.add(lease)
            self._keep(rows)
            self._start_heartbeat()
            log.warning("could not end a request of key '%s' (%s): its slot release and "
                        "usage are retried when the database is back", key.name, e)

    # -------------------------------------------------------------- usage
    def add_usage(self, key, model, spent, day=None):
        if key.id is None:
            return
        row = (key.id, policy.day_of(self.clock()) if day is None else day, model)
        with self._pending_lock:
            rows = self._pending
            self._pending = {}
        rows[row] = rows[row] + spent if row in rows else spent
        self._write(rows)

    def _write(self, rows: dict) -> None:
        """Write these rows in one transaction; kept for the heartbeat if it fails."""
        try:
            self._run(lambda cur: self._upsert(cur, rows), write=True)
        except StoreDown as e:
            self._keep(rows)
            log.warning("usage not written (%s): %d row(s) kept, retried when the database "
                        "is back", e, len(self._pending))
            self._start_heartbeat()

    def _keep(self, rows: dict) -> None:
        with self._pending_lock:
            for row, spent in rows.items():
                if row in self._pending:
                    self._pending[row] = self._pending[row] + spent
                elif len(self._pending) < MAX_PENDING:
                    self._pending[row] = spent
                else:
                    self.dropped += 1
                    log.error("usage row of key id %s lost: %d rows already wait for the "
                              "database", row[0], MAX_PENDING)

    def _flush(self) -> None:
        """Write the kept rows (StoreDown: they stay kept)."""
        with self._pending_lock:
            rows = self._pending
            self._pending = {}
        if not rows:
            return
        try:
            self._run(lambda cur: self._upsert(cur, rows), write=True)
        except StoreDown:
            self._keep(rows)
            raise

    def pending(self):
        return len(self._pending)

    def _upsert(self, cur, rows: dict) -> None:
        cols = ", ".join(SPENT_FIELDS)
        sets = ", ".join(f"{c} = key_usage.{c} + excluded.{c}" for c in SPENT_FIELDS)
        q = (f"INSERT INTO key_usage (key_id, day, model, {cols}) VALUES "
             f"(?, ?, ?, {', '.join('?' * len(SPENT_FIELDS))}) "
             f"ON CONFLICT (key_id, day, model) DO UPDATE SET {sets}")
        for (key_id, day, model), spent in rows.items():
            self._x(cur, q, (key_id, day, model, *spent.values()))

    def usage_rows(self, name=None, model=None, since=None, until=None):
        where, args = [], []
        for cond, value in (("k.name = ?", name), ("u.model = ?", model),
                            ("u.day >= ?", since), ("u.day <= ?", until)):
            if value is not None:
                where.append(cond)
                args.append(value)
        sums = ", ".join(f"SUM(u.{c})" for c in SPENT_FIELDS)
        q = (f"SELECT k.name, u.model, u.day, {sums} FROM key_usage u "
             "JOIN keys k ON k.id = u.key_id" + (" WHERE " + " AND ".join(where) if where else "")
             + " GROUP BY k.name, u.model, u.day ORDER BY u.day, k.name, u.model")

        def go(cur):
            return [{"key": r[0], "model": r[1], "day": int(r[2]),
                     **{c: (float(v) if c.endswith("seconds") else int(v))
                        for c, v in zip(SPENT_FIELDS, r[3:])}}
                    for r in self._x(cur, q, args).fetchall()]
        return self._run(go)

    # -------------------------------------------------------------- liveness
    def _start_heartbeat(self) -> None:
        if self._beating:
            return
        self._beating = True
        threading.Thread(target=self._heartbeat, name="keys-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT)
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - the next beat tries again
                log.debug("keys heartbeat failed: %s", e)

    def beat(self) -> None:
        """Mark this process alive, retry the releases and the usage writes that
        failed, forget the leases of processes gone for STALE seconds."""
        now = self.clock()
        pending = list(self._unreleased)
        with self._pending_lock:
            rows = self._pending
            self._pending = {}

        def go(cur):
            self._mark_alive(cur, now)
            for lease in pending:
                self._x(cur, "DELETE FROM leases WHERE id = ?", (lease,))
            self._x(cur, "DELETE FROM leases WHERE owner IN "
                         "(SELECT owner FROM owners WHERE seen < ?)", (now - 2 * STALE,))
            self._x(cur, "DELETE FROM owners WHERE seen < ?", (now - 2 * STALE,))
            self._upsert(cur, rows)
        try:
            self._run(go, write=True)
        except StoreDown:
            self._keep(rows)
            raise
        self._unreleased.difference_update(pending)
