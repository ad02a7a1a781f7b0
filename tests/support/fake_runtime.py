"""The swapper's Runtime interface in memory, for unit tests of the driver, the
lease and the fan-out without Docker.

Containers are records: created, running or exited, until removed. A model
may be given the URL of a real HTTP server (a scripted backend) that its
"container" serves at. A container that exits (killed or stopped) is told to
every `deaths()` stream, and those streams can be broken. The engine can be
taken down and brought back; creates, starts, stops and removals can be made
to fail, and a stop can be held open
(`stop_gate`) to see what happens meanwhile. Whatever it is asked to do is
recorded in `calls` (a stop twice: ("stop", m) when asked, ("stopped", m) when
it returns), and `peak` is the most containers that ever ran at once (the
one-resident invariant). Unlike Docker it does not remove a stray running
container before a start: a driver that starts too early shows in `peak`.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
from dataclasses import dataclass

from swapper.registry import ModelSpec
from swapper.runtime import Backend, BackendError, DockerUnavailable

_ids = itertools.count(1)


@dataclass
class Container:
    id: str
    model: str
    status: str = "running"       # created | running | exited
    reason: str = ""
    running_reports: int = 0      # how many more times state() says running after a kill

    @property
    def running(self) -> bool:
        return self.status == "running"


class FakeRuntime:
    def __init__(self, urls: dict[str, str] | None = None, key: str | None = None):
        self.urls = urls or {}
        self.key = key                # the backends' API key (Backend.key)
        self.containers: dict[str, Container] = {}
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.engine_up = True
        self.create_errors: dict[str, BackendError | Exception] = {}
        self.start_errors: dict[str, BackendError | Exception] = {}
        self.stop_failures = 0        # the next n stops find the engine down
        self.remove_failures = 0      # the next n removals find the engine down
        self.stop_gate: threading.Event | None = None   # set: stops wait for it
        self.peak = 0
        self.inspections = 0          # state() calls
        self._subscribers: list[queue.Queue] = []       # deaths() streams

    # ------------------------------------------------------------- test levers
    def kill(self, model: str, reason: str = "its container exited with code 137",
             reported_running: int = 0) -> None:
        """The model's container dies; Docker may go on calling it running for
        `reported_running` more looks (it does, for a few milliseconds)."""
        for c in self.containers.values():
            if c.model == model and c.running:
                c.status, c.reason, c.running_reports = "exited", reason, reported_running
                self._died(c.id)

    def _died(self, container_id: str) -> None:
        for q in list(self._subscribers):
            q.put(container_id)

    def break_events(self) -> None:
        """Every deaths() stream fails (the engine restarts)."""
        for q in list(self._subscribers):
            q.put(DockerUnavailable("fake event stream broken"))

    def leave(self, model: str, running: bool = True) -> Container:
        """A container left by an earlier run (for adoption)."""
        c = Container(f"c{next(_ids)}", model, "running" if running else "exited")
        self.containers[c.id] = c
        return c

    def running(self) -> list[Container]:
        return [c for c in self.containers.values() if c.running]

    def _record(self, what: str, subject: str) -> None:
        with self.lock:
            self.calls.append((what, subject))

    # ----------------------------------------------------------- the interface
    def _engine(self) -> None:
        if not self.engine_up:
            raise DockerUnavailable("fake engine down")

    def _backend(self, c: Container) -> Backend:
        return Backend(c.model, c.id, f"fake-{c.model}-{c.id}",
                       self.urls.get(c.model, f"http://fake-{c.model}"), self.key)

    def ping(self) -> bool:
        return self.engine_up

    def gpus_missing(self, spec: ModelSpec) -> bool:
        return False                  # the fake runs GPU models as any other

    def prepare(self, spec: ModelSpec) -> Backend:
        self._record("prepare", spec.id)
        return self._create(spec)

    def _create(self, spec: ModelSpec) -> Backend:
        if not self.engine_up:
            raise BackendError(spec.id, "could not create its container: fake engine down",
                               kind="docker_unreachable")
        err = self.create_errors.get(spec.id)
        if err is not None:
            raise err
        c = Container(f"c{next(_ids)}", spec.id, "created")
        self.containers[c.id] = c
        return self._backend(c)

    def start(self, spec: ModelSpec, on_progress=None, prepared: Backend | None = None) -> Backend:
        self._record("start", spec.id)
        if on_progress is not None:
            on_progress(1.0, f"fake: loading {spec.id}")
        backend = prepared or self._create(spec)
        if not self.engine_up:          # what it made stays (the engine cannot remove it)
            raise BackendError(spec.id, "could not start it: fake engine down",
                               kind="docker_unreachable")
        err = self.start_errors.get(spec.id)
        if err is not None:             # Docker's runtime removes what failed
            del self.containers[backend.container_id]
            raise err
        self.containers[backend.container_id].status = "running"
        self.peak = max(self.peak, len(self.running()))
        return backend

    def stop(self, backend_or_model) -> list[str]:
        target = getattr(backend_or_model, "container_id", backend_or_model)
        model = getattr(backend_or_model, "model", backend_or_model)
        self._record("stop", model)
        if self.stop_gate is not None:
            self.stop_gate.wait(10)
        if self.stop_failures:
            self.stop_failures -= 1
            raise DockerUnavailable("fake engine down")
        self._engine()
        stopped = []
        for cid, c in list(self.containers.items()):
            if cid == target or c.model == target:
                if c.running:
                    c.status, c.reason = "exited", "its container exited with code 0"
                    self._died(cid)
                stopped.append(cid)
        self._record("stopped", model)
        return stopped

    def remove(self, container_id: str) -> None:
        self._record("remove", container_id)
        if self.remove_failures:
            self.remove_failures -= 1
            raise DockerUnavailable("fake engine down")
        self._engine()
        self.containers.pop(container_id, None)

    def state(self, backend: Backend) -> tuple[bool, str]:
        self.inspections += 1
        self._engine()
        c = self.containers.get(backend.container_id)
        if c is None:
            return False, "its container is gone"
        if not c.running and c.running_reports > 0:
            c.running_reports -= 1
            return True, ""
        return c.running, c.reason

    def deaths(self):
        self._engine()
        q: queue.Queue = queue.Queue()
        self._subscribers.append(q)

        def stream():
            try:
                while True:
                    item = q.get()
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                self._subscribers.remove(q)
        return stream()

    def logs(self, model_id: str, tail: int | None = None) -> str:
        return f"fake log of {model_id}"

    def follow_logs(self, model_id: str, tail: int = 100):
        return iter([b"fake log\n"])

    def adopt(self) -> Backend | None:
        self._engine()
        keep = None
        for cid, c in list(self.containers.items()):
            if keep is None and c.running:
                keep = self._backend(c)
            else:
                del self.containers[cid]
        return keep

    def remove_all(self, keep=()) -> int:
        self._record("remove_all", ",".join(keep))
        self._engine()
        gone = [cid for cid in self.containers if cid not in keep]
        for cid in gone:
            del self.containers[cid]
        return len(gone)


class FakeSlotServer:
    """llama-server's slot API on a loopback port, writing real files: `GET
    /slots`, `/props`, `/v1/models`, `POST /slots/<id>?action=save|restore`
    ({"filename"} under `folder`, as --slot-save-path). Each slot holds
    `prompts[id]` tokens (0: never used); a saved file is that many tokens'
    bytes (`bytes_per_token`). Levers: `save_status` / `restore_status` (an
    HTTP error instead), `save_gate` (an Event saves wait for), `short_write`
    (bytes missing from a saved file while n_written tells them all),
    `die_on_restore` (the server closes the connection, as an aborting
    llama-server does). `calls` records (action, slot, filename); `restored`
    maps a slot to the tokens it got back.

    Completions too (`/v1/chat/completions`, `/v1/messages`, `/v1/responses`,
    `/completion`), as a one-slot llama-server with its RAM prompt cache: a
    prompt is its request's conversation rendered as text, one character a
    token; the slot holds `texts[0]` (prompt and answer); a prompt that does not
    continue it moves it to `ram` and takes the longest entry of `ram` it
    continues; the answer's `timings` say the tokens reused (cache_n) and
    processed (prompt_n). Saves and restores carry the slot's text. `answered`
    lists (path, body) of every completion."""

    def __init__(self, folder, slots: int = 2, model_path: str = "/models/m.gguf",
                 build: str = "b1-test", bytes_per_token: int = 100):
        import http.server
        import json as _json
        import os as _os
        from urllib.parse import parse_qs, urlparse

        self.folder = folder
        self.prompts = {i: 0 for i in range(slots)}
        self.model_path, self.build, self.bytes_per_token = model_path, build, bytes_per_token
        self.save_status = self.restore_status = 200
        self.save_gate = None       # a threading.Event: saves wait for it (30 s at most)
        self.short_write = 0
        self.die_on_restore = False
        self.calls: list[tuple[str, int, str]] = []
        self.restored: dict[int, int] = {}
        self.texts: dict[int, str] = {}
        self.ram: list[str] = []
        self.answered: list[tuple[str, dict]] = []
        self.completion_status = 200
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body):
                data = _json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = urlparse(self.path).path
                if path == "/slots":
                    out = []
                    for i, n in fake.prompts.items():
                        s = {"id": i, "n_ctx": 1024, "is_processing": False}
                        if n:
                            s.update(id_task=i, n_prompt_tokens=n)
                        out.append(s)
                    return self._send(200, out)
                if path == "/props":
                    return self._send(200, {"model_path": fake.model_path,
                                            "build_info": fake.build,
                                            "total_slots": len(fake.prompts)})
                if path == "/v1/models":
                    return self._send(200, {"data": [{"id": "m", "meta": {"n_params": 1,
                                                                           "size": 2}}]})
                if path == "/health":
                    return self._send(200, {"status": "ok"})
                self._send(404, {"error": "no"})

            def do_POST(self):
                url = urlparse(self.path)
                if url.path in ("/v1/chat/completions", "/v1/messages", "/v1/responses",
                                "/completion"):
                    n = int(self.headers.get("Content-Length") or 0)
                    body = _json.loads(self.rfile.read(n) or b"{}")
                    return self._send(*fake.complete(url.path, body))
                action = parse_qs(url.query).get("action", [""])[0]
                sid = int(url.path.rsplit("/", 1)[1])
                n = int(self.headers.get("Content-Length") or 0)
                name = _json.loads(self.rfile.read(n) or b"{}").get("filename", "")
                fake.calls.append((action, sid, name))
                path = _os.path.join(str(fake.folder), name)
                if action == "save":
                    if fake.save_gate is not None:
                        fake.save_gate.wait(30)
                    if fake.save_status != 200:
                        return self._send(fake.save_status, {"error": "cannot save"})
                    tokens = fake.prompts[sid]
                    size = 8 + tokens * fake.bytes_per_token
                    text = fake.texts.get(sid, "").encode() + b"\0"
                    with open(path, "wb") as f:
                        f.write((tokens.to_bytes(8, "little") + text
                                 + bytes([sid + 1]) * size)[:size - fake.short_write])
                    return self._send(200, {"id_slot": sid, "filename": name,
                                            "n_saved": tokens, "n_written": size})
                if action == "restore":
                    if fake.die_on_restore:
                        self.close_connection = True
                        self.connection.close()
                        return
                    if fake.restore_status != 200 or not _os.path.exists(path):
                        return self._send(400, {"error": {"message": "Unable to restore slot"}})
                    with open(path, "rb") as f:
                        data = f.read()
                    tokens = int.from_bytes(data[:8], "little")
                    fake.restored[sid] = tokens
                    fake.prompts[sid] = tokens
                    text = data[8:].split(b"\0", 1)[0].decode(errors="replace")
                    if text:
                        fake.texts[sid] = text
                    return self._send(200, {"id_slot": sid, "filename": name,
                                            "n_restored": tokens, "n_read": len(data)})
                self._send(400, {"error": "bad action"})

        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def render(path: str, body: dict) -> str:
        """A request's prompt as text (one character a token)."""
        if path == "/completion":
            return str(body.get("prompt", ""))
        head = {k: body.get(k) for k in ("system", "instructions", "tools") if k in body}
        items = body.get("input" if path == "/v1/responses" else "messages")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        import json as _json
        return _json.dumps(head, sort_keys=True) + "".join(
            "<" + _json.dumps(m, sort_keys=True) + ">" for m in items or [])

    def complete(self, path: str, body: dict) -> tuple[int, dict]:
        """llama-server's slot choice for a one-slot server with a RAM cache."""
        with self._lock:
            self.answered.append((path, body))
            if self.completion_status != 200:
                return self.completion_status, {"error": {"message": "refused"}}
            prompt = self.render(path, body)
            held = self.texts.get(0, "")
            if held and prompt.startswith(held[:max(len(held) - 1, 1)]) and \
                    _common(held, prompt) * 2 >= len(held):
                cached = _common(held, prompt)
            else:
                if held:
                    self.ram.append(held)
                best = max((t for t in self.ram if _common(t, prompt) * 4 >= len(t)),
                           key=lambda t: _common(t, prompt), default="")
                if best:
                    self.ram.remove(best)
                cached = _common(best, prompt)
            cached = min(cached, len(prompt) - 1) if prompt else 0
            n = body.get("max_tokens", body.get("max_output_tokens", body.get("n_predict", 4)))
            self.texts[0] = prompt + "#" * int(n or 1)
            self.prompts[0] = len(self.texts[0])
            return 200, {"choices": [{"message": {"content": "ok"}}],
                         "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached,
                                     "prompt_ms": float(len(prompt) - cached)}}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def _common(a: str, b: str) -> int:
    """The length of the common prefix of `a` and `b`."""
    return len(os.path.commonprefix([a, b]))


TINY_REPO = "org/SmolLM2-GGUF"      # where FakeHub.tiny_a serves the test bed's GGUF


def tiny_a_from_hub(folder) -> tuple:
    """(the test bed's GGUF, a models manifest in `folder` whose tiny-a is that file
    from FakeHub's TINY_REPO): the models a download-on-first-use test starts from."""
    from pathlib import Path as _Path
    gguf = _Path(os.environ["TESTBED_MODELS_DIR"]) / os.environ["TESTBED_MODEL_FILE"]
    manifest = _Path(folder) / "models.toml"
    manifest.write_text(f'[tiny-a]\nsource = "hf"\nrepo = "{TINY_REPO}"\n'
                        f'files = [ {{ local = "{gguf.name}", remote = "{gguf.name}" }} ]\n')
    manifest.chmod(0o644)
    return gguf, manifest


class FakeHub:
    """A stand-in for the Hugging Face Hub over HTTP (HF_ENDPOINT): serves
    `/<repo>/resolve/<rev>/<file>` with HEAD (Content-Length, X-Linked-Size, ETag
    and X-Linked-Etag: the file's sha256, as the Hub's for an LFS file;
    X-Repo-Commit: the commit of the file's version) and Range GETs honouring
    If-Range, as the Hub does. `<rev>` is `main` (the current version) or a
    commit (that version, also after `replace`; another is a 404). `files` maps
    "repo/path" to bytes or a file Path. Levers: `rate` (bytes/s, to watch
    progress), `status` (an HTTP status every request gets, e.g. 401 for a gated
    repo), `reset_after` (bytes after which a GET's connection is cut), `token`
    (required when set), `replace(key, data)` (a new version upstream), `lie`
    (the sha256 told is not the bytes'). `requests` lists (method, path, range)
    as they came; `if_ranges` the If-Range values; `peak_sending` the most GET
    bodies sent at once. `host`: the address it
    listens on (0.0.0.0: containers reach it at host.docker.internal:`port`)."""

    def __init__(self, files: dict, rate: float | None = None, host: str = "127.0.0.1"):
        import http.server
        import socketserver
        import time as _time
        self.files = files
        self.rate = rate
        self.status: int | None = None
        self.reset_after: int | None = None
        self.token: str | None = None
        self.lie = False
        self.requests: list[tuple[str, str, str | None]] = []
        self.if_ranges: list[str | None] = []
        self.sending = 0                # GET bodies being sent now, and the most at once
        self.peak_sending = 0
        self._count = threading.Lock()
        self.old: dict[tuple[str, str], bytes] = {}     # (key, commit) -> an old version
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self):
                parts = self.path.split("/resolve/", 1)
                if len(parts) != 2:
                    return None
                repo, rest = parts[0].lstrip("/"), parts[1]
                rev, _, path = rest.partition("/")
                key = f"{repo}/{path}"
                data = hub.data(key)
                if data is None or rev in ("main", FakeHub.commit(data)):
                    return data
                return hub.old.get((key, rev))

            def _refuse(self, status, text):
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Error-Code", "GatedRepo" if status == 401 else "EntryNotFound")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _answer(self, head: bool):
                rng = self.headers.get("Range")
                hub.requests.append((self.command, self.path, rng))
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._refuse(401, "Access to model is restricted: gated repo")
                if hub.status:
                    return self._refuse(hub.status, f"status {hub.status}")
                data = self._body()
                if data is None:
                    return self._refuse(404, "Entry not found")
                start = 0
                etag = '"%s"' % FakeHub.sha256(b"lie" + data if hub.lie else data)
                if_range = self.headers.get("If-Range")
                hub.if_ranges.append(if_range)
                if rng and rng.startswith("bytes=") and if_range in (None, etag):
                    start = int(rng[6:].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("ETag", etag)
                self.send_header("X-Linked-Etag", etag)
                self.send_header("X-Repo-Commit", FakeHub.commit(data))
                self.send_header("Accept-Ranges", "bytes")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                with hub._count:
                    hub.sending += 1
                    hub.peak_sending = max(hub.peak_sending, hub.sending)
                try:
                    self._send_body(data, start)
                finally:
                    with hub._count:
                        hub.sending -= 1

            def _send_body(self, data, start):
                sent, pos, step = 0, start, 256 * 1024
                while pos < len(data):
                    if hub.reset_after is not None and sent >= hub.reset_after:
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    chunk = data[pos:pos + step]
                    self.wfile.write(chunk)
                    pos += len(chunk)
                    sent += len(chunk)
                    if hub.rate and pos < len(data):    # none after the last byte
                        _time.sleep(len(chunk) / hub.rate)

            def do_HEAD(self):
                self._answer(True)

            def do_GET(self):
                self._answer(False)

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def sha256(data: bytes) -> str:
        import hashlib
        return hashlib.sha256(data).hexdigest()

    @staticmethod
    def commit(data: bytes) -> str:
        """The commit of a file's version (40 hex digits, like the Hub's)."""
        import hashlib
        return hashlib.sha1(b"commit " + data).hexdigest()

    def data(self, key: str) -> bytes | None:
        from pathlib import Path as _Path
        data = self.files.get(key)
        return data.read_bytes() if isinstance(data, _Path) else data

    def replace(self, key: str, data: bytes) -> None:
        """A new version of `key` upstream; the old one stays at its commit."""
        old = self.data(key)
        if old is not None:
            self.old[(key, FakeHub.commit(old))] = old
        self.files[key] = data

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
