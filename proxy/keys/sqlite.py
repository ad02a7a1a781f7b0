"""The key store in an embedded SQLite file (the default: KEYS_DB, under compose
/data/keys.db on the proxy's volume). Made on first use with mode 0600 (SQLite
gives its -wal and -shm files the same mode), in WAL mode (readers never wait
for the writer); every gunicorn worker and the CLI open it on their own, and a
write transaction takes SQLite's write lock at its start (BEGIN IMMEDIATE), so
two processes' admissions never interleave. Connections are kept open (the
store's small pool): closing a database's last connection checkpoints the WAL
with an fsync (~10 ms an operation on the test machine; ~0.3 ms with them
kept). The sqlite3 calls do not yield to gevent; each transaction is a few
statements."""
from __future__ import annotations

import os
import sqlite3
import time

from .store import SqlStore

BUSY_TIMEOUT = 5.0          # seconds a transaction waits for another's write lock


class SqliteStore(SqlStore):
    TYPES = {"serial": "INTEGER PRIMARY KEY AUTOINCREMENT", "int": "INTEGER", "real": "REAL"}

    def __init__(self, path: str, clock=time.time):
        super().__init__(clock)
        self.path = path

    def _connect(self):
        if not os.path.exists(self.path):
            folder = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(folder, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        # isolation_level=None: transactions are ours (BEGIN / BEGIN IMMEDIATE);
        # check_same_thread=False: the pool hands it to one greenlet at a time.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None,
                               check_same_thread=False)
        # WAL with synchronous=NORMAL: a commit does not wait for fsync; the file
        # stays consistent, and a power cut may lose the last counts only.
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _create(self, cur) -> None:
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("BEGIN IMMEDIATE")
        super()._create(cur)

    def _lock(self, cur, key_id):
        cur.execute("BEGIN IMMEDIATE")
