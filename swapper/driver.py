"""The one worker that performs the scheduler's decisions through the Runtime.

Runs in a single background thread (a greenlet under gunicorn's gevent
worker). Because actions run one at a time here, a stop always completes (the
container no longer runs) before the next load starts. Every action it takes is
reported back to the scheduler whatever happens (a load that raises, an engine
that vanishes), so the scheduler never waits on a report that will not come.

A swap overlaps what it safely can. While the old container stops, a helper
thread creates the next model's container (`Action.next_model`; created, not
started: it binds no port and holds no GPU). The next load starts that
prepared container, only after the stop returned. The stopped container is
removed by a helper thread once the load is done, off the swap's path (a stop
that no load follows removes it at once); a
removal that fails, a prepared container nobody loaded, and whatever a failed
load may have left are swept (every container of the stack but the resident
one) on the next idle turn, until the engine confirms.

A backend that dies is reported as a crash as soon as Docker says so: a second
thread follows the engine's `die` events (`follow_deaths`). Between actions the
driver watches the resident backend: while that event stream is down (an
engine that restarts) it inspects the container every WATCH_INTERVAL instead;
and an idle model past its TTL is unloaded. The resident backend is the
scheduler's (`scheduler.backend`); the driver keeps no copy.
"""
from __future__ import annotations

import logging
import threading
import time

from .download import Downloads
from .kvcache import KvCache, Outcome
from .metrics import SwapperMetrics
from .registry import Registry
from .runtime import Backend, BackendError, DockerUnavailable, Runtime
from .scheduler import READY, Scheduler
from .settings import Settings
from .swaps import Ledger
from .tickets import Action, LoadFailed, SchedulerError

log = logging.getLogger("swapper.driver")

# After a request could not reach its backend: how long Docker may still
# report a killed container as running (it does, for a few milliseconds).
CONFIRM_DEAD_SECONDS = 0.5


def _thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


class Driver:
    def __init__(self, scheduler: Scheduler, runtime: Runtime, registry: Registry,
                 settings: Settings, metrics: SwapperMetrics,
                 sleep=time.sleep, clock=time.monotonic, spawn=_thread,
                 kvcache: KvCache | None = None, downloads: Downloads | None = None):
        self.scheduler = scheduler
        self.runtime = runtime
        self.registry = registry
        self.settings = settings
        self.metrics = metrics
        self.last_load_seconds: float | None = None
        self.adopted = False          # containers of an earlier run looked at
        # PRELOAD and IDLE_MODEL as registry ids (validated at start-up).
        self._preload = _model_id(registry, settings.PRELOAD)
        self._resting = _model_id(registry, settings.IDLE_MODEL)
        self._sleep = sleep
        self._clock = clock
        self._spawn = spawn           # (fn, *args) -> something to join(): a helper thread
        self._prepared: Backend | None = None   # created during a stop, for the next load
        self._stopped: list[str] = []           # stopped containers, to remove
        self._dirty = False                     # something may be left: sweep when idle
        self.following = False                  # Docker's die events arrive (follow_deaths)
        self._dead: str | None = None           # the container last reported crashed
        # Prompt caches across swaps: saved before a stop, restored before admission.
        # Its events go where the scheduler's go (/events).
        self.kv = kvcache or KvCache(settings, metrics, emit=scheduler.listeners.emit,
                                     image_id=getattr(runtime, "image_id", None))
        # What each swap cost, phase by phase, and the serving share (swapper/swaps.py).
        self.ledger = Ledger(emit=scheduler.listeners.emit, metrics=metrics, clock=clock)
        self.kv.on_first_answer = self.ledger.reprefilled
        scheduler.on_in_flight = self.ledger.in_flight
        # Models whose files are missing are downloaded on first use, off the
        # resident slot (swapper/download.py).
        self.downloads = downloads or Downloads(settings, scheduler, clock=clock)

    def start(self) -> None:
        """Adopt what an earlier run left before serving (when the engine
        answers; else the driver thread keeps trying), then run the driver."""
        self._adopt()
        # Not a GPU model on an engine without GPUs: its start fails at once with
        # that reason, not after a download of its files.
        self.downloads.scan(m.id for m in self.registry if not self.runtime.gpus_missing(m))
        self.downloads.start()
        threading.Thread(target=self.run, name="swapper-driver", daemon=True).start()
        threading.Thread(target=self.follow_deaths, name="swapper-deaths", daemon=True).start()

    def run(self) -> None:
        while True:
            self.step(self.settings.WATCH_INTERVAL)

    def step(self, timeout: float | None) -> None:
        """One turn: adopt if not done yet, then perform the next action or watch."""
        if not self.adopted:
            self._adopt()
        action = self.scheduler.next_action(timeout=timeout)
        try:
            if action is None:
                self._tidy()
                self._watch()
            elif action.kind == "load":
                self._load(action)
                self._remove_stopped()
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
            log.warning("%s; looking again in %g s", e, self.settings.WATCH_INTERVAL)
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
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.model != spec.id:
            self._stopped.append(prepared.container_id)     # prepared for nothing
            prepared = None
        error: LoadFailed | None = None
        backend: Backend | None = None
        if self.downloads.missing(spec.id) and not self.runtime.gpus_missing(spec):
            # Its files went away since they were looked at: download them first
            # (the model's requests wait for that; nothing is started).
            log.info("model %s: its files are missing: downloading them before it loads",
                     spec.id)
            if prepared is not None:
                self._stopped.append(prepared.container_id)
            self.scheduler.load_needs_download(action.epoch)
            return
        try:
            if action.delay:
                log.info("model %s keeps failing: waiting %.0f s before starting it again",
                         spec.id, action.delay)
                self._sleep(action.delay)
            log.info("loading model %s (image %s)", spec.id, spec.image)
            t0 = self._clock()
            backend = self.runtime.start(spec, prepared=prepared, on_progress=lambda seconds, line:
                                         self.scheduler.load_progress(action.epoch, seconds,
                                                                      line))
            started = self._clock() - t0
            t1 = self._clock()
            backend, restored = self._restore(spec, backend, prepared_for=action)
            restore = self._clock() - t1
            self.last_load_seconds = self._clock() - t0
            healthy = backend.healthy_seconds or 0.0
            self.ledger.loaded(spec.id, max(started - healthy, 0.0), healthy, restore,
                               restored)
            self.metrics.load_done(spec.id, self.last_load_seconds, ok=True)
            if not self.adopted:       # the engine came back just before this load:
                self.adopted = self._dirty = True    # sweep what an earlier run left
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
                self._dirty = True     # the runtime may not have removed what it made
                self.metrics.load_done(spec.id, 0.0, ok=False)
            self.scheduler.load_done(action.epoch, backend=backend, error=error)

    def _restore(self, spec, backend: Backend, prepared_for: Action
                 ) -> tuple[Backend, Outcome | None]:
        """The healthy backend gets its saved prompt caches back before anything
        is admitted. A restore that brought the backend down (this llama-server
        aborts on some bad files) costs a fresh start without them."""
        if not self.kv.enabled(spec):
            return backend, None
        outcome = self.kv.restore(spec, backend)
        if not outcome.died:
            return backend, outcome
        log.error("model %s: its backend stopped answering while its prompt cache was "
                  "restored: starting it again without it", spec.id)
        try:
            self.runtime.remove(backend.container_id)
        except Exception as e:
            self._dirty = True
            log.warning("could not remove container %s: %s", backend.container_id[:12], e)
        return self.runtime.start(spec, on_progress=lambda seconds, line:
                                  self.scheduler.load_progress(prepared_for.epoch, seconds,
                                                               line)), outcome

    def _save(self, action: Action, backend) -> Outcome | None:
        """Save the prompt cache of the backend about to stop, while it still
        answers (not when it just crashed). Costs only the cache if it fails."""
        spec = self.registry.models.get(action.model)
        if (spec is None or not isinstance(backend, Backend) or backend.model != action.model
                or backend.container_id == self._dead or not self.kv.enabled(spec)):
            if spec is not None:
                self.kv.book.forget(spec.id)    # what it served is gone with it
            return None
        try:
            return self.kv.save(spec, backend)
        except Exception:           # KvCache.save never raises: a bug must not block the stop
            log.exception("saving the prompt cache of %s failed", spec.id)
            return None

    def _stop(self, action: Action) -> None:
        """Stop the model's container; retried until the engine confirms (a
        stop that is not sure must never let the next model in). In a swap a
        helper creates the container of the model that waits next meanwhile,
        and the stopped one is removed after the load; else (an unload, an
        idle TTL) it is removed now."""
        backend = self.scheduler.backend
        target = backend if backend is not None and backend.model == action.model \
            else action.model
        log.info("stopping model %s", action.model)
        t0 = self._clock()
        self._drop_prepared()                           # an earlier one nobody loaded
        spec = self.registry.models.get(action.next_model or "")
        helper = self._spawn(self._prepare, spec) if spec is not None else None
        saved = self._save(action, backend)     # while the next container is created
        save = self._clock() - t0
        delay = 1.0
        while True:
            try:
                self._stopped += self.runtime.stop(target)
                break
            except Exception as e:
                log.error("could not stop model %s (retrying in %.0f s): %s",
                          action.model, delay, e)
                self._sleep(delay)
                delay = min(delay * 2, 30)
        if helper is not None:
            helper.join()
        else:                          # not a swap: nothing waits, remove it now
            self._remove(self._stopped)
            self._stopped = []
        self.metrics.unloaded(action.model, self._clock() - t0)
        self.ledger.stopped(action.model, action.cause, self._clock() - t0, save, saved)
        self.scheduler.stop_done()

    def _prepare(self, spec) -> None:
        """Create the next model's container (the helper thread of a stop;
        not when its image must be pulled first). A failure only costs the
        overlap: the load creates it and reports."""
        try:
            self._prepared = self.runtime.prepare(spec)
        except Exception as e:
            self._dirty = True
            log.warning("could not create the container of model %s ahead of its load: %s",
                        spec.id, e)

    def _drop_prepared(self) -> None:
        """A prepared container that no load will start goes with the stopped ones."""
        if self._prepared is not None:
            self._stopped.append(self._prepared.container_id)
            self._prepared = None

    # ---------------------------------------------------------------- removal
    def _remove_stopped(self) -> None:
        """Remove the stopped containers, in a helper thread (off the path of
        whatever the driver does next)."""
        ids, self._stopped = self._stopped, []
        if ids:
            self._spawn(self._remove, ids)

    def _remove(self, ids: list[str]) -> None:
        for cid in ids:
            try:
                self.runtime.remove(cid)
            except Exception as e:
                self._dirty = True
                log.warning("could not remove container %s (trying again when idle): %s",
                            cid[:12], e)

    def _tidy(self) -> None:
        """An idle turn (nothing is being created or started): remove what
        stopped; when something may have been left behind, sweep every
        container of the stack but the resident one instead."""
        self._drop_prepared()                           # its load never came
        if not self._dirty or not self.adopted:
            self._remove_stopped()
            return
        self._dirty, self._stopped = False, []
        backend = self.scheduler.backend
        try:
            n = self.runtime.remove_all(keep=[backend.container_id] if backend else [])
            if n:
                log.info("removed %d leftover backend container(s)", n)
        except Exception as e:
            self._dirty = True
            log.warning("could not remove leftover backend containers (trying again): %s", e)

    # ------------------------------------------------------------------ watch
    def follow_deaths(self) -> None:
        """Follow Docker's die events for ever: the resident backend's death is
        a crash at once. Whenever the stream is (re)subscribed the backend is
        looked at once (it may have died while nobody listened); while it is
        down the watch polls."""
        while True:
            try:
                deaths = self.runtime.deaths()
            except Exception:            # the engine is down: the watch polls
                self._sleep(self.settings.WATCH_INTERVAL)
                continue
            self.following = True
            try:
                backend = self.scheduler.backend
                if backend is not None:
                    self.alive(backend)
                for container_id in deaths:
                    backend = self.scheduler.backend
                    if backend is not None and backend.container_id == container_id:
                        self.alive(backend, confirm=CONFIRM_DEAD_SECONDS)
                why = "it ended"
            except Exception as e:
                why = str(e)
            self.following = False
            log.warning("Docker's event stream broke (%s): polling the backend until it is "
                        "back", why)
            self._sleep(self.settings.WATCH_INTERVAL)

    def _watch(self) -> None:
        snap = self.scheduler.snapshot()
        if snap["state"] != READY or snap["backend"] is None:
            return
        if not self.following:
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
            self._dead = backend.container_id
            log.error("model %s crashed: %s", backend.model, reason)
            self.metrics.crashed(backend.model)
        return running


def _model_id(registry, name: str | None) -> str | None:
    """The registry id of a model named by id or alias (None: not named)."""
    spec = registry.resolve(name) if name else None
    return spec.id if spec is not None else None
