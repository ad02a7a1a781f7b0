"""The swap policy: which model the GPU serves next, and whether the resident
model is kept for its agents' next turns. The scheduler (swapper/scheduler.py)
owns the one-resident state machine, the queue and the epochs, and asks its
policy at each decision; a policy holds no lock and takes no action, it only
answers (and keeps its own bookkeeping: the holds, each session's gaps).

Two policies of one interface (`Policy`): `Hold` (the default) and `Fifo` (the
policy without holds). What a policy sees of the scheduler is a `Stint`.

- Holds (policy "hold"). A request that ends well on the resident model gives
  its *session* (the agent that sent it, swapper/sessions.py) a hold:
  `first_hold` seconds, then (once it has come back) twice its longest recent
  gap plus a second, at most `hold`. That session's next request for the
  resident model joins the epoch although other models wait, and the resident
  model is not stopped while a hold runs. An agent's turn (answer, tool call,
  next request) so stays on the model it started on. Holds end early: the
  session asks for another model, hangs up or fails; an operator `/load` of
  another model or an `/unload` waits; and when the *quantum* is spent: other
  models' requests have waited `quantum_factor` x the next model's expected
  load time (clamped to [quantum_min, quantum_max]), counted from when the
  resident model was ready at the earliest. So the time lost to loads stays
  about 1 / (1 + quantum_factor) of the GPU's time at most, and no request
  waits longer than the quantum, the resident's in-flight requests and its own
  load.
- Which model next (hold policy): an operator's load or unload first; else the
  model whose requests have waited most in all (the sum of their ages), per
  second of its expected load; a request that has waited quantum_max goes first
  whatever; the resident model, whose quantum just ended, only when no other
  model waits. fifo: the model of the oldest waiting request.
- Tenants (both policies; swapper/tenants.py). Within a model, waiting
  requests are admitted in fair order by tenant (weighted start-time fair
  queueing; within one tenant first come, first served). Each load's seconds are
  charged to the tenants whose waiting requests caused it (split by weight). Hold
  policy: a tenant
  over its weighted share of those seconds waits for the next stint instead of
  forcing one: its requests neither end the resident model's quantum (only
  `quantum_max` does) nor pick the next model while another tenant's requests
  wait; when nothing else waits, they are served as before (the GPU never idles
  for fairness). With one tenant every decision is the one without tenants.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from .tenants import Shares, split

HOLD, FIFO = "hold", "fifo"


@dataclass(frozen=True)
class SwapPolicy:
    """The policy's settings (see the module); `build` makes the policy."""
    name: str = HOLD
    hold: float = 10.0              # seconds a session's next request goes first, at most
    first_hold: float = 3.0         # ... before the session has come back once
    quantum_factor: float = 3.0     # x the waiting model's expected load time
    quantum_min: float = 5.0
    quantum_max: float = 300.0
    unknown_load: float = 10.0      # the expected load time of a model never loaded
    max_holds: int = 256            # sessions held at once (more: no new holds)
    fair_half_life: float = 900.0   # tenants' load-seconds account halves in this, seconds
    fair_slack: float = 0.1         # over its share: by more than this fraction
    max_tenants: int = 256          # tenants remembered (the least recently seen go)

    @classmethod
    def from_settings(cls, s) -> "SwapPolicy":
        return cls(name=s.SWAP_POLICY, hold=s.HOLD_SECONDS, first_hold=s.HOLD_FIRST_SECONDS,
                   quantum_factor=s.QUANTUM_FACTOR,
                   quantum_min=s.QUANTUM_MIN_SECONDS, quantum_max=s.QUANTUM_MAX_SECONDS,
                   fair_half_life=s.FAIR_HALF_LIFE_SECONDS, fair_slack=s.FAIR_SLACK)

    def build(self, clock: Callable[[], float] = time.monotonic,
              expected: Callable[[str | None], float | None] = lambda m: None,
              emit: Callable[..., None] = lambda event, **fields: None) -> "Policy":
        """The policy these settings name: `Hold` for "hold", else `Fifo`.
        `expected(model)`: its expected load seconds (None: never loaded);
        `emit(event, **fields)`: the scheduler's events."""
        return (Hold if self.name == HOLD else Fifo)(self, clock, expected, emit)


@dataclass(frozen=True)
class Stint:
    """What a policy sees of the scheduler at a decision."""
    model: str | None               # the resident model (loading, ready, stopping); None: idle
    epoch: int
    ready_since: float | None       # when the resident model became ready; None: not ready
    last: str | None                # the resident model, else the model stopped last


class Policy(Protocol):
    """What the scheduler asks, and tells, its swap policy. `queue` is the
    waiting tickets as the policy sees them (oldest first; without those parked
    on a download), `active` the admitted ones; tickets have `model`, `session`,
    `epoch`, `urgent` and `queued_at`."""
    settings: SwapPolicy

    @property
    def name(self) -> str: ...

    def came(self, session: str, model: str | None, stint: Stint) -> None:
        """A request of `session` for `model` (None: unload) is submitted."""

    def in_turn(self, session: str | None, stint: Stint, queue: list, active: Iterable) -> bool:
        """May this request of `session` for the ready model join its epoch
        although other models wait?"""

    def gone(self, session: str, stint: Stint) -> None:
        """The client of a request of `session` went away."""

    def released(self, ticket: Any, ok: bool, cause: str | None, stint: Stint,
                 queue: list) -> None:
        """An admitted request of a session ended (`ok`: the backend answered;
        `cause`: why not). `queue`: all waiting tickets."""

    def held(self, queue: list, stint: Stint) -> float | None:
        """The ready model is drained and other models wait in `queue`: is it
        kept for its sessions' next turns? Until when (the scheduler wakes then
        and asks again); None: no, it may be stopped."""

    def next_model(self, queue: list, stint: Stint) -> str | None:
        """The model to serve next among those waiting in `queue` (not empty)."""

    def stop_cause(self, stint: Stint) -> str:
        """Why the resident model is stopped when no operator asked: "quantum"
        (its sessions were still coming) or "swap"."""

    def new_stint(self) -> None:
        """The phase or the resident model changed."""

    def status(self, queue: list, stint: Stint) -> dict | None:
        """While `held` keeps the resident model: what the snapshot shows."""

    def tag(self, ticket: Any) -> None:
        """A ticket is submitted: its place in its model's fair order."""

    def order(self, tickets: list) -> list:
        """Waiting tickets of the epoch in the order they are admitted."""

    def admitted(self, ticket: Any) -> None:
        """A ticket got its slot."""

    def loaded(self, model: str, seconds: float, tenants: Iterable[str],
               tickets: Iterable = ()) -> None:
        """A load of `model` took `seconds`; `tenants`: whose waiting requests
        caused it (charged); `tickets`: those requests still waiting (each told
        its share: tenants.split)."""

    def tenants(self, queue: list, active: Iterable) -> dict:
        """Per tenant: weight, charged load seconds, queued, in flight (/running)."""


def operator_waits(queue) -> bool:
    """An operator's load or unload waits in `queue`."""
    return any(t.urgent or t.model is None for t in queue)


def short(session: str | None) -> str | None:
    """A session as events and /running show it (its key is already a digest)."""
    return None if session is None else session[:12]


class Tenants:
    """What both policies do about tenants (see the module): the fair order
    within a model and the load-seconds account, kept in `shares`."""

    def __init__(self, settings: SwapPolicy, clock: Callable[[], float],
                 emit: Callable[..., None]):
        self.shares = Shares(clock, settings.fair_half_life, settings.fair_slack,
                             settings.max_tenants)
        self._emit = emit

    def tag(self, ticket) -> None:
        self.shares.tag(ticket)

    def order(self, tickets) -> list:
        return self.shares.order(tickets)

    def admitted(self, ticket) -> None:
        self.shares.admitted(ticket)

    def loaded(self, model, seconds, tenants, tickets=()) -> None:
        parts = self.shares.charge(seconds, tenants)
        split(parts, tickets)
        for tenant, part in parts.items():
            self._emit("charged", model=model, tenant=tenant, seconds=round(part, 3))

    def tenants(self, queue, active) -> dict:
        return self.shares.status(queue, active)

    def _over(self, queue) -> set[str]:
        """The tenants over their share, among those charged and waiting."""
        return self.shares.overs({t.tenant for t in queue})


class Fifo(Tenants):
    """No holds: swap as soon as the resident model is drained; the model of
    the oldest waiting request goes next (whatever its tenant's charge)."""

    def __init__(self, settings: SwapPolicy, clock: Callable[[], float] = time.monotonic,
                 expected: Callable[[str | None], float | None] = lambda m: None,
                 emit: Callable[..., None] = lambda event, **fields: None):
        super().__init__(settings, clock, emit)
        self.settings = settings

    @property
    def name(self) -> str:
        return self.settings.name

    def came(self, session, model, stint) -> None:
        pass

    def in_turn(self, session, stint, queue, active) -> bool:
        return False

    def gone(self, session, stint) -> None:
        pass

    def released(self, ticket, ok, cause, stint, queue) -> None:
        pass

    def held(self, queue, stint) -> float | None:
        return None

    def next_model(self, queue, stint) -> str | None:
        return queue[0].model

    def stop_cause(self, stint) -> str:
        return "swap"

    def new_stint(self) -> None:
        pass

    def status(self, queue, stint) -> dict | None:
        return None


class Hold(Tenants):
    """Holds within a quantum (see the module): the holds of the resident
    model's stint (session -> when its hold ends) and each session's gaps; a
    tenant over its share does not force a swap."""

    def __init__(self, settings: SwapPolicy, clock: Callable[[], float] = time.monotonic,
                 expected: Callable[[str | None], float | None] = lambda m: None,
                 emit: Callable[..., None] = lambda event, **fields: None):
        super().__init__(settings, clock, emit)
        self.settings = settings
        self._clock = clock
        self._expected = expected
        self._emit = emit
        self.holds: dict[str, float] = {}     # cleared whenever the stint changes
        self._gaps = Gaps()                   # each session's recent tool-call gaps
        self._holding_since: float | None = None

    @property
    def name(self) -> str:
        return self.settings.name

    def came(self, session, model, stint) -> None:
        self._gaps.came_back(session, self._clock(), self.settings.hold)
        if model != stint.model:
            self._break(session, "other_model", stint)     # its turn moved on

    def in_turn(self, session, stint, queue, active) -> bool:
        """While its hold runs or it has a request in flight, within the
        quantum, with no operator's action waiting."""
        if session is None:
            return False
        now = self._clock()
        if not (self.holds.get(session, 0.0) > now
                or any(t.session == session and t.epoch == stint.epoch for t in active)):
            return False
        return not operator_waits(queue) and now < self._quantum_end(queue, stint)

    def gone(self, session, stint) -> None:
        self._break(session, "client_gone", stint)

    def released(self, ticket, ok, cause, stint, queue) -> None:
        session, now = ticket.session, self._clock()
        if not ok:
            self._break(session, "client_gone" if cause == "client_gone" else "failed", stint)
        elif (stint.ready_since is not None
              and ticket.model == stint.model and ticket.epoch == stint.epoch
              and (session in self.holds or len(self.holds) < self.settings.max_holds)
              and not any(t.session == session and t.model != stint.model
                          for t in queue)):     # its turn moved on already
            self.holds[session] = now + self._hold_for(session)
        self._gaps.released(session, now)

    def held(self, queue, stint) -> float | None:
        if (not self.holds or operator_waits(queue)
                or all(t.model == stint.model for t in queue)):
            self._holding_since = None
            return None
        now = self._clock()
        for session, until in list(self.holds.items()):
            if until <= now:
                del self.holds[session]
                if self._holding_since is not None:
                    self._emit("hold_expired", model=stint.model, session=short(session))
        quantum_end = self._quantum_end(queue, stint)
        if not self.holds or now >= quantum_end:
            return None
        if self._holding_since is None:
            self._holding_since = now
            self._emit("holding", model=stint.model, sessions=len(self.holds),
                       until_seconds=round(max(self.holds.values()) - now, 1),
                       quantum_ends_in=round(quantum_end - now, 1),
                       waiting=self.next_model(queue, stint))
        return min(max(self.holds.values()), quantum_end)

    def next_model(self, queue, stint) -> str | None:
        operator = [t for t in queue if t.urgent or t.model is None]
        if operator:
            return operator[0].model
        now = self._clock()
        if now - queue[0].queued_at >= self.settings.quantum_max:
            return queue[0].model           # waited long enough: first, whatever
        # A tenant over its share waits for the next stint while others wait.
        over = self._over(queue)
        fair = [t for t in queue if t.tenant not in over] if over else queue
        ages: dict[str, float] = {}
        for t in fair or queue:
            ages[t.model] = ages.get(t.model, 0.0) + (now - t.queued_at) + 1.0
        if len(ages) > 1:                   # its quantum ended: others first
            ages.pop(stint.last, None)
        # Highest waiting per second of load; ties: the oldest (dict order).
        return max(ages, key=lambda m: ages[m] / max(1.0, self._expected_load(m)))

    def stop_cause(self, stint) -> str:
        if self.holds:
            self._emit("quantum_spent", model=stint.model, sessions=len(self.holds))
            return "quantum"
        return "swap"

    def new_stint(self) -> None:
        self.holds.clear()                  # holds belong to one residency
        self._holding_since = None

    def status(self, queue, stint) -> dict | None:
        """How many sessions, until when at most, when the quantum ends."""
        if self._holding_since is None or not self.holds:
            return None
        now = self._clock()
        return {"sessions": len(self.holds),
                "until_seconds": round(max(0.0, max(self.holds.values()) - now), 1),
                "quantum_ends_in": round(max(0.0, self._quantum_end(queue, stint) - now), 1),
                "waiting_model": self.next_model(queue, stint) if queue else None}

    def _expected_load(self, model: str | None) -> float:
        exp = self._expected(model)
        return self.settings.unknown_load if exp is None else exp

    def _quantum_end(self, queue, stint) -> float:
        """When the resident model's stint ends for the models waiting in
        `queue`: the quantum, priced by the next model's load, counted from the
        oldest wait, but not from before the resident model was ready."""
        others = [t for t in queue if t.model != stint.model or t.epoch != stint.epoch]
        if not others:
            return float("inf")
        p = self.settings
        # Requests of a tenant over its share do not end the stint: only
        # quantum_max does, while no other tenant's request waits.
        over = self._over(queue)
        forcing = [t for t in others if t.tenant not in over] if over else others
        if forcing:
            quantum = min(max(p.quantum_factor * self._expected_load(
                self.next_model(forcing, stint)), p.quantum_min), p.quantum_max)
        else:
            quantum, forcing = p.quantum_max, others
        start = max(stint.ready_since if stint.ready_since is not None else self._clock(),
                    min(t.queued_at for t in forcing))
        return start + quantum

    def _hold_for(self, session: str) -> float:
        """A session's hold: twice its longest recent gap between an answer and
        its next request, plus a second, at most `hold`; `first_hold` until it
        has come back once (one-shot clients hold little): an agent whose tools
        take 1 s does not keep a model 10 s after its last turn."""
        gap = self._gaps.longest(session)
        if gap is None:             # its first turn: it may never come back
            return min(self.settings.hold, self.settings.first_hold)
        return min(self.settings.hold, 2 * gap + 1.0)

    def _break(self, session: str, why: str, stint: Stint) -> None:
        if self.holds.pop(session, None) is not None:
            self._emit("hold_broken", model=stint.model, session=short(session), reason=why)


class Gaps:
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
