"""Docker effects: create a backend's container, start it and wait until it is
healthy, stop it, remove it, read its logs, adopt or reap what an earlier run
left. The only module that talks to the Docker engine. Every container it
creates carries the stack's labels (and a name of its own: the next model's
container is created while the previous one, maybe of the same model, stops);
it never touches a container without them.

A swap is split so that its slow steps overlap (the driver orders them):
`prepare` creates the next container (no port is bound, no GPU held before
`start`) while `stop` stops the old one; `start` runs only after `stop`
returned, and `remove` of the old container happens afterwards, off the
critical path. `start` itself still refuses to run next to another running
backend of this stack: whatever runs is removed first (never two).

Errors: every failure to start becomes a BackendError naming the model, its
cause (a key of common.failures.CAUSES: load_failed, load_timeout,
docker_unreachable) and, where a container existed, its last log lines. An
engine that does not answer raises DockerUnavailable from any method; the
client is made on first use, so a swapper starts (degraded) without Docker.

`Runtime` is the interface the driver acts through; DockerRuntime implements it
on the Docker SDK, the unit tests' fake in memory.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Protocol

import docker
import docker.errors
import docker.types
import docker.utils
import requests
from werkzeug.datastructures import Headers

from . import hostdir, kvcache
from .registry import ModelSpec, Registry
from .settings import Settings

log = logging.getLogger("swapper.runtime")

LABEL_STACK = "org.coding-stack.stack"
LABEL_MODEL = "org.coding-stack.model"
LABEL_ROLE = "org.coding-stack.role"

# Health polling while a backend starts: every HEALTH_INTERVAL at first, then
# (a load that takes longer is a big one) every SLOW_POLL_INTERVAL.
FAST_POLL_SECONDS = 3.0
SLOW_POLL_INTERVAL = 0.05
# How long a start waits for the published port of the container stopped just before.
PORT_WAIT_SECONDS = 1.0


class BackendError(Exception):
    """A backend could not be started. `kind` is its cause in common.failures."""

    def __init__(self, model: str, cause: str, logs: str = "", kind: str = "load_failed"):
        msg = f"model '{model}': {cause}"
        if logs.strip():
            msg += "\n--- last log lines of the backend container ---\n" + logs.rstrip()
        super().__init__(msg)
        self.model, self.cause, self.logs, self.kind = model, cause, logs, kind


class DockerUnavailable(Exception):
    """The Docker engine did not answer (socket missing, daemon down or restarting)."""

    def __init__(self, detail: str):
        super().__init__(f"the Docker engine is unreachable ({detail}); "
                         "is /var/run/docker.sock mounted and dockerd running?")


@dataclass(frozen=True)
class Backend:
    """A running backend container and how to reach it (`key`: its API key,
    which the swapper adds to all it sends it; never shown)."""
    model: str
    container_id: str
    name: str
    url: str
    key: str | None = field(default=None, repr=False, compare=False)
    # seconds its start waited for its health (set once it is ready)
    healthy_seconds: float | None = field(default=None, repr=False, compare=False)


# Where each kind of backend reads its API key (its --api-key, from the
# environment: not in the command line that `docker ps` and the container's
# processes show).
KEY_ENV = {"llamacpp": "LLAMA_API_KEY", "vllm": "VLLM_API_KEY"}


def auth_headers(backend: Backend | None) -> dict:
    """What proves the swapper to `backend` (nothing for one without a key)."""
    key = getattr(backend, "key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def with_backend_key(headers, backend: Backend | None):
    """A request's forwarded headers for `backend`: the client's own credentials
    (Authorization, X-Api-Key: the proxy's API_KEY) replaced by the backend's key."""
    key = getattr(backend, "key", None)
    if not key:
        return headers
    out = Headers([(k, v) for k, v in headers.items()
                   if k.lower() not in ("authorization", "x-api-key")])
    out["Authorization"] = f"Bearer {key}"
    return out


def container_key(attrs: dict, kind: str) -> str | None:
    """The API key a container of this stack was created with (its environment)."""
    name = KEY_ENV.get(kind)
    for item in (attrs.get("Config") or {}).get("Env") or []:
        k, _, v = item.partition("=")
        if k == name:
            return v or None
    return None


def _docker_cause(model: ModelSpec, err: Exception, settings: Settings) -> str:
    """Docker's error in words a user can act on."""
    text = str(getattr(err, "explanation", None) or err)
    low = text.lower()
    if "could not select device driver" in low or "nvidia" in low and "gpu" in low:
        return (f"it needs GPU(s) {', '.join(model.gpus)} but this Docker engine has no GPU "
                f"runtime (install the NVIDIA Container Toolkit and restart Docker): {text}")
    if "port is already allocated" in low or "address already in use" in low:
        return (f"host port {settings.BACKEND_BIND}:{settings.BACKEND_PUBLISH_PORT} is already in use "
                f"by another process (set BACKEND_PUBLISH_PORT): {text}")
    if "no such image" in low or "pull access denied" in low or "manifest unknown" in low:
        return f"image '{model.image}' is not available: {text}"
    if "bind source path does not exist" in low or "invalid mount" in low:
        return f"a volume of the model is wrong (does the model folder exist?): {text}"
    return f"docker refused to start it: {text}"


Progress = Callable[[float, str], None]   # (seconds since start, last log line)


class Runtime(Protocol):
    """What the driver needs from a container engine."""

    def ping(self) -> bool: ...
    def gpus_missing(self, spec: ModelSpec) -> bool: ...
    def prepare(self, spec: ModelSpec) -> "Backend | None": ...
    def start(self, spec: ModelSpec, on_progress: "Progress | None" = None,
              prepared: "Backend | None" = None) -> "Backend": ...
    def stop(self, backend_or_model: "Backend | str") -> list[str]: ...
    def remove(self, container_id: str) -> None: ...
    def state(self, backend: "Backend") -> tuple[bool, str]: ...
    def deaths(self) -> Iterator[str]: ...
    def logs(self, model_id: str, tail: int | None = None) -> str: ...
    def follow_logs(self, model_id: str, tail: int = 100) -> Iterator[bytes]: ...
    def adopt(self) -> "Backend | None": ...
    def remove_all(self, keep: "Collection[str]" = ()) -> int: ...


@contextmanager
def _engine():
    """Turn 'the engine does not answer' into DockerUnavailable; API errors
    (the engine answered no) pass through."""
    try:
        yield
    except DockerUnavailable:
        raise
    except (docker.errors.APIError, docker.errors.ImageNotFound, docker.errors.NotFound):
        raise
    except (docker.errors.DockerException, requests.exceptions.ConnectionError,
            requests.exceptions.Timeout, FileNotFoundError, ConnectionError) as e:
        raise DockerUnavailable(str(e)[:200]) from None


class DockerRuntime:
    def __init__(self, settings: Settings, registry: Registry,
                 client: docker.DockerClient | None = None):
        self.settings = settings
        self.registry = registry
        self._client = client
        self._host_dir: str | None = None
        self._http = requests.Session()
        self._http.trust_env = False
        # The backends' key: BACKEND_API_KEY, else a secret of this run's (never logged).
        self._key = settings.BACKEND_API_KEY or secrets.token_urlsafe(32)

    @property
    def client(self) -> docker.DockerClient:
        """The engine's client, made on first use (and again after a failure to
        make it: the engine may come up after the swapper)."""
        if self._client is None:
            with _engine():
                self._client = docker.from_env(timeout=60)
        return self._client

    @property
    def host_dir(self) -> str:
        """HOST_DIR, else the compose project folder (asked of the engine on
        first use: the engine may be down when the swapper starts)."""
        if self._host_dir is None:
            self._host_dir = hostdir.host_dir(self.settings, lambda: self.client)
        return self._host_dir

    # ----------------------------------------------------------------- naming
    @property
    def labels_filter(self) -> dict:
        return {"label": f"{LABEL_STACK}={self.settings.STACK_NAME}"}

    def container_name(self, model_id: str) -> str:
        """A fresh name for a container of the model: the next one is created
        while the last one (maybe of the same model) still exists."""
        return f"{self.settings.STACK_NAME}-backend-{model_id}-{secrets.token_hex(3)}"

    def _url(self, spec: ModelSpec, name: str) -> str:
        if self.settings.DOCKER_NETWORK:
            return f"http://{name}:{spec.port}"
        return f"http://{self.settings.BACKEND_HOST}:{self.settings.BACKEND_PUBLISH_PORT}"

    # ---------------------------------------------------------------- inspect
    def ping(self) -> bool:
        try:
            with _engine():
                return bool(self.client.ping())
        except Exception:
            return False

    def gpus_missing(self, spec: ModelSpec) -> bool:
        """True when `spec` needs GPUs and this engine has no NVIDIA runtime: its
        start fails (with the GPU message), so its files are not downloaded
        first. False when it needs none, or the engine cannot be asked."""
        if not spec.gpus:
            return False
        try:
            with _engine():
                runtimes = self.client.info().get("Runtimes") or {}
        except Exception:  # noqa: BLE001 - cannot tell: the start will say
            return False
        return "nvidia" not in runtimes

    def containers(self) -> list:
        """This stack's backend containers, running or not."""
        with _engine():
            return self.client.containers.list(all=True, filters=self.labels_filter,
                                              ignore_removed=True)

    def state(self, backend: Backend) -> tuple[bool, str]:
        """(running, reason): whether the backend's container still runs.
        Raises DockerUnavailable when the engine cannot say."""
        try:
            with _engine():
                st = self.client.api.inspect_container(backend.container_id).get("State", {})
        except docker.errors.NotFound:
            return False, "its container is gone"
        if st.get("Running"):
            return True, ""
        reason = f"its container exited with code {st.get('ExitCode')}"
        if st.get("OOMKilled"):
            reason += " (killed: out of memory)"
        return False, reason

    def deaths(self) -> Iterator[str]:
        """The ids of this stack's containers as they exit (Docker's `die`
        events), subscribed before it returns. The iteration ends or raises
        when the stream breaks (an engine that restarts). Raises
        DockerUnavailable when the engine does not answer."""
        with _engine():
            stream = self.client.events(decode=True, filters={
                **self.labels_filter, "type": "container", "event": "die"})
        return (ev.get("id", "") for ev in stream)

    def logs(self, model_id: str, tail: int | None = None) -> str:
        c = self._find(model_id)
        if c is None:
            return ""
        return self._tail(c.id, tail)

    def follow_logs(self, model_id: str, tail: int = 100) -> Iterator[bytes]:
        c = self._find(model_id)
        if c is None:
            return iter(())
        with _engine():
            return c.logs(stream=True, follow=True, tail=tail)

    def _find(self, model_id: str):
        """The model's running container, else its newest one (a stopped one
        may wait for removal next to it)."""
        mine = [c for c in self.containers() if c.labels.get(LABEL_MODEL) == model_id]
        return next((c for c in mine if c.status == "running"), mine[0] if mine else None)

    def _tail(self, container_id: str, tail: int | None = None) -> str:
        try:
            with _engine():
                out = self.client.api.logs(container_id, tail=tail or self.settings.LOG_TAIL)
            return out.decode("utf-8", "replace")
        except Exception:           # logs are a courtesy: never fail over them
            return ""

    # ------------------------------------------------------------------ start
    def prepare(self, spec: ModelSpec) -> Backend | None:
        """Create the model's container without starting it (binds no port,
        holds no GPU): the part of a start that may overlap a stop. None when
        its image is not here yet (the load pulls it, telling its progress).
        Raises BackendError like start()."""
        try:
            if not self._has_image(spec):
                return None
            return self._create(spec)
        except DockerUnavailable as e:
            raise BackendError(spec.id, f"could not create its container: {e}",
                               kind="docker_unreachable") from None

    def start(self, spec: ModelSpec, on_progress: Progress | None = None,
              prepared: Backend | None = None) -> Backend:
        """Start the model's container (the `prepared` one, else a new one) and
        return once it is healthy, telling `on_progress` twice a second how it
        goes. Any other running backend of this stack is removed first.
        Raises BackendError (DockerUnavailable becomes one of kind
        docker_unreachable); the container is removed on failure when the
        engine answers (else it is left to the driver's sweep or adoption)."""
        try:
            return self._start(spec, on_progress, prepared)
        except DockerUnavailable as e:
            raise BackendError(spec.id, f"could not start it: {e}",
                               kind="docker_unreachable") from None

    def _create(self, spec: ModelSpec) -> Backend:
        self._ensure_image(spec)
        name = self.container_name(spec.id)
        try:
            with _engine():
                container = self.client.containers.create(**self._create_args(spec, name))
        except docker.errors.APIError as e:
            self._remove_quietly(name)
            raise BackendError(spec.id, _docker_cause(spec, e, self.settings)) from None
        return Backend(spec.id, container.id, name, self._url(spec, name),
                       self._key if spec.kind in KEY_ENV else None)

    def _start(self, spec: ModelSpec, on_progress: Progress | None,
               prepared: Backend | None) -> Backend:
        backend = prepared or self._create(spec)
        try:
            self._remove_running(but=backend.container_id)      # never two
            self._start_container(spec, backend)
            t0 = time.monotonic()
            self._wait_ready(spec, backend, on_progress)
            backend = dataclasses.replace(backend, healthy_seconds=time.monotonic() - t0)
        except BaseException:
            try:
                self._remove_quietly(backend.container_id)
            except DockerUnavailable:
                pass
            raise
        return backend

    def _start_container(self, spec: ModelSpec, backend: Backend) -> None:
        """`docker start`. The engine marks a container stopped (and `docker
        stop` returns) just before it releases that container's network, so
        the published port of the one stopped a moment ago may still be held:
        a port conflict is tried again for up to PORT_WAIT_SECONDS."""
        deadline = time.monotonic() + PORT_WAIT_SECONDS
        while True:
            try:
                with _engine():
                    self.client.api.start(backend.container_id)
                return
            except docker.errors.APIError as e:
                text = str(e).lower()
                busy = "port is already allocated" in text or "address already in use" in text
                if not busy or time.monotonic() >= deadline:
                    raise BackendError(spec.id, _docker_cause(spec, e, self.settings),
                                       self._tail(backend.container_id)) from None
            time.sleep(0.05)

    def _remove_running(self, but: str) -> None:
        """Remove every running backend of this stack but `but` (none should run
        when the driver starts one: this is the last guard of the invariant)."""
        with _engine():
            running = self.client.api.containers(
                quiet=True, filters={**self.labels_filter, "status": "running"})
        for c in running:
            if c["Id"] != but:
                log.error("backend container %s still runs: removing it before starting "
                          "another", c["Id"][:12])
                self.remove(c["Id"])

    def _create_args(self, spec: ModelSpec, name: str) -> dict:
        s = self.settings
        command, volumes = list(spec.args), list(spec.volumes)
        kv = kvcache.backend_mount(s, spec)      # its prompt cache folder (swapper/kvcache.py)
        if kv is not None:
            volumes.append(kv[0])
            command += kv[1]
        args: dict = {
            "image": spec.image,
            "command": command,
            "name": name,
            "labels": {LABEL_STACK: s.STACK_NAME, LABEL_MODEL: spec.id, LABEL_ROLE: "backend"},
            "environment": {**spec.env, **({KEY_ENV[spec.kind]: self._key}
                                            if spec.kind in KEY_ENV else {})},
            "volumes": [self._volume(v) for v in volumes],
            "ports": {f"{spec.port}/tcp": (s.BACKEND_BIND, s.BACKEND_PUBLISH_PORT)},
        }
        if spec.healthcheck:
            args["healthcheck"] = {
                "test": list(spec.healthcheck),
                "interval": 5_000_000_000, "timeout": 3_000_000_000,
                "retries": 3, "start_period": int(spec.start_timeout * 1e9),
            }
        if spec.gpus:
            if list(spec.gpus) == ["all"]:
                req = docker.types.DeviceRequest(driver="nvidia", count=-1, capabilities=[["gpu"]])
            else:
                req = docker.types.DeviceRequest(driver="nvidia", device_ids=list(spec.gpus),
                                                 capabilities=[["gpu"]])
            args["device_requests"] = [req]
        if spec.user:
            args["user"] = spec.user
        if s.DOCKER_NETWORK:
            args["network"] = s.DOCKER_NETWORK
        if spec.shm_size:
            args["shm_size"] = spec.shm_size
        if spec.ipc_mode:
            args["ipc_mode"] = spec.ipc_mode
        return args

    def _volume(self, volume: str) -> str:
        """Relative host paths resolve against HOST_DIR; named volumes stay named."""
        source, sep, rest = volume.partition(":")
        if source.startswith("./") or source.startswith("../") or source in (".", ".."):
            source = os.path.normpath(os.path.join(self.host_dir, source))
        elif source.startswith("~"):
            source = os.path.expanduser(source)
        return source + sep + rest

    def image_id(self, image: str) -> str | None:
        """The id of the local image `image` (what a saved prompt cache is tied to)."""
        try:
            with _engine():
                return self.client.images.get(image).id
        except docker.errors.ImageNotFound:
            return None

    def _has_image(self, spec: ModelSpec) -> bool:
        try:
            with _engine():
                self.client.images.get(spec.image)
            return True
        except docker.errors.ImageNotFound:
            return False
        except docker.errors.APIError as e:
            raise BackendError(spec.id, f"cannot inspect image '{spec.image}': {e}") from None

    def _ensure_image(self, spec: ModelSpec) -> None:
        if self._has_image(spec):
            return
        if not self.settings.PULL_IMAGES:
            raise BackendError(spec.id, f"image '{spec.image}' is not present and PULL_IMAGES=0")
        repo, tag = docker.utils.parse_repository_tag(spec.image)
        log.info("model %s: pulling image %s (once)", spec.id, spec.image)
        last = 0.0
        try:
            for ev in self.client.api.pull(repo, tag=tag or "latest", stream=True, decode=True):
                if "error" in ev:
                    raise docker.errors.APIError(ev["error"])
                if time.monotonic() - last > 5:
                    last = time.monotonic()
                    log.info("model %s: pull %s: %s %s", spec.id, spec.image,
                             ev.get("status", ""), ev.get("progress", ""))
        except (docker.errors.APIError, requests.RequestException) as e:
            raise BackendError(spec.id, f"could not pull image '{spec.image}': {e}") from None
        log.info("model %s: pulled %s", spec.id, spec.image)

    def _wait_ready(self, spec: ModelSpec, backend: Backend,
                    on_progress: Progress | None = None) -> None:
        """Ready = container running AND HTTP health 200 (llama.cpp answers 503
        while loading; vLLM refuses connections until ready). Health is polled
        every HEALTH_INTERVAL for the first FAST_POLL_SECONDS (a small model is
        ready in well under a second), then every SLOW_POLL_INTERVAL (a vLLM
        cold start takes minutes)."""
        s = self.settings
        started = time.monotonic()
        deadline = started + spec.start_timeout
        next_inspect = started
        url = backend.url + spec.health_path
        while True:
            now = time.monotonic()
            if now >= next_inspect:
                next_inspect = now + 0.5
                running, reason = self.state(backend)
                if not running:
                    raise BackendError(spec.id, f"failed to start: {reason}",
                                       self._tail(backend.container_id))
                if on_progress is not None and now - started >= 1.0:
                    lines = self._tail(backend.container_id, 1).strip().splitlines()
                    on_progress(now - started, lines[-1][:200] if lines else "")
            try:
                r = self._http.get(url, timeout=(1.0, 2.0), headers=auth_headers(backend))
                if r.status_code == 200:
                    log.info("model %s ready in %.1f s", spec.id, time.monotonic() - started)
                    return
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise BackendError(
                    spec.id,
                    f"not healthy within its start timeout of {spec.start_timeout:g} s "
                    f"({url} never answered 200)", self._tail(backend.container_id),
                    kind="load_timeout")
            fast = time.monotonic() - started < FAST_POLL_SECONDS
            time.sleep(s.HEALTH_INTERVAL if fast else max(s.HEALTH_INTERVAL, SLOW_POLL_INTERVAL))

    # ------------------------------------------------------------------- stop
    def stop(self, backend_or_model: Backend | str, timeout: float | None = None) -> list[str]:
        """Graceful stop (SIGTERM, then SIGKILL after the timeout) of the
        backend, or of every container of the model; returns once none of them
        runs, with the ids of the stopped containers (still to be removed: a
        stopped container holds no GPU and no port). One that would not stop
        is removed by force. Raises DockerUnavailable (or APIError) when it
        cannot be sure."""
        if isinstance(backend_or_model, Backend):
            ids, model = [backend_or_model.container_id], backend_or_model.model
        else:
            model = backend_or_model
            ids = [c.id for c in self.containers() if c.labels.get(LABEL_MODEL) == model]
        spec = self.registry.models.get(model)
        t = timeout if timeout is not None else (spec.stop_timeout if spec else 10)
        stopped = []
        for cid in ids:
            try:
                with _engine():
                    self.client.api.stop(cid, timeout=int(max(t, 0)))
            except docker.errors.NotFound:
                continue
            except docker.errors.APIError as e:
                log.warning("stopping %s: %s (removing it by force)", cid[:12], e)
                self.remove(cid)
                continue
            stopped.append(cid)
        return stopped

    def remove(self, container_id: str) -> None:
        """Remove a container (by force); returns once it is gone (removal is
        synchronous in the engine, unless another removal of it was already
        under way). Raises DockerUnavailable or APIError when it is not gone."""
        try:
            with _engine():
                self.client.api.remove_container(container_id, force=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise
        for _ in range(100):
            try:
                with _engine():
                    self.client.api.inspect_container(container_id)
            except docker.errors.NotFound:
                return
            time.sleep(0.1)
        raise docker.errors.APIError(f"container {container_id[:12]} is still being removed")

    def _remove_quietly(self, name_or_id: str) -> None:
        """remove(), logging an engine's refusal (DockerUnavailable still raises)."""
        try:
            self.remove(name_or_id)
        except docker.errors.APIError as e:
            log.warning("removing %s: %s", name_or_id, e)

    def remove_all(self, keep: Collection[str] = ()) -> int:
        """Remove every container of this stack but those in `keep`. Returns how
        many it removed; raises (after trying them all) if one would not go."""
        found = [c for c in self.containers() if c.id not in keep]
        error: Exception | None = None
        for c in found:
            log.info("removing backend container %s (%s)", c.name, c.status)
            try:
                self.remove(c.id)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        return len(found)

    # ------------------------------------------------------------------ adopt
    def running(self) -> list[Backend]:
        """This stack's running backends of registered models, as they are (at
        shutdown: their prompt caches are saved before they are removed)."""
        out = []
        for c in self.containers():
            spec = self.registry.models.get(c.labels.get(LABEL_MODEL, ""))
            if spec is not None and c.status == "running":
                out.append(Backend(spec.id, c.id, c.name, self._url(spec, c.name),
                                   container_key(c.attrs, spec.kind)))
        return out

    def adopt(self) -> Backend | None:
        """At start-up: keep one healthy, registered, running backend of this
        stack (reachable where we would have put it); remove all the others."""
        keep: Backend | None = None
        for c in self.containers():
            model = c.labels.get(LABEL_MODEL, "")
            spec = self.registry.models.get(model)
            if keep is None and spec is not None and c.status == "running" \
                    and self._key_fits(spec, c):
                b = Backend(model, c.id, c.name, self._url(spec, c.name),
                            container_key(c.attrs, spec.kind))
                try:
                    if self._http.get(b.url + spec.health_path, timeout=(1.0, 2.0),
                                      headers=auth_headers(b)).status_code == 200:
                        keep = b
                        if b.key and not self.settings.BACKEND_API_KEY:
                            self._key = b.key
                        log.info("adopted running backend %s (model %s)", c.name, model)
                        continue
                except requests.RequestException:
                    pass
            log.info("removing orphan backend container %s (model %r, %s)", c.name, model, c.status)
            self._remove_quietly(c.id)
        return keep

    def _key_fits(self, spec: ModelSpec, container) -> bool:
        """May this running container of an earlier run be adopted, as far as its
        key goes? One without a key is an open door (removed); with another key
        than BACKEND_API_KEY, removed; else kept, and this run's key becomes its
        own when none is configured (adopt: the backends of one run share one)."""
        if spec.kind not in KEY_ENV:
            return True
        key = container_key(container.attrs, spec.kind)
        if not key or (self.settings.BACKEND_API_KEY and key != self.settings.BACKEND_API_KEY):
            log.info("not adopting %s: %s", container.name,
                     "it has no API key" if not key else "its API key is not BACKEND_API_KEY")
            return False
        return True
