"""A Docker engine that can vanish: a Unix-socket relay to the real engine's
socket that a test cuts and restores. A swapper given
`DOCKER_HOST=unix://<relay.path>` talks to the real engine through it, and
sees exactly what it would see if dockerd stopped answering (connections
refused, calls in flight cut), while the engine itself keeps running for
every other test on the machine."""
from __future__ import annotations

import os
import socket
import tempfile
import threading

from .servers import close_socket, pipe

REAL = "/var/run/docker.sock"


class DockerRelay:
    def __init__(self, target: str = REAL):
        self.target = target
        self.dir = tempfile.mkdtemp(prefix="docker-relay-")
        self.path = os.path.join(self.dir, "docker.sock")
        self.url = f"unix://{self.path}"
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ levers
    def up(self) -> "DockerRelay":
        """Start answering (again)."""
        if self._listener is not None:
            return self
        if os.path.exists(self.path):
            os.unlink(self.path)
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(self.path)
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    def down(self) -> None:
        """Stop answering: new connections are refused (the socket file goes)
        and every call in flight is cut."""
        ls, self._listener = self._listener, None
        if ls is not None:
            ls.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            close_socket(c)

    def __enter__(self) -> "DockerRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass

    # ------------------------------------------------------------------ relay
    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            if self._listener is not ls:
                close_socket(client)
                return
            try:
                engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                engine.connect(self.target)
            except OSError:
                close_socket(client)
                continue
            with self._lock:
                self._conns.update((client, engine))
            for a, b in ((client, engine), (engine, client)):
                threading.Thread(target=pipe, args=(a, b, self._forget), daemon=True).start()

    def _forget(self, a: socket.socket, b: socket.socket) -> None:
        with self._lock:
            self._conns.discard(a)
            self._conns.discard(b)

