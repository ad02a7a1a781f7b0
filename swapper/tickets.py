"""What the scheduler (swapper/scheduler.py) hands out and takes back: a
request's place in line (`Ticket`), the driver's next job (`Action`), the
errors a waiting request can get, and the phases it tells (its snapshot's
`state`). Plain data: the scheduler's lock guards the tickets it holds.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# The scheduler's phases: nothing resident; its model loading, ready, stopping.
IDLE, LOADING, READY, STOPPING = "idle", "loading", "ready", "stopping"


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


@dataclass(eq=False)
class Ticket:
    """One request's place in line. `model` None means "unload"."""
    seq: int
    model: str | None
    session: str | None = None      # the agent that sent it (None: no holds)
    urgent: bool = False            # an operator's load: no hold or quantum delays it
    tenant: str = "default"         # whose request (swapper/tenants.py: the proxy says)
    weight: float = 1.0             # the tenant's weight (its fair share)
    tag: float = 0.0                # its place in its model's fair order (tenants.Shares)
    epoch: int | None = None
    state: str = "waiting"          # waiting | admitted | done | failed | cancelled
    error: SchedulerError | None = None
    backend: Any = None             # what the driver reported for the epoch (address...)
    event: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0          # the scheduler's clock when it was submitted
    admitted_at: float | None = None
    # Its share of the load seconds charged for the load(s) it waited for
    # (swapper/tenants.py `split`): told to the proxy with its queue wait.
    load_seconds: float = 0.0

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
