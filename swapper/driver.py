"""The one worker that performs the scheduler's decisions through the Runtime.

Runs in a single background thread (a greenlet under gunicorn's gevent
worker). Because actions run one at a time here, a stop always completes (the
container is gone) before the next load starts. Every action it takes is
reported back to the scheduler whatever happens (a load that raises, an engine
that vanishes), so the scheduler never waits on a report that will not come.

Between actions it watches the resident backend: a container that exited is
reported as a crash, and an idle model past its TTL is unloaded. The resident
backend is the scheduler's (`scheduler.backend`); the driver keeps no copy.
"""
from __future__ import annotations

import logging
import threading
import time

from .metrics import SwapperMetrics
from .registry import Registry
from .runtime import Backend, BackendError, DockerUnavailable, Runtime
from .scheduler import Action, LoadFailed, READY, Scheduler, SchedulerError
from .settings import Settings

log = logging.getLogger("swapper.driver")

# After a request could not reach its backend: how long Docker may still
# report a killed container as running (it does, for a few milliseconds).
CONFIRM_DEAD_SECONDS = 0.5


class Driver:
    def __init__(self, scheduler: Scheduler, runtime: Runtime, registry: Registry,
                 settings: Settings, metrics: SwapperMetrics,
                 sleep=time.sleep, clock=time.monotonic):
        self.scheduler = scheduler
        self.runtime = runtime
        self.registry = registry
        self.settings = settings
        self.metrics = metrics
        self.last_load_seconds: float | None = None
        self.adopted = False          # containers of an earlier run looked at
        # PRELOAD and IDLE_MODEL as registry ids (validated at start-up).
        self._preload = _model_id(registry, settings.preload)
        self._resting = _model_id(registry, settings.idle_model)
        self._sleep = sleep
        self._clock = clock

    def start(self) -> None:
        """Adopt what an earlier run left before serving (when the engine
        answers; else the driver thread keeps trying), then run the driver."""
        self._adopt()
        threading.Thread(target=self.run, name="swapper-driver", daemon=True).start()

    def run(self) -> None:
        while True:
            self.step(self.settings.watch_interval)

    def step(self, timeout: float | None) -> None:
        """One turn: adopt if not done yet, then perform the next action or watch."""
        if not self.adopted:
            self._adopt()
        action = self.scheduler.next_action(timeout=timeout)
        try:
            if action is None:
                self._watch()
            elif action.kind == "load":
                self._load(action)
            else:
                self._stop(action)
        except Exception:         # a bug here must not kill the only driver
            log.exception("driver error on %s", action)

    # ----------------------------------------------------------------- actions
    def _adopt(self) -> None:
        """What an earlier run left: keep one healthy backend, remove the rest.
        With the engine down this waits for it (the swapper serves degraded)."""
        try:
            adopted = self.runtime.adopt()
        except DockerUnavailable as e:
            log.warning("%s; looking again in %g s", e, self.settings.watch_interval)
            return
        self.adopted = True
        if adopted is not None:
            self.scheduler.found_resident(adopted.model, adopted)
        if self._preload and (adopted is None or adopted.model != self._preload):
            self.request_load(self._preload, "PRELOAD")

    def request_load(self, model: str, why: str) -> None:
        """Load `model` as if a request asked for it (queued like one, so it
        never cuts in front of waiting clients), from a thread of its own."""
        def run():
            ticket = self.scheduler.submit(model)
            try:
                if self.scheduler.wait(ticket):
                    self.scheduler.release(ticket)
            except SchedulerError as e:
                log.error("%s: could not load model %s: %s", why, model, e)
        log.info("%s: loading model %s", why, model)
        threading.Thread(target=run, name=f"load-{model}", daemon=True).start()

    def _load(self, action: Action) -> None:
        spec = self.registry.models[action.model]
        error: LoadFailed | None = None
        backend: Backend | None = None
        try:
            if action.delay:
                log.info("model %s keeps failing: waiting %.0f s before starting it again",
                         spec.id, action.delay)
                self._sleep(action.delay)
            log.info("loading model %s (image %s)", spec.id, spec.image)
            t0 = self._clock()
            backend = self.runtime.start(spec, on_progress=lambda seconds, line:
                                         self.scheduler.load_progress(action.epoch, seconds,
                                                                      line))
            self.last_load_seconds = self._clock() - t0
            self.adopted = True        # start() removed whatever was there
            self.metrics.load_done(spec.id, self.last_load_seconds, ok=True)
        except BackendError as e:
            log.error("load failed: %s", e)
            error = LoadFailed(str(e), e.kind)
        except BaseException as e:     # a bug, or the greenlet killed: still report
            log.exception("load of %s failed unexpectedly", spec.id)
            error = LoadFailed(f"model '{spec.id}': could not start it: "
                               f"{type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
        finally:
            if error is not None:
                self.metrics.load_done(spec.id, 0.0, ok=False)
            self.scheduler.load_done(action.epoch, backend=backend, error=error)

    def _stop(self, action: Action) -> None:
        """Stop and remove the model's container; retried until the engine
        confirms (a stop that is not sure must never let the next model in)."""
        backend = self.scheduler.backend
        target = backend if backend is not None and backend.model == action.model \
            else action.model
        log.info("stopping model %s", action.model)
        t0 = self._clock()
        delay = 1.0
        while True:
            try:
                self.runtime.stop(target)
                break
            except Exception as e:
                log.error("could not stop model %s (retrying in %.0f s): %s",
                          action.model, delay, e)
                self._sleep(delay)
                delay = min(delay * 2, 30)
        self.metrics.unloaded(action.model, self._clock() - t0)
        self.scheduler.stop_done()

    # ------------------------------------------------------------------ watch
    def _watch(self) -> None:
        snap = self.scheduler.snapshot()
        if snap["state"] != READY or snap["backend"] is None:
            return
        self.alive(snap["backend"])
        spec = self.registry.models.get(snap["model"])
        resting = self._resting
        if spec is not None and spec.idle_ttl > 0 and spec.id != resting:
            if self.scheduler.expire_idle(spec.idle_ttl):
                log.info("model %s idle for %g s: unloading", spec.id, spec.idle_ttl)
                if resting:
                    self.request_load(resting, "IDLE_MODEL")

    def alive(self, backend: Backend, confirm: float = 0.0) -> bool:
        """Is the backend's container still running? Reports a crash if not.
        With `confirm` > 0 (a request just failed to reach it), a container
        Docker still calls running is looked at again for that long, since a
        killed one is reported running for a few milliseconds. An engine that
        cannot say is not a crash."""
        deadline = self._clock() + confirm
        while True:
            try:
                running, reason = self.runtime.state(backend)
            except DockerUnavailable as e:
                log.warning("cannot inspect backend %s: %s", backend.name, e)
                return True
            if not running or self._clock() >= deadline:
                break
            self._sleep(0.05)
        if not running and self.scheduler.crashed(backend, reason):
            log.error("model %s crashed: %s", backend.model, reason)
            self.metrics.crashed(backend.model)
        return running


def _model_id(registry, name: str | None) -> str | None:
    """The registry id of a model named by id or alias (None: not named)."""
    spec = registry.resolve(name) if name else None
    return spec.id if spec is not None else None
