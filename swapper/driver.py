"""The one worker that performs the scheduler's decisions against Docker.

Runs in a single background thread (a greenlet under gunicorn's gevent
worker). Because actions run one at a time here, a stop always completes (the
container is gone) before the next load starts. Between actions it watches the
resident backend: a container that exited is reported as a crash, and an idle
model past its TTL is unloaded.
"""
from __future__ import annotations

import logging
import threading
import time

from .registry import Registry
from .runtime import Backend, BackendError, DockerRuntime
from .scheduler import Action, LoadFailed, READY, Scheduler
from .settings import Settings
from .metrics import SwapperMetrics

log = logging.getLogger("swapper.driver")


class Driver:
    def __init__(self, scheduler: Scheduler, runtime: DockerRuntime, registry: Registry,
                 settings: Settings, metrics: SwapperMetrics):
        self.scheduler = scheduler
        self.runtime = runtime
        self.registry = registry
        self.settings = settings
        self.metrics = metrics
        self.backend: Backend | None = None     # the container this driver started
        self.last_load_seconds: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        adopted = None
        try:
            adopted = self.runtime.adopt()
        except Exception as e:       # Docker down at start: run degraded, retry on use
            log.warning("could not look for containers of an earlier run: %s", e)
        if adopted is not None:
            self.backend = adopted
            self.scheduler.adopt(adopted.model, adopted)
        self._thread = threading.Thread(target=self.run, name="swapper-driver", daemon=True)
        self._thread.start()

    def shutdown(self, remove_backend: bool = True) -> None:
        self._stopping.set()
        if remove_backend:
            try:
                self.runtime.remove_all()
            except Exception as e:
                log.warning("removing backends at shutdown: %s", e)

    def run(self) -> None:
        while not self._stopping.is_set():
            action = self.scheduler.next_action(timeout=self.settings.watch_interval)
            try:
                if action is None:
                    self._watch()
                elif action.kind == "load":
                    self._load(action)
                elif action.kind == "stop":
                    self._stop(action)
            except Exception:
                log.exception("driver error on %s", action)

    # ----------------------------------------------------------------- actions
    def _load(self, action: Action) -> None:
        spec = self.registry.models[action.model]
        if action.delay:
            log.info("model %s keeps failing: waiting %.0f s before starting it again",
                     spec.id, action.delay)
            time.sleep(action.delay)
        log.info("loading model %s (image %s)", spec.id, spec.image)
        t0 = time.monotonic()
        try:
            backend = self.runtime.start(spec)
        except BackendError as e:
            log.error("load failed: %s", e)
            self.metrics.load_done(spec.id, time.monotonic() - t0, ok=False)
            self.scheduler.load_done(action.epoch, error=LoadFailed(str(e), e.status))
            return
        except Exception as e:
            log.exception("load of %s failed unexpectedly", spec.id)
            self.metrics.load_done(spec.id, time.monotonic() - t0, ok=False)
            self.runtime.remove_all()
            self.scheduler.load_done(action.epoch, error=LoadFailed(
                f"model '{spec.id}': could not start it: {type(e).__name__}: {e}"))
            return
        seconds = time.monotonic() - t0
        self.last_load_seconds = seconds
        self.backend = backend
        self.metrics.load_done(spec.id, seconds, ok=True)
        self.scheduler.load_done(action.epoch, backend=backend)

    def _stop(self, action: Action) -> None:
        target = self.backend if self.backend and self.backend.model == action.model else action.model
        log.info("stopping model %s", action.model)
        t0, delay = time.monotonic(), 1.0
        while True:
            try:
                self.runtime.stop(target)
                break
            except Exception as e:
                if self._stopping.is_set():
                    return
                log.error("could not stop model %s (retrying in %.0f s): %s", action.model, delay, e)
                time.sleep(delay)
                delay = min(delay * 2, 30)
        self.backend = None
        self.metrics.unloaded(action.model, time.monotonic() - t0)
        self.scheduler.stop_done()

    # ------------------------------------------------------------------ watch
    def _watch(self) -> None:
        snap_model = self.scheduler.model
        if self.scheduler.phase != READY or snap_model is None:
            return
        backend = self.backend
        if backend is not None:
            self.check(backend)
        spec = self.registry.models.get(snap_model)
        if spec is not None and spec.idle_ttl > 0:
            if self.scheduler.expire_idle(spec.idle_ttl):
                log.info("model %s idle for %g s: unloading", spec.id, spec.idle_ttl)

    def check(self, backend: Backend) -> bool:
        """Is the backend's container still running? Reports a crash if not."""
        try:
            running, reason = self.runtime.state(backend)
        except Exception as e:      # Docker unreachable: do not call it a crash
            log.warning("cannot inspect backend %s: %s", backend.name, e)
            return True
        if not running and self.scheduler.crashed(backend.model, reason):
            log.error("model %s crashed: %s", backend.model, reason)
            self.metrics.crashed(backend.model)
        return running
