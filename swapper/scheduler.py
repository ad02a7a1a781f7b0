"""The single owner of "which model holds the GPU and who may use it".

A pure state machine: no Docker, no HTTP. Request handlers `submit()` a ticket
and `wait()` until it is admitted (or failed); the driver (swapper/driver.py)
takes the actions this decides (`next_action()`: load a model, stop the
resident one) one at a time, performs them, and reports back (`load_done`,
`stop_done`, `crashed`). Because exactly one driver performs actions serially,
and a load is only ever decided when nothing is resident, two backends can
never run at once. A stop names the model that waits first
(`Action.next_model`), so the driver may prepare that load (create its
container) while it stops.

Policy
- Requests for the resident (ready) model are admitted up to its slot count;
  the rest wait FIFO, at most `max_queue` waiting in all (QueueFull beyond).
- An *epoch* is one residency of one model. A request joins the current epoch
  if it is for the model being loaded, or for the ready model while nothing else
  waits. Once a request for another model (or an unload) waits, later requests
  for the resident model wait behind it (no starvation).
- When the epoch has no waiting and no in-flight requests and something else
  waits, the resident model is stopped (drained by construction) and the next
  model is loaded; every waiting request for that model joins the new epoch
  (A B A B -> A A B B, grouped by model).
- The swap policy (swapper/policy.py: `Hold`, the default, or `Fifo`) has
  the word on the rest, and the scheduler asks it: whether a session's next
  request for the ready model joins its epoch although other models wait, whether
  the drained resident model is kept for its agents' next turns (holds), which
  model goes next, and the tenants' fair order within an epoch. A load's
  seconds are charged to the tenants whose requests waited for it when it
  started or joined it while it loaded (the policy's `loaded`).
- A request for a model whose download runs (swapper/downloadqueue.py) is
  parked: it waits, but the policy does not see it until the download ends.
- A failed load fails the requests of its epoch with the error. A crash of the
  resident model removes its container; waiting requests trigger a reload,
  delayed by an exponential backoff while the model keeps failing.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import Any, Callable

from .downloadqueue import DownloadQueue
from .listeners import Listeners
from .loadtimes import Backoff, LoadCost, LoadTimes
from .modelstatus import Statuses
from .policy import Policy, Stint, SwapPolicy, operator_waits, short
from .tenants import DEFAULT_TENANT
from .tickets import (IDLE, LOADING, READY, STOPPING, Action, Cancelled, LoadFailed,
                      QueueFull, SchedulerError, Ticket)


# The event each phase change publishes (for the model that phase is about).
PHASE_EVENTS = {LOADING: "load_started", READY: "ready", STOPPING: "unloading", IDLE: "unloaded"}


class Scheduler:
    def __init__(self, slots: Callable[[str], int], max_queue: int = 64,
                 backoff_base: float = 1.0, backoff_max: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 load_times: LoadTimes | None = None, policy: SwapPolicy | None = None):
        self._slots = slots
        self.max_queue = max_queue
        self.backoff = Backoff(backoff_base, backoff_max)   # a failing model's next load waits
        self._clock = clock
        self._cv = threading.Condition()
        self._seq = itertools.count(1)
        self.listeners = Listeners()            # who hears its events (swapper/listeners.py)
        self._emit = self.listeners.emit
        self._queue: list[Ticket] = []       # waiting, FIFO
        self._active: set[Ticket] = set()    # admitted, not yet released
        self.on_in_flight: Callable[[int], None] | None = None   # told len(_active)
        self.phase = IDLE
        self.model: str | None = None        # loading / ready / stopping model
        self.epoch = 0
        self.since = clock()
        self.last_activity = clock()
        self._backend: Any = None
        self._action: Action | None = None
        self.progress: dict = {}                  # the running load's latest progress
        # Past load durations per model: the ETA of a load (swapper/loadtimes.py).
        self.load_times = load_times or LoadTimes()
        # Holds and which model next (swapper/policy.py).
        self.policy: Policy = (policy or SwapPolicy()).build(
            clock, lambda m: self.load_times.expected(m), self._emit)
        self.load_cost = LoadCost(clock)        # time lost to loads, the last swap's seconds
        self._load_delay = 0.0                  # the running load's backoff, seconds
        # Downloads on first use (swapper/download.py). A model whose files are
        # missing (the downloader says so: downloads.mark_missing) is downloaded when
        # first asked for; meanwhile its requests are parked (swapper/downloadqueue.py).
        self.downloads = DownloadQueue(self._cv, clock, self._emit,
                                       lambda: None if self.phase == IDLE else self.model)
        self.statuses = Statuses(self.downloads, self.load_times)   # what /v1/models says
        self._wake_at: float | None = None     # when the policy's hold may end
        self._stopped: str | None = None       # the model stopped last
        self._load_cause = "request"           # why the running load was started
        self._load_tenants: set[str] = set()   # whose waiting requests caused it

    # ---------------------------------------------------------------- requests
    def submit(self, model: str | None, session: str | None = None,
               urgent: bool = False, tenant: str = DEFAULT_TENANT,
               weight: float = 1.0) -> Ticket:
        """Queue a request for `model` (None = unload) from `session` (the agent
        that sent it; None: it neither holds nor uses holds); `urgent`: an
        operator's load; `tenant`, `weight`: whose (swapper/tenants.py). Raises
        QueueFull."""
        return self.submit_many(model, 1, session, urgent, tenant, weight)[0]

    def submit_many(self, model: str | None, count: int, session: str | None = None,
                    urgent: bool = False, tenant: str = DEFAULT_TENANT,
                    weight: float = 1.0) -> list[Ticket]:
        """Queue `count` requests for `model` at once, so they land in the same
        epoch (the members of one fan-out). Raises QueueFull for all of them."""
        with self._cv:
            if len(self._queue) + count > self.max_queue:
                raise QueueFull(len(self._queue))
            if session is not None:
                self.policy.came(session, model, self._stint())
            joins = model is not None and model == self.model and (
                self.phase == LOADING or (self.phase == READY and (
                    not self._others_waiting() or self.policy.in_turn(
                        session, self._stint(), self._eligible(), self._active))))
            if joins and self.phase == READY and self._others_waiting():
                self._emit("hold_used", model=model, session=short(session))
            self.downloads.asked(model)
            tickets = []
            now = self._clock()
            for _ in range(count):
                t = Ticket(next(self._seq), model, session, urgent, tenant, weight,
                           queued_at=now)
                self.policy.tag(t)
                if joins:
                    t.epoch = self.epoch
                self._queue.append(t)
                tickets.append(t)
            self._emit("queued", model=model, count=count, queued=len(self._queue),
                       resident=self.model, phase=self.phase)
            self._schedule()
            return tickets

    def wait(self, ticket: Ticket, timeout: float | None = None) -> bool:
        """Block until the ticket leaves the queue. True when it did; raises its
        error if it failed; False on timeout (still waiting)."""
        if not ticket.event.wait(timeout):
            return False
        if ticket.error is not None:
            raise ticket.error
        return True

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: leave the queue, or give the slot back."""
        with self._cv:
            if ticket.session is not None:
                self.policy.gone(ticket.session, self._stint())
            if ticket.state == "waiting" and ticket in self._queue:
                self._queue.remove(ticket)
                ticket.state = "cancelled"
                ticket.error = Cancelled("client disconnected while queued")
                ticket.event.set()
                self._emit("cancelled", model=ticket.model)
                self._schedule()
            elif ticket.state == "admitted":
                self._release_locked(ticket, ok=False, cause="client_gone")

    def release(self, ticket: Ticket, ok: bool = True, cause: str | None = None) -> None:
        """The admitted request finished (ok = the backend answered; `cause`:
        why not, common.failures' name)."""
        with self._cv:
            self._release_locked(ticket, ok, cause)

    def _release_locked(self, ticket: Ticket, ok: bool, cause: str | None = None) -> None:
        if ticket not in self._active:
            return
        self._active.discard(ticket)
        self._told_in_flight()
        ticket.state = "done"
        self.last_activity = self._clock()
        if ok and ticket.model:
            self.backoff.answered(ticket.model)
        if ticket.session is not None:
            self.policy.released(ticket, ok, cause, self._stint(), self._queue)
        self._schedule()

    # ------------------------------------------------------------------ driver
    def next_action(self, timeout: float | None = None) -> Action | None:
        """The driver's next job, waiting up to `timeout` for one."""
        with self._cv:
            self._tick()
            if self._action is None:
                # A running hold or quantum ends at _wake_at: wake for it.
                end = None if timeout is None else time.monotonic() + timeout
                while self._action is None:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    wake = self._wake_in()
                    self._cv.wait(left if wake is None else
                                  wake if left is None else min(left, wake))
                    self._tick()
            action, self._action = self._action, None
            return action

    def tick(self) -> None:
        """Apply the policy now (a hold or quantum may have ended): the driver's
        next_action does this itself; tests with a hand-driven clock call it."""
        with self._cv:
            self._tick()

    def _tick(self) -> None:
        if self._wake_at is not None and self._clock() >= self._wake_at:
            self._schedule()

    def _wake_in(self) -> float | None:
        return None if self._wake_at is None else max(0.0, self._wake_at - self._clock())

    def load_done(self, epoch: int, backend: Any = None, error: LoadFailed | None = None) -> None:
        """The load of `epoch` ended: ready (its time, from `loading` less a
        backoff's wait, joins the model's load times), or failed."""
        with self._cv:
            if self.phase != LOADING or epoch != self.epoch:
                return
            if error is not None:
                model = self.model
                self.backoff.failed(model)
                self.load_cost.no_swap()
                self._set_phase(IDLE, None)
                self._fail([t for t in self._queue if t.epoch == epoch], error)
                self.statuses.latest(model, error)
                self._emit("load_failed", model=model, error=str(error), cause=error.kind)
            else:
                self._backend = backend
                self.statuses.latest(self.model, None)
                seconds = self._clock() - self.since - self._load_delay
                self.load_times.add(self.model, seconds)
                self.load_cost.loaded(self.model, seconds)
                # Charged to whose requests waited for it (at its start or joining
                # it); each waiting request is told its share (tenants.split).
                waited = [t for t in self._queue if t.epoch == epoch]
                self.policy.loaded(self.model, seconds,
                                   self._load_tenants | {t.tenant for t in waited}, waited)
                self._set_phase(READY, self.model)
            self._schedule()

    def stop_done(self) -> None:
        with self._cv:
            if self.phase != STOPPING:
                return
            self._set_phase(IDLE, None)
            self._backend = None
            self._finish_unloads()
            self._schedule()

    def crashed(self, backend: Any, reason: str = "") -> bool:
        """`backend` died. Returns True when it was the resident one (and so the
        state changed); a report about an earlier backend changes nothing."""
        with self._cv:
            if self.phase != READY or self._backend is None or self._backend != backend:
                return False
            model = self.model
            self.backoff.failed(model)
            for t in self._queue:
                if t.epoch == self.epoch:
                    t.epoch = None          # they will trigger a reload
            self._emit("crashed", model=model, reason=reason)
            self._start_stop("crash")
            return True

    def expire_idle(self, ttl: float) -> bool:
        """Unload the resident model if it has been idle for `ttl` seconds."""
        with self._cv:
            if (ttl > 0 and self.phase == READY and not self._active and not self._eligible()
                    and self._clock() - self.last_activity >= ttl):
                self._emit("idle_unload", model=self.model, idle_seconds=ttl)
                self._start_stop("idle")
                return True
            return False

    # -------------------------------------------------------------- downloads
    def download_done(self, model: str, error: LoadFailed | None = None) -> None:
        """The download of `model` ended: its parked requests take part in the
        policy again (so it loads), or they fail with the download's error."""
        with self._cv:
            if not self.downloads.parks(model):
                return                      # none ran
            if error is not None:
                self._fail([t for t in self._queue if t.model == model], error)
            self.statuses.latest(model, error)
            self.downloads.end(model, error)
            self._schedule()

    def load_needs_download(self, epoch: int) -> None:
        """The driver was told to load a model whose files are gone (removed since
        they were looked at): no load after all; its requests park on a download."""
        with self._cv:
            if self.phase != LOADING or epoch != self.epoch:
                return
            model = self.model
            self._set_phase(IDLE, None)
            for t in self._queue:
                if t.epoch == epoch:
                    t.epoch = None
            self.downloads.missing.add(model)
            self.downloads.asked(model)
            self._schedule()

    # ------------------------------------------------------------- inspection
    @property
    def backend(self) -> Any:
        """The resident backend (the one owner of it): set when a load is done
        or a backend adopted, cleared when it stops. None otherwise."""
        with self._cv:
            return self._backend

    def load_progress(self, epoch: int, seconds: float, detail: str = "") -> None:
        """The driver's word on a running load (elapsed time, last log line)."""
        with self._cv:
            if self.phase != LOADING or epoch != self.epoch:
                return
            self.progress = {"model": self.model, "seconds": round(seconds, 1), "detail": detail,
                             **self.load_times.eta(self.model, seconds)}
            self._emit("progress", **self.progress)

    def model_status(self, model: str) -> dict:
        """A model's status (swapper/modelstatus.py)."""
        with self._cv:
            return self.statuses.of(model, self.model, self.phase, self._clock() - self.since)

    def snapshot(self) -> dict:
        with self._cv:
            return {
                "model": self.model,
                "state": self.phase,
                "since": self.since,
                "epoch": self.epoch,
                "in_flight": len(self._active),
                "queued": len(self._queue),
                "queued_by_model": dict(Counter(t.model or "(unload)" for t in self._queue)),
                "failures": dict(self.backoff.failures),
                "backend": self._backend,
                "progress": dict(self.progress),
                "downloads": self.downloads.status(),
                "expected_seconds": self.load_times.expected(self.model)
                if self.phase == LOADING else None,
                "last_swap_seconds": self.load_cost.last_swap_seconds,
                "policy": self.policy.name,
                "tenants": self.policy.tenants(self._queue, self._active),
                "hold": None if self._wake_at is None else   # while the policy holds
                self.policy.status(self._eligible(), self._stint()),
                **self.load_cost.status(),
            }

    # ---------------------------------------------------------------- policy
    def _others_waiting(self) -> bool:
        return any(t.epoch != self.epoch or t.model != self.model for t in self._eligible())

    def _eligible(self) -> list[Ticket]:
        """The queue as the policy sees it: without requests parked on a download."""
        if not self.downloads.running:
            return self._queue
        return [t for t in self._queue if not self.downloads.parks(t.model)]

    def _schedule(self) -> None:
        """Apply the policy after any change. Called with the lock held."""
        self._wake_at = None
        queue = self._eligible()
        if self.phase == READY:
            slots = self._slots(self.model)
            in_epoch = sum(1 for t in self._active if t.epoch == self.epoch)
            if in_epoch < slots:
                # The epoch's waiting requests in the policy's fair order.
                for t in self.policy.order([t for t in queue if t.epoch == self.epoch]):
                    if in_epoch >= slots:
                        break
                    self._admit(t)
                    in_epoch += 1
            queue = self._eligible()
            if in_epoch == 0 and queue and not any(t.epoch == self.epoch for t in queue):
                wake = self.policy.held(queue, self._stint())
                if wake is not None:
                    self._wake_at = wake    # its sessions' next turns go first
                    return
                model = self.policy.next_model(queue, self._stint())
                if model == self.model:
                    # What waited behind a cancelled swap: a new epoch, no swap needed.
                    self.epoch += 1
                    self._join_epoch(self.model)
                    self._schedule()
                else:
                    self._start_stop(self._stop_cause(queue))
        elif self.phase == IDLE:
            self._finish_unloads()
            queue = self._eligible()
            if not queue:
                self.load_cost.no_swap()    # an unload: no load followed the stop
            if queue:
                model = self.policy.next_model(queue, self._stint())
                urgent = any(t.urgent for t in queue if t.model == model)
                failures = self.backoff.failures.get(model, 0)
                self._load_cause = "operator" if urgent else "restart" if failures else "request"
                self.epoch += 1
                self._set_phase(LOADING, model)
                self._join_epoch(model)
                self._load_tenants = {t.tenant for t in queue if t.model == model}
                self._load_delay = self.backoff.delay(model)
                self._post(Action("load", model, self.epoch, self._load_delay,
                                  cause=self._load_cause))
        # LOADING and STOPPING wait for the driver.

    def _stint(self) -> Stint:
        """What the policy sees of the state."""
        return Stint(self.model, self.epoch, self.since if self.phase == READY else None,
                     self.model if self.phase != IDLE else self._stopped)

    def _stop_cause(self, queue: list[Ticket]) -> str:
        if any(t.model is None for t in queue):
            return "unload"
        if operator_waits(queue):
            return "operator"
        return self.policy.stop_cause(self._stint())

    def _admit(self, t: Ticket) -> None:
        self._queue.remove(t)
        self._active.add(t)
        self._told_in_flight()
        t.state = "admitted"
        t.backend = self._backend
        self.policy.admitted(t)
        self.last_activity = t.admitted_at = self._clock()
        t.event.set()

    def _fail(self, tickets: list[Ticket], error: SchedulerError) -> None:
        for t in tickets:
            self._queue.remove(t)
            t.state, t.error = "failed", error
            t.event.set()

    def _told_in_flight(self) -> None:
        if self.on_in_flight is not None:
            try:
                self.on_in_flight(len(self._active))
            except Exception:  # an accounting bug must never wedge scheduling
                pass

    def _join_epoch(self, model: str) -> None:
        for t in self._queue:
            if t.model == model:
                t.epoch = self.epoch

    def _start_stop(self, cause: str) -> None:
        model = self.model
        queue = [t for t in self._eligible() if t.model is not None]
        waiting = self.policy.next_model(queue, self._stint()) if queue else None
        self._set_phase(STOPPING, model)
        self._stopped = model
        self.load_cost.stopping(self.since, model)  # a swap when another model's load follows
        self._emit("stop", model=model, cause=cause, next_model=waiting)
        self._post(Action("stop", model, self.epoch, next_model=waiting, cause=cause))

    def _finish_unloads(self) -> None:
        """Nothing is resident: every unload waiting is done (an operator's
        unload acts at once; what waits behind it loads next)."""
        for t in [t for t in self._queue if t.model is None]:
            self._queue.remove(t)
            t.state = "done"
            t.event.set()

    def _set_phase(self, phase: str, model: str | None) -> None:
        old, old_since = (self.phase, self.model), self.since
        self.phase, self.model = phase, model
        if old != (phase, model):
            self.policy.new_stint()         # holds belong to one residency
            self._wake_at = None
        self.since = self._clock()
        if phase != LOADING:
            self.progress = {}
        if old != (phase, model):
            extra = {**self.load_times.eta(model, 0.0), "cause": self._load_cause} \
                if phase == LOADING else {}
            self._emit(PHASE_EVENTS[phase], model=model or old[1], previous=old[0],
                       seconds=round(self.since - old_since, 3), **extra)

    def _post(self, action: Action) -> None:
        self._action = action
        self._cv.notify_all()

    # ------------------------------------------------------------ adoption
    def found_resident(self, model: str, backend: Any) -> None:
        """At start-up: a healthy backend left by an earlier run (adopted by the
        driver) becomes resident."""
        with self._cv:
            if self.phase != IDLE:
                return
            self.epoch += 1
            self._backend = backend
            self._set_phase(READY, model)
            self._schedule()

