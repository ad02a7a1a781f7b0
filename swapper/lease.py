"""Admission, and the one place an admitted request ends.

`Admission.admit()` queues a request for a model and blocks until the
scheduler admits it (noticing a client that goes away meanwhile); it returns a
Lease on one of the model's slots. Whatever ends the request -- its answer
relayed to the end, a body never read (HEAD), the client gone, the backend
failing, one member of a fan-out -- ends it with `lease.finish(status, cause)`.
Only the first call counts: the slot goes back to the scheduler, the request is
counted, and a cause that may be the backend's makes the driver look at its
container (a dead one is reported as a crash, so the next request restarts it).

A lease cannot leak, by construction: every lease is made for a request's WSGI
environ and listed in it, and `EndsLeases`, the outermost layer of the app, ends
whatever the request left open when its answer is closed (the WSGI server
closes every answer, read to its end or not) or when the app raised instead of
answering. Code on the way may finish a lease early and with a better status;
whatever it raises, at whatever line, the request's end comes once, here.
"""
from __future__ import annotations

import threading
import time

from werkzeug.wsgi import ClosingIterator

from common.disconnect import POLL, client_gone
from common.failures import failure

from .downloadqueue import OTHER_PROCESS
from .driver import CONFIRM_DEAD_SECONDS, Driver
from .metrics import SwapperMetrics
from .scheduler import Scheduler
from .tenants import DEFAULT_TENANT, tenant_of
from .tickets import Cancelled, LoadFailed, QueueFull, Ticket

# Causes (common.failures) after which the backend's container is looked at.
BACKEND_CAUSES = frozenset({"unreachable", "closed_early", "broke_off", "upstream_failed"})


class Lease:
    """One admitted request's slot on the resident backend."""

    def __init__(self, admission: "Admission", ticket: Ticket):
        self._admission = admission
        self.ticket = ticket
        self._lock = threading.Lock()
        self.finished = False
        self.conversation = None     # its conversation (swapper/conversations.py), if told

    @property
    def model(self) -> str:
        return self.ticket.model

    @property
    def backend(self):
        return self.ticket.backend

    @property
    def kv(self):
        """The driver's prompt-cache keeper (swapper/kvcache.py), if it has one."""
        return getattr(getattr(self._admission, "driver", None), "kv", None)

    def close(self) -> None:
        """The request ended without finishing its lease (the backstop, see the
        module): a ticket still queued leaves the queue, an admitted one gives
        its slot back, counted as a failed request."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        admitted = self.ticket.state == "admitted"
        self._admission.scheduler.cancel(self.ticket)
        if admitted:
            self._admission.metrics.request_done(self.model, 500)

    def finish(self, status: int, cause: str | None = None) -> bool:
        """End the request (idempotent). `cause` names a failure (a key of
        common.failures.CAUSES). Returns whether the backend is believed to be
        alive (looked at only for causes that may be the backend's)."""
        with self._lock:
            if self.finished:
                return True
            self.finished = True
        a = self._admission
        a.scheduler.release(self.ticket, ok=cause is None and status < 500, cause=cause)
        a.metrics.request_done(self.model, status)
        if cause in BACKEND_CAUSES and self.backend is not None:
            return a.driver.alive(self.backend, confirm=CONFIRM_DEAD_SECONDS)
        return True


class Admission:
    def __init__(self, scheduler: Scheduler, driver: Driver, metrics: SwapperMetrics):
        self.scheduler = scheduler
        self.driver = driver
        self.metrics = metrics

    def admit(self, model: str, environ: dict) -> Lease:
        """Queue for `model`, block until admitted. Raises ApiError."""
        return self.admit_many(model, 1, environ)[0]

    def admit_many(self, model: str, count: int, environ: dict) -> list[Lease]:
        """Queue `count` requests for `model` in one go (a fan-out's members:
        they join the same epoch, so no swap comes between them) and return
        their leases once the first is admitted; wait on the others with
        `wait()`. Raises ApiError."""
        leases = self.queue(model, environ, count)
        try:
            self.wait(leases[0], environ)
        except BaseException:
            self.leave(leases[1:])
            raise
        return leases

    def queue(self, model: str, environ: dict, count: int = 1) -> list[Lease]:
        """Queue `count` requests for `model` without waiting, listed in the
        request's `environ` (EndsLeases ends them). Raises ApiError (queue full)."""
        tenant, weight = tenant_of(environ)     # the proxy's word (swapper/tenants.py)
        leases = [Lease(self, t) for t in self._submit(model, count, environ.get(SESSION),
                                                        environ.get(OPERATOR, False),
                                                        tenant, weight)]
        environ.setdefault(LEASES, []).extend(leases)
        return leases

    def wait(self, lease: Lease, environ: dict, timeout: float | None = None) -> bool:
        """Block until `lease`'s ticket is admitted (True), or `timeout` passes
        (False). Raises ApiError; a client that goes away leaves the queue."""
        return self._wait(lease.ticket, environ, timeout)

    def leave(self, leases: list[Lease]) -> None:
        """Leases given up before they were admitted leave the queue."""
        for lease in leases:
            if lease.ticket.state == "waiting":
                self.scheduler.cancel(lease.ticket)

    def unload(self, environ: dict) -> None:
        """Queue an unload behind what is waiting; return once it is done."""
        self._wait(self._submit(None, 1)[0], environ)

    def _submit(self, model: str | None, count: int, session: str | None = None,
                operator: bool = False, tenant: str = DEFAULT_TENANT,
                weight: float = 1.0) -> list[Ticket]:
        try:
            return self.scheduler.submit_many(model, count, session, operator, tenant, weight)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise failure("queue_full", str(e),
                          headers={"Retry-After": str(e.retry_after)}) from None

    def _wait(self, ticket: Ticket, environ: dict, timeout: float | None = None) -> bool:
        t0 = time.monotonic()
        end = None if timeout is None else t0 + timeout
        try:
            while not self.scheduler.wait(ticket, POLL if end is None else
                                          max(0.0, min(POLL, end - time.monotonic()))):
                if end is not None and time.monotonic() >= end:
                    return False
                if client_gone(environ):
                    self.scheduler.cancel(ticket)
                    raise failure("client_gone", "client disconnected while queued")
        except LoadFailed as e:
            raise failure(e.kind, str(e)) from None
        except Cancelled as e:
            raise failure("client_gone", str(e)) from None
        except BaseException:
            # The greenlet was killed (the fan-out gave up on this member).
            self.scheduler.cancel(ticket)
            raise
        if ticket.model is not None:
            self.metrics.queued(ticket.model, time.monotonic() - t0)
        return True


LEASES = "swapper.leases"           # environ key: the request's leases
SESSION = "swapper.session"         # environ key: its agent session (swapper/sessions.py)
OPERATOR = "swapper.operator"       # environ key: an operator's load (no hold delays it)


class EndsLeases:
    """WSGI middleware, outermost: the one place where a request's leases end
    (see the module). Their owners' finish() comes first when it comes at all;
    close() after it does nothing."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        environ[LEASES] = leases = []
        try:
            answer = self.app(environ, start_response)
        except BaseException:
            _close(leases)
            raise
        return ClosingIterator(answer, lambda: _close(leases))


def _close(leases: list[Lease]) -> None:
    for lease in leases:
        lease.close()


def waiting_for(snapshot: dict, model: str) -> str:
    """What a request for `model` waits for, in words (SSE progress comments)."""
    phase, resident = snapshot["state"], snapshot["model"]
    progress = snapshot.get("progress") or {}
    download = (snapshot.get("downloads") or {}).get(model)
    if download is not None:
        return downloading_text(model, download)
    if resident == model and phase == "loading":
        text = f"loading model {model}"
        if progress.get("seconds") is not None:
            text += f" ({progress['seconds']:g} s"
            text += f": {progress['detail']})" if progress.get("detail") else ")"
        eta = progress.get("eta_seconds", snapshot.get("expected_seconds"))
        if eta is not None:
            text += f", ~{_duration(eta)} left"
        return text
    if resident == model and phase == "ready":
        return (f"waiting for a free slot of {model} ({snapshot['in_flight']} in flight, "
                f"{snapshot['queued']} queued)")
    hold = snapshot.get("hold")
    if resident and phase == "ready" and hold:
        return (f"waiting: {resident} is held for {hold['sessions']} agent session(s) "
                f"up to {hold['until_seconds']:g} s more (its quantum ends in "
                f"{hold['quantum_ends_in']:g} s), then {hold['waiting_model'] or model} loads")
    if resident and phase in ("ready", "stopping"):
        return (f"waiting for {resident} to finish its {snapshot['in_flight']} request(s) "
                f"and unload before {model} loads")
    return f"waiting to load {model} ({snapshot['queued']} queued)"


def downloading_text(model: str, d: dict) -> str:
    """`downloading qwen-35b: 12.4 / 28.5 GB, 85 MB/s, ~3 min`, or `download of
    qwen-35b waits for the download of qwen-8b on the same disk` (`waiting_for`:
    the model whose download goes first, or OTHER_PROCESS)."""
    before = d.get("waiting_for")
    if before:
        return f"download of {model} waits for " + (
            "another process's download into MODELS_DIR" if before == OTHER_PROCESS else
            f"the download of {before} on the same disk")
    done, total = d.get("done_bytes") or 0, d.get("total_bytes")
    rate, eta = d.get("bytes_per_second"), d.get("eta_seconds")
    if total:
        unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
        text = f"downloading {model}: {done / scale:.1f} / {total / scale:.1f} {unit}"
    else:
        text = f"downloading {model}: {_size(done)}"
    if rate:
        text += f", {_size(rate)}/s"
    if eta is not None and rate:
        text += ", ~" + _duration(eta)
    return text


def _duration(seconds: float) -> str:
    """`3 min`, `12 s` (an ETA in a progress comment)."""
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{0 if unit != 'GB' else 1}f} {unit}"
    return f"{int(n)} B"
