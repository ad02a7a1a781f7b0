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
- Holds (policy "hold", the default; "fifo" is the policy without them). A
  request that ends well on the resident model gives its *session* (the agent
  that sent it, swapper/sessions.py) a hold: `first_hold` seconds, then (once
  it has come back) twice its longest recent gap plus a second, at most `hold`.
  That session's
  next request for the resident model joins the epoch although other models
  wait, and the resident model is not stopped while a hold runs. An agent's turn
  (answer, tool call, next request) so stays on the model it started on. Holds
  end early: the session asks for another model, hangs up or fails; an operator
  `/load` of another model or an `/unload` waits; and when the *quantum* is
  spent: other models' requests have waited `quantum_factor` x the next model's
  expected load time (clamped to [quantum_min, quantum_max]), counted from when
  the resident model was ready at the earliest. So the time lost to loads stays
  about 1 / (1 + quantum_factor) of the GPU's time at most, and no request waits
  longer than the quantum, the resident's in-flight requests and its own load.
- Which model next (hold policy): an operator's load or unload first; else the
  model whose requests have waited most in all (the sum of their ages), per
  second of its expected load; a request that has waited quantum_max goes first
  whatever; the resident model, whose quantum just ended, only when no other
  model waits. fifo: the model of the oldest waiting request.
- A failed load fails the requests of its epoch with the error. A crash of the
  resident model removes its container; waiting requests trigger a reload,
  delayed by an exponential backoff while the model keeps failing.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .loadtimes import LoadTimes


class SchedulerError(Exception):
    """Base of the errors a waiting request can get."""


class QueueFull(SchedulerError):
    def __init__(self, waiting: int, retry_after: int = 5):
        super().__init__(f"the swapper queue is full ({waiting} requests waiting); retry later")
        self.retry_after = retry_after


class LoadFailed(SchedulerError):
    """The model could not be made ready; the message carries the cause and logs.
    `kind` is the cause in common.failures (load_failed, load_timeout,
    docker_unreachable)."""

    def __init__(self, message: str, kind: str = "load_failed"):
        super().__init__(message)
        self.kind = kind


class Cancelled(SchedulerError):
    pass


HOLD, FIFO = "hold", "fifo"


@dataclass(frozen=True)
class SwapPolicy:
    """How long a model is kept for its agents' next turns (see the module)."""
    name: str = HOLD
    hold: float = 10.0              # seconds a session's next request goes first, at most
    first_hold: float = 3.0         # ... before the session has come back once
    quantum_factor: float = 3.0     # x the waiting model's expected load time
    quantum_min: float = 5.0
    quantum_max: float = 300.0
    unknown_load: float = 10.0      # the expected load time of a model never loaded
    max_holds: int = 256            # sessions held at once (more: no new holds)

    @classmethod
    def from_settings(cls, s) -> "SwapPolicy":
        return cls(name=s.SWAP_POLICY, hold=s.HOLD_SECONDS, first_hold=s.HOLD_FIRST_SECONDS,
                   quantum_factor=s.QUANTUM_FACTOR,
                   quantum_min=s.QUANTUM_MIN_SECONDS, quantum_max=s.QUANTUM_MAX_SECONDS)


IDLE, LOADING, READY, STOPPING = "idle", "loading", "ready", "stopping"

# The event each phase change publishes (for the model that phase is about).
PHASE_EVENTS = {LOADING: "load_started", READY: "ready", STOPPING: "unloading", IDLE: "unloaded"}
# A download's `waiting_for` when another process holds MODELS_DIR (swapper.fetch's
# models_dir_lock): ./download-model.sh run by hand, or a second swapper.
OTHER_PROCESS = "another process"


@dataclass(eq=False)
class Ticket:
    """One request's place in line. `model` None means "unload"."""
    seq: int
    model: str | None
    session: str | None = None      # the agent that sent it (None: no holds)
    urgent: bool = False            # an operator's load: no hold or quantum delays it
    epoch: int | None = None
    state: str = "waiting"          # waiting | admitted | done | failed | cancelled
    error: SchedulerError | None = None
    backend: Any = None             # what the driver reported for the epoch (address...)
    event: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0          # the scheduler's clock when it was submitted
    admitted_at: float | None = None

    @property
    def wait_seconds(self) -> float | None:
        """How long it waited for admission (a load, a swap, a free slot)."""
        return None if self.admitted_at is None else max(0.0, self.admitted_at - self.queued_at)


@dataclass(frozen=True)
class Action:
    kind: str                       # "load" | "stop"
    model: str
    epoch: int
    delay: float = 0.0              # backoff before a load, seconds
    # Why: a load's "request" | "operator" | "restart"; a stop's "swap" (nothing
    # held the resident model), "quantum" (its sessions were still coming),
    # "operator", "unload", "idle", "crash".
    cause: str = "request"
    # On a stop: the model that waits first (likely the next load), so the
    # driver can create its container while this one stops. A hint only: the
    # next load action is what counts.
    next_model: str | None = None


class Scheduler:
    def __init__(self, slots: Callable[[str], int], max_queue: int = 64,
                 backoff_base: float = 1.0, backoff_max: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 load_times: LoadTimes | None = None, policy: SwapPolicy | None = None):
        self._slots = slots
        self.policy = policy or SwapPolicy()
        self.max_queue = max_queue
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._clock = clock
        self._cv = threading.Condition()
        self._seq = itertools.count(1)
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
        self._failures: dict[str, int] = {}
        self._last_error: dict[str, str] = {}     # model -> why its last load failed
        self.progress: dict = {}                  # the running load's latest progress
        # Past load durations per model: the ETA of a load (swapper/loadtimes.py).
        self.load_times = load_times or LoadTimes()
        self.last_swap_seconds: float | None = None   # a stop's start to the next ready
        self._swap_t0: tuple[float, str] | None = None  # (when, model) of the last stop
        self._load_delay = 0.0                  # the running load's backoff, seconds
        # Downloads on first use (swapper/download.py). A model whose files are
        # missing (the driver says so: mark_missing) is downloaded when first
        # asked for; meanwhile its requests are parked: they wait in the queue
        # but take no part in the policy (no swap, no stop of the resident model),
        # so other models are served during the download.
        self._missing: set[str] = set()
        self.downloads: dict[str, dict] = {}       # model -> progress of its download
        self._download_jobs: list[str] = []        # downloads for the downloader to start
        self._download_started: dict[str, float] = {}
        self._listeners: list[Callable[[str, dict], None]] = []
        # Holds (see the module): session -> when its hold ends, for the resident
        # epoch only (cleared whenever the phase changes).
        self._holds: dict[str, float] = {}
        self._gaps = _Gaps()                   # each session's recent tool-call gaps
        self._wake_at: float | None = None     # when a running hold or quantum ends
        self._holding_since: float | None = None
        self._stopped: str | None = None       # the model stopped last
        self._load_cause = "request"           # why the running load was started
        # The GPU's time lost to loads: (when, seconds) of the last hour's loads.
        self._loaded: collections.deque[tuple[float, float]] = collections.deque(maxlen=10000)
        self.load_seconds_total = 0.0

    # ---------------------------------------------------------------- requests
    def submit(self, model: str | None, session: str | None = None,
               urgent: bool = False) -> Ticket:
        """Queue a request for `model` (None = unload) from `session` (the agent
        that sent it; None: it neither holds nor uses holds); `urgent`: an
        operator's load. Raises QueueFull."""
        return self.submit_many(model, 1, session, urgent)[0]

    def submit_many(self, model: str | None, count: int, session: str | None = None,
                    urgent: bool = False) -> list[Ticket]:
        """Queue `count` requests for `model` at once, so they land in the same
        epoch (the members of one fan-out). Raises QueueFull for all of them."""
        with self._cv:
            if len(self._queue) + count > self.max_queue:
                raise QueueFull(len(self._queue))
            if session is not None:
                self._gaps.came_back(session, self._clock(), self.policy.hold)
                if model != self.model:
                    self._break_hold(session, "other_model")   # its turn moved on
            joins = model is not None and model == self.model and (
                self.phase == LOADING or (self.phase == READY and (
                    not self._others_waiting() or self._in_turn(session))))
            if joins and self.phase == READY and self._others_waiting():
                self._emit("hold_used", model=model, session=_short(session))
            if model is not None and model in self._missing and model not in self.downloads:
                self._start_download(model)
            tickets = []
            now = self._clock()
            for _ in range(count):
                t = Ticket(next(self._seq), model, session, urgent, queued_at=now)
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
                self._break_hold(ticket.session, "client_gone")
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
        now = self.last_activity = self._clock()
        if ok and ticket.model:
            self._failures.pop(ticket.model, None)
        if ticket.session is not None:
            if not ok:
                self._break_hold(ticket.session,
                                 "client_gone" if cause == "client_gone" else "failed")
            elif (self.policy.name == HOLD and self.phase == READY
                  and ticket.model == self.model and ticket.epoch == self.epoch
                  and (ticket.session in self._holds or len(self._holds) < self.policy.max_holds)
                  and not any(t.session == ticket.session and t.model != self.model
                              for t in self._queue)):     # its turn moved on already
                self._holds[ticket.session] = now + self._hold_for(ticket.session)
            self._gaps.released(ticket.session, now)
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
                self._failures[model] = self._failures.get(model, 0) + 1
                self._swap_t0 = None
                self._set_phase(IDLE, None)
                for t in [t for t in self._queue if t.epoch == epoch]:
                    self._queue.remove(t)
                    t.state, t.error = "failed", error
                    t.event.set()
                self._last_error[model] = str(error)
                self._emit("load_failed", model=model, error=str(error), cause=error.kind)
            else:
                self._backend = backend
                self._last_error.pop(self.model, None)
                seconds = self._clock() - self.since - self._load_delay
                self.load_times.add(self.model, seconds)
                self._loaded.append((self._clock(), seconds))
                self.load_seconds_total += seconds
                if self._swap_t0 is not None and self._swap_t0[1] != self.model:
                    self.last_swap_seconds = round(self._clock() - self._swap_t0[0], 3)
                self._swap_t0 = None
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
            self._failures[model] = self._failures.get(model, 0) + 1
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
    def mark_missing(self, models) -> None:
        """The driver found these models' files absent: the next request for one
        downloads it first (a model resident now is left alone)."""
        with self._cv:
            for m in models:
                if m != self.model or self.phase == IDLE:
                    self._missing.add(m)

    def next_download(self, timeout: float | None = None) -> str | None:
        """The downloader's next model to fetch, waiting up to `timeout`."""
        with self._cv:
            if not self._download_jobs:
                self._cv.wait_for(lambda: bool(self._download_jobs), timeout)
            return self._download_jobs.pop(0) if self._download_jobs else None

    def download_progress(self, model: str, done: int, total: int | None,
                          rate: float | None = None, eta: float | None = None,
                          waiting_for: str | None = None) -> None:
        """A download's bytes so far, or (`waiting_for`) the model whose download
        on the same disk it waits for."""
        with self._cv:
            d = self.downloads.get(model)
            if d is None:
                return
            d.update(done_bytes=done, total_bytes=total,
                     bytes_per_second=None if rate is None else round(rate),
                     eta_seconds=None if eta is None else round(eta, 1),
                     waiting_for=waiting_for)
            self._emit("download_progress", **d)

    def download_done(self, model: str, error: LoadFailed | None = None) -> None:
        """The download of `model` ended: its parked requests take part in the
        policy again (so it loads), or they fail with the download's error."""
        with self._cv:
            d = self.downloads.pop(model, None)
            if d is None:
                return
            seconds = round(self._clock() - self._download_started.pop(model, self._clock()), 3)
            if error is not None:
                for t in [t for t in self._queue if t.model == model]:
                    self._queue.remove(t)
                    t.state, t.error = "failed", error
                    t.event.set()
                self._last_error[model] = str(error)
                self._emit("download_failed", model=model, error=str(error), cause=error.kind,
                           seconds=seconds)
            else:
                self._missing.discard(model)
                self._last_error.pop(model, None)
                self._emit("downloaded", model=model, seconds=seconds,
                           total_bytes=d.get("total_bytes"))
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
            self._missing.add(model)
            if model not in self.downloads:
                self._start_download(model)
            self._schedule()

    def _start_download(self, model: str) -> None:
        self._download_started[model] = self._clock()
        self.downloads[model] = {"model": model, "done_bytes": 0,
                                 "total_bytes": None, "bytes_per_second": None,
                                 "eta_seconds": None, "waiting_for": None}
        self._download_jobs.append(model)
        self._last_error.pop(model, None)
        self._emit("download_started", model=model)
        self._cv.notify_all()

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
                             **self._eta(self.model, seconds)}
            self._emit("progress", **self.progress)

    def model_status(self, model: str) -> dict:
        """A model's status in the shape llama.cpp's router and llama-swap use:
        {"value": "loaded" | "loading" | "unloading" | "unloaded" | "failed"},
        with the last failure's message while it is the latest word."""
        with self._cv:
            if model in self.downloads:
                return {"value": "downloading", **{k: v for k, v in self.downloads[model].items()
                                                   if k != "model"}}
            if model == self.model:
                value = {LOADING: "loading", READY: "loaded", STOPPING: "unloading"}[self.phase]
            else:
                value = "failed" if model in self._last_error else "unloaded"
            out = {"value": value}
            if value == "loading":
                elapsed = self._clock() - self.since
                out.update(elapsed_seconds=round(elapsed, 1), **self._eta(model, elapsed))
            if model in self._last_error:
                out["failure"] = self._last_error[model]
            return out

    def snapshot(self) -> dict:
        with self._cv:
            return {
                "model": self.model,
                "state": self.phase,
                "since": self.since,
                "epoch": self.epoch,
                "in_flight": len(self._active),
                "queued": len(self._queue),
                "queued_by_model": _count(t.model or "(unload)" for t in self._queue),
                "failures": dict(self._failures),
                "backend": self._backend,
                "progress": dict(self.progress),
                "downloads": {m: dict(d) for m, d in self.downloads.items()},
                "expected_seconds": self.load_times.expected(self.model)
                if self.phase == LOADING else None,
                "last_swap_seconds": self.last_swap_seconds,
                "policy": self.policy.name,
                "hold": self._hold_status(),
                **self._load_cost(),
            }

    def _load_cost(self) -> dict:
        """Loads in the last hour and the seconds they took (the console's
        swaps per hour and seconds lost to loads), and all seconds since start."""
        hour_ago = self._clock() - 3600
        while self._loaded and self._loaded[0][0] < hour_ago:
            self._loaded.popleft()
        return {"loads_last_hour": len(self._loaded),
                "load_seconds_last_hour": round(sum(s for _, s in self._loaded), 1),
                "load_seconds_total": round(self.load_seconds_total, 1)}

    def _hold_status(self) -> dict | None:
        """While holds keep the resident model from other models' requests:
        how many sessions, until when at most, when the quantum ends."""
        if self._holding_since is None or self._wake_at is None or not self._holds:
            return None
        now = self._clock()
        queue = self._eligible()
        return {"sessions": len(self._holds),
                "until_seconds": round(max(0.0, max(self._holds.values()) - now), 1),
                "quantum_ends_in": round(max(0.0, self._quantum_end(queue) - now), 1),
                "waiting_model": self._next_model(queue) if queue else None}

    def _eta(self, model: str, elapsed: float) -> dict:
        """{expected_seconds, eta_seconds} of a load of `model` running `elapsed`
        seconds, from its past loads; {} without any."""
        eta = self.load_times.remaining(model, elapsed)
        return {} if eta is None else {"expected_seconds": self.load_times.expected(model),
                                       "eta_seconds": eta}

    def subscribe(self, listener: Callable[[str, dict], None]) -> None:
        """Call `listener(event, fields)` on state events (metrics, logs)."""
        self._listeners.append(listener)

    # ---------------------------------------------------------------- policy
    def _others_waiting(self) -> bool:
        return any(t.epoch != self.epoch or t.model != self.model for t in self._eligible())

    def _eligible(self) -> list[Ticket]:
        """The queue as the policy sees it: without requests parked on a download."""
        if not self.downloads:
            return self._queue
        return [t for t in self._queue if t.model is None or t.model not in self.downloads]

    def _schedule(self) -> None:
        """Apply the policy after any change. Called with the lock held."""
        self._wake_at = None
        queue = self._eligible()
        if self.phase == READY:
            slots = self._slots(self.model)
            in_epoch = sum(1 for t in self._active if t.epoch == self.epoch)
            for t in list(queue):
                if in_epoch >= slots:
                    break
                if t.epoch == self.epoch:
                    self._admit(t)
                    in_epoch += 1
            queue = self._eligible()
            if in_epoch == 0 and queue and not any(t.epoch == self.epoch for t in queue):
                if self._held(queue):
                    return                  # its sessions' next turns go first
                model = self._next_model(queue)
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
                self._swap_t0 = None        # an unload: no load followed the stop
            if queue:
                model = self._next_model(queue)
                urgent = any(t.urgent for t in queue if t.model == model)
                failures = self._failures.get(model, 0)
                self._load_cause = "operator" if urgent else "restart" if failures else "request"
                self.epoch += 1
                self._set_phase(LOADING, model)
                self._join_epoch(model)
                delay = 0.0 if not failures else min(
                    self.backoff_base * 2 ** (failures - 1), self.backoff_max)
                self._load_delay = delay
                self._post(Action("load", model, self.epoch, delay, cause=self._load_cause))
        # LOADING and STOPPING wait for the driver.

    # ------------------------------------------------------------- holds
    def _in_turn(self, session: str | None) -> bool:
        """May a request of `session` for the ready model join its epoch while
        other models wait? While its hold runs or it has a request in flight,
        within the quantum, with no operator's action waiting."""
        if self.policy.name != HOLD or session is None:
            return False
        now = self._clock()
        if not (self._holds.get(session, 0.0) > now
                or any(t.session == session and t.epoch == self.epoch for t in self._active)):
            return False
        queue = self._eligible()
        return not self._operator_waits(queue) and now < self._quantum_end(queue)

    def _held(self, queue: list[Ticket]) -> bool:
        """Does a running hold keep the drained resident model while `queue`
        (other models') waits? Sets _wake_at to when that stops being so."""
        if (self.policy.name != HOLD or not self._holds or self._operator_waits(queue)
                or all(t.model == self.model for t in queue)):
            self._holding_since = None
            return False
        now = self._clock()
        for session, until in list(self._holds.items()):
            if until <= now:
                del self._holds[session]
                if self._holding_since is not None:
                    self._emit("hold_expired", model=self.model, session=_short(session))
        quantum_end = self._quantum_end(queue)
        if not self._holds or now >= quantum_end:
            return False
        self._wake_at = min(max(self._holds.values()), quantum_end)
        if self._holding_since is None:
            self._holding_since = now
            self._emit("holding", model=self.model, sessions=len(self._holds),
                       until_seconds=round(max(self._holds.values()) - now, 1),
                       quantum_ends_in=round(quantum_end - now, 1),
                       waiting=self._next_model(queue))
        return True

    def _stop_cause(self, queue: list[Ticket]) -> str:
        if any(t.model is None for t in queue):
            return "unload"
        if self._operator_waits(queue):
            return "operator"
        if self._holds and self.policy.name == HOLD:
            self._emit("quantum_spent", model=self.model, sessions=len(self._holds))
            return "quantum"
        return "swap"

    @staticmethod
    def _operator_waits(queue: list[Ticket]) -> bool:
        return any(t.urgent or t.model is None for t in queue)

    def _expected_load(self, model: str | None) -> float:
        exp = self.load_times.expected(model)
        return self.policy.unknown_load if exp is None else exp

    def _quantum_end(self, queue: list[Ticket]) -> float:
        """When the resident model's stint ends for the models waiting in
        `queue`: the quantum, priced by the next model's load, counted from the
        oldest wait, but not from before the resident model was ready."""
        others = [t for t in queue if t.model != self.model or t.epoch != self.epoch]
        if not others:
            return float("inf")
        p = self.policy
        quantum = min(max(p.quantum_factor * self._expected_load(self._next_model(others)),
                          p.quantum_min), p.quantum_max)
        start = max(self.since if self.phase == READY else self._clock(),
                    min(t.queued_at for t in others))
        return start + quantum

    def _next_model(self, queue: list[Ticket]) -> str | None:
        """The model to serve next among those waiting (see the module)."""
        if self.policy.name != HOLD:
            return queue[0].model
        operator = [t for t in queue if t.urgent or t.model is None]
        if operator:
            return operator[0].model
        now = self._clock()
        if now - queue[0].queued_at >= self.policy.quantum_max:
            return queue[0].model           # waited long enough: first, whatever
        ages: dict[str, float] = {}
        for t in queue:
            ages[t.model] = ages.get(t.model, 0.0) + (now - t.queued_at) + 1.0
        if len(ages) > 1:                   # its quantum ended: others first
            ages.pop(self.model if self.phase != IDLE else self._stopped, None)
        # Highest waiting per second of load; ties: the oldest (dict order).
        return max(ages, key=lambda m: ages[m] / max(1.0, self._expected_load(m)))

    def _hold_for(self, session: str) -> float:
        """A session's hold: twice its longest recent gap between an answer and
        its next request, plus a second, at most `hold`; `first_hold` until it
        has come back once (one-shot clients hold little): an agent whose tools
        take 1 s does not keep a model 10 s after its last turn."""
        gap = self._gaps.longest(session)
        if gap is None:             # its first turn: it may never come back
            return min(self.policy.hold, self.policy.first_hold)
        return min(self.policy.hold, 2 * gap + 1.0)

    def _break_hold(self, session: str, why: str) -> None:
        if self._holds.pop(session, None) is not None:
            self._emit("hold_broken", model=self.model, session=_short(session), reason=why)

    def _admit(self, t: Ticket) -> None:
        self._queue.remove(t)
        self._active.add(t)
        self._told_in_flight()
        t.state = "admitted"
        t.backend = self._backend
        self.last_activity = t.admitted_at = self._clock()
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
        waiting = self._next_model(queue) if queue else None
        self._set_phase(STOPPING, model)
        self._stopped = model
        self._swap_t0 = (self.since, model)     # a swap when another model's load follows
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
            self._holds.clear()             # holds belong to one residency
            self._holding_since = self._wake_at = None
        self.since = self._clock()
        if phase != LOADING:
            self.progress = {}
        if old != (phase, model):
            extra = {**self._eta(model, 0.0), "cause": self._load_cause} \
                if phase == LOADING else {}
            self._emit(PHASE_EVENTS[phase], model=model or old[1], previous=old[0],
                       seconds=round(self.since - old_since, 3), **extra)

    def _post(self, action: Action) -> None:
        self._action = action
        self._cv.notify_all()

    def notify(self, event: str, **fields) -> None:
        """Tell the listeners (/events, metrics) of something the driver did
        (`saving`, `restoring`): events of the stack's one stream."""
        self._emit(event, **fields)

    def _emit(self, event: str, **fields) -> None:
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:  # a metrics bug must never wedge scheduling
                pass

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


class _Gaps:
    """Each session's last few gaps (its request's end to its next request),
    for the last MAX sessions seen."""
    MAX, KEEP = 1024, 3

    def __init__(self):
        self._released: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._gaps: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def released(self, session: str, now: float) -> None:
        self._released[session] = now
        self._released.move_to_end(session)
        while len(self._released) > self.MAX:
            self._released.popitem(last=False)

    def came_back(self, session: str, now: float, cap: float) -> None:
        t = self._released.pop(session, None)
        if t is None:
            return
        gaps = self._gaps.pop(session, [])
        gaps = (gaps + [min(cap, max(0.0, now - t))])[-self.KEEP:]
        self._gaps[session] = gaps
        while len(self._gaps) > self.MAX:
            self._gaps.popitem(last=False)

    def longest(self, session: str) -> float | None:
        gaps = self._gaps.get(session)
        return max(gaps) if gaps else None


def _short(session: str | None) -> str | None:
    """A session as events and /running show it (its key is already a digest)."""
    return None if session is None else session[:12]


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out
