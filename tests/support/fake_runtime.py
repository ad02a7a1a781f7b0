"""The swapper's Runtime interface in memory, for unit tests of the driver, the
lease and the fan-out without Docker.

Containers are records. A model may be given the URL of a real HTTP server
(a scripted backend) that its "container" serves at; the engine can be taken
down and brought back; starts and stops can be made to fail. Whatever it is
asked to do is recorded in `calls`, and `peak` is the most containers that
ever ran at once (the one-resident invariant).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from swapper.registry import ModelSpec
from swapper.runtime import Backend, BackendError, DockerUnavailable

_ids = itertools.count(1)


@dataclass
class Container:
    id: str
    model: str
    running: bool = True
    reason: str = ""
    running_reports: int = 0      # how many more times state() says running after a kill


class FakeRuntime:
    def __init__(self, urls: dict[str, str] | None = None):
        self.urls = urls or {}
        self.containers: dict[str, Container] = {}
        self.calls: list[tuple[str, str]] = []
        self.engine_up = True
        self.start_errors: dict[str, BackendError | Exception] = {}
        self.stop_failures = 0        # the next n stops find the engine down
        self.peak = 0

    # ------------------------------------------------------------- test levers
    def kill(self, model: str, reason: str = "its container exited with code 137",
             reported_running: int = 0) -> None:
        """The model's container dies; Docker may go on calling it running for
        `reported_running` more looks (it does, for a few milliseconds)."""
        for c in self.containers.values():
            if c.model == model:
                c.running, c.reason, c.running_reports = False, reason, reported_running

    def leave(self, model: str, running: bool = True) -> Container:
        """A container left by an earlier run (for adoption)."""
        c = Container(f"c{next(_ids)}", model, running)
        self.containers[c.id] = c
        return c

    def running(self) -> list[Container]:
        return [c for c in self.containers.values() if c.running]

    # ----------------------------------------------------------- the interface
    def _engine(self) -> None:
        if not self.engine_up:
            raise DockerUnavailable("fake engine down")

    def ping(self) -> bool:
        return self.engine_up

    def start(self, spec: ModelSpec, on_progress=None) -> Backend:
        self.calls.append(("start", spec.id))
        if on_progress is not None:
            on_progress(1.0, f"fake: loading {spec.id}")
        if not self.engine_up:
            raise BackendError(spec.id, "could not start it: fake engine down",
                               kind="docker_unreachable")
        self.remove_all()
        err = self.start_errors.get(spec.id)
        if err is not None:
            raise err
        c = Container(f"c{next(_ids)}", spec.id)
        self.containers[c.id] = c
        self.peak = max(self.peak, len(self.running()))
        return Backend(spec.id, c.id, f"fake-{spec.id}",
                       self.urls.get(spec.id, f"http://fake-{spec.id}"))

    def stop(self, backend_or_model) -> None:
        target = getattr(backend_or_model, "container_id", backend_or_model)
        self.calls.append(("stop", getattr(backend_or_model, "model", backend_or_model)))
        if self.stop_failures:
            self.stop_failures -= 1
            raise DockerUnavailable("fake engine down")
        self._engine()
        for cid, c in list(self.containers.items()):
            if cid == target or c.model == target:
                del self.containers[cid]

    def state(self, backend: Backend) -> tuple[bool, str]:
        self._engine()
        c = self.containers.get(backend.container_id)
        if c is None:
            return False, "its container is gone"
        if not c.running and c.running_reports > 0:
            c.running_reports -= 1
            return True, ""
        return c.running, c.reason

    def logs(self, model_id: str, tail: int | None = None) -> str:
        return f"fake log of {model_id}"

    def follow_logs(self, model_id: str, tail: int = 100):
        return iter([b"fake log\n"])

    def adopt(self) -> Backend | None:
        self._engine()
        keep = None
        for cid, c in list(self.containers.items()):
            if keep is None and c.running:
                keep = Backend(c.model, cid, f"fake-{c.model}",
                               self.urls.get(c.model, f"http://fake-{c.model}"))
            else:
                del self.containers[cid]
        return keep

    def remove_all(self) -> int:
        self._engine()
        n = len(self.containers)
        self.containers.clear()
        return n
