"""Docker effects: start a backend and wait until it is healthy, stop it, read
its logs, adopt or reap what an earlier run left. The only module that talks to
the Docker engine. Every container it creates carries the stack's labels; it
never touches a container without them.

Errors: every failure becomes a BackendError naming the model, the cause and
(where a container existed) its last log lines.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

import docker
import docker.errors
import docker.types
import docker.utils
import requests

from . import hostdir
from .registry import ModelSpec, Registry
from .settings import Settings

log = logging.getLogger("swapper.runtime")

LABEL_STACK = "org.coding-stack.stack"
LABEL_MODEL = "org.coding-stack.model"
LABEL_ROLE = "org.coding-stack.role"


class BackendError(Exception):
    """A backend could not be started or died. `status` is the HTTP status to answer."""

    def __init__(self, model: str, cause: str, logs: str = "", status: int = 502):
        msg = f"model '{model}': {cause}"
        if logs.strip():
            msg += "\n--- last log lines of the backend container ---\n" + logs.rstrip()
        super().__init__(msg)
        self.model, self.cause, self.logs, self.status = model, cause, logs, status


@dataclass(frozen=True)
class Backend:
    """A running backend container and how to reach it."""
    model: str
    container_id: str
    name: str
    url: str


def _docker_cause(model: ModelSpec, err: Exception, settings: Settings) -> str:
    """Docker's error in words a user can act on."""
    text = str(getattr(err, "explanation", None) or err)
    low = text.lower()
    if "could not select device driver" in low or "nvidia" in low and "gpu" in low:
        return (f"it needs GPU(s) {', '.join(model.gpus)} but this Docker engine has no GPU "
                f"runtime (install the NVIDIA Container Toolkit and restart Docker): {text}")
    if "port is already allocated" in low or "address already in use" in low:
        return (f"host port {settings.publish_bind}:{settings.publish_port} is already in use "
                f"by another process (set BACKEND_PUBLISH_PORT): {text}")
    if "no such image" in low or "pull access denied" in low or "manifest unknown" in low:
        return f"image '{model.image}' is not available: {text}"
    if "bind source path does not exist" in low or "invalid mount" in low:
        return f"a volume of the model is wrong (does the model folder exist?): {text}"
    return f"docker refused to start it: {text}"


class DockerRuntime:
    def __init__(self, settings: Settings, registry: Registry,
                 client: docker.DockerClient | None = None):
        self.settings = settings
        self.registry = registry
        self.client = client or docker.from_env(timeout=60)
        self.settings = hostdir.resolved(settings, self.client)   # HOST_DIR, else compose's folder
        self._http = requests.Session()

    # ----------------------------------------------------------------- naming
    @property
    def labels_filter(self) -> dict:
        return {"label": f"{LABEL_STACK}={self.settings.stack_name}"}

    def container_name(self, model_id: str) -> str:
        return f"{self.settings.stack_name}-backend-{model_id}"

    def _url(self, spec: ModelSpec, name: str) -> str:
        if self.settings.docker_network:
            return f"http://{name}:{spec.port}"
        return f"http://{self.settings.backend_host}:{self.settings.publish_port}"

    # ---------------------------------------------------------------- inspect
    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def containers(self) -> list:
        """This stack's backend containers, running or not."""
        return self.client.containers.list(all=True, filters=self.labels_filter)

    def state(self, backend: Backend) -> tuple[bool, str]:
        """(running, reason): whether the backend's container still runs."""
        try:
            c = self.client.containers.get(backend.container_id)
        except docker.errors.NotFound:
            return False, "its container is gone"
        st = c.attrs.get("State", {})
        if st.get("Running"):
            return True, ""
        reason = f"its container exited with code {st.get('ExitCode')}"
        if st.get("OOMKilled"):
            reason += " (killed: out of memory)"
        return False, reason

    def logs(self, model_id: str, tail: int | None = None) -> str:
        c = self._find(model_id)
        if c is None:
            return ""
        return self._tail(c, tail)

    def follow_logs(self, model_id: str, tail: int = 100) -> Iterator[bytes]:
        c = self._find(model_id)
        if c is None:
            return iter(())
        return c.logs(stream=True, follow=True, tail=tail)

    def _find(self, model_id: str):
        for c in self.containers():
            if c.labels.get(LABEL_MODEL) == model_id:
                return c
        return None

    def _tail(self, container, tail: int | None = None) -> str:
        try:
            return container.logs(tail=tail or self.settings.log_tail).decode("utf-8", "replace")
        except docker.errors.APIError:
            return ""

    # ------------------------------------------------------------------ start
    def start(self, spec: ModelSpec) -> Backend:
        """Create and start the model's container; return once it is healthy."""
        self.remove_all()               # never two: whatever of ours exists goes first
        self._ensure_image(spec)
        name = self.container_name(spec.id)
        try:
            container = self.client.containers.run(detach=True, **self._create_args(spec, name))
        except docker.errors.APIError as e:
            self._remove_quietly(name)
            raise BackendError(spec.id, _docker_cause(spec, e, self.settings)) from None
        backend = Backend(spec.id, container.id, name, self._url(spec, name))
        try:
            self._wait_ready(spec, container, backend)
        except BaseException:
            self._remove_quietly(container.id)
            raise
        return backend

    def _create_args(self, spec: ModelSpec, name: str) -> dict:
        s = self.settings
        args: dict = {
            "image": spec.image,
            "command": list(spec.args),
            "name": name,
            "labels": {LABEL_STACK: s.stack_name, LABEL_MODEL: spec.id, LABEL_ROLE: "backend"},
            "environment": dict(spec.env),
            "volumes": [self._volume(v) for v in spec.volumes],
            "ports": {f"{spec.port}/tcp": (s.publish_bind, s.publish_port)},
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
        if s.docker_network:
            args["network"] = s.docker_network
        if spec.shm_size:
            args["shm_size"] = spec.shm_size
        if spec.ipc_mode:
            args["ipc_mode"] = spec.ipc_mode
        return args

    def _volume(self, volume: str) -> str:
        """Relative host paths resolve against HOST_DIR; named volumes stay named."""
        source, sep, rest = volume.partition(":")
        if source.startswith("./") or source.startswith("../") or source in (".", ".."):
            source = os.path.normpath(os.path.join(self.settings.host_dir, source))
        elif source.startswith("~"):
            source = os.path.expanduser(source)
        return source + sep + rest

    def _ensure_image(self, spec: ModelSpec) -> None:
        try:
            self.client.images.get(spec.image)
            return
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError as e:
            raise BackendError(spec.id, f"cannot inspect image '{spec.image}': {e}") from None
        if not self.settings.pull_images:
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

    def _wait_ready(self, spec: ModelSpec, container, backend: Backend) -> None:
        """Ready = container running AND HTTP health 200 (llama.cpp answers 503
        while loading; vLLM refuses connections until ready)."""
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
                    raise BackendError(spec.id, f"failed to start: {reason}", self._tail(container))
            try:
                r = self._http.get(url, timeout=(1.0, 2.0))
                if r.status_code == 200:
                    log.info("model %s ready in %.1f s", spec.id, time.monotonic() - started)
                    return
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise BackendError(
                    spec.id,
                    f"not healthy within its start timeout of {spec.start_timeout:g} s "
                    f"({url} never answered 200)", self._tail(container), status=504)
            time.sleep(s.health_interval)

    # ------------------------------------------------------------------- stop
    def stop(self, backend_or_model: Backend | str, timeout: float | None = None) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after the timeout), then remove;
        returns once the container is gone."""
        if isinstance(backend_or_model, Backend):
            target, model = backend_or_model.container_id, backend_or_model.model
        else:
            model = backend_or_model
            c = self._find(model)
            if c is None:
                return
            target = c.id
        spec = self.registry.models.get(model)
        t = timeout if timeout is not None else (spec.stop_timeout if spec else 10)
        try:
            self.client.api.stop(target, timeout=int(max(t, 0)))
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:
            log.warning("stopping %s: %s (removing it by force)", target, e)
        self._remove_quietly(target)

    def _remove_quietly(self, name_or_id: str) -> None:
        """Remove a container; returns once it is gone (removal is synchronous in
        the engine, unless another removal of it was already under way)."""
        try:
            self.client.api.remove_container(name_or_id, force=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                log.warning("removing %s: %s", name_or_id, e)
        for _ in range(100):
            try:
                self.client.api.inspect_container(name_or_id)
            except docker.errors.NotFound:
                return
            time.sleep(0.1)

    def remove_all(self) -> int:
        """Remove every container of this stack. Returns how many there were."""
        found = self.containers()
        for c in found:
            log.info("removing backend container %s (%s)", c.name, c.status)
            self._remove_quietly(c.id)
        return len(found)

    # ------------------------------------------------------------------ adopt
    def adopt(self) -> Backend | None:
        """At start-up: keep one healthy, registered, running backend of this
        stack (reachable where we would have put it); remove all the others."""
        keep: Backend | None = None
        for c in self.containers():
            model = c.labels.get(LABEL_MODEL, "")
            spec = self.registry.models.get(model)
            if keep is None and spec is not None and c.status == "running":
                b = Backend(model, c.id, c.name, self._url(spec, c.name))
                try:
                    if self._http.get(b.url + spec.health_path, timeout=(1.0, 2.0)).status_code == 200:
                        keep = b
                        log.info("adopted running backend %s (model %s)", c.name, model)
                        continue
                except requests.RequestException:
                    pass
            log.info("removing orphan backend container %s (model %r, %s)", c.name, model, c.status)
            self._remove_quietly(c.id)
        return keep
