"""Tenants: whose request it is, and fair shares between them (issue 35).

The proxy (the swapper's only client: compose publishes no swapper port, and the
proxy strips these fields from what its own clients send) tells the swapper on
the internal hop whose request it is:

    X-Coding-Stack-Tenant: <the key's name>
    X-Coding-Stack-Weight: <the key's weight, a float>
    X-Coding-Stack-Models: <the key's model scope, unless every model: common/scope.py>

No field (a box without keys), or a field that fails the strict checks (longer
than MAX_NAME, not printable ASCII, a weight that is not a finite number in
[MIN_WEIGHT, MAX_WEIGHT]): the default tenant, weight 1. The fields never reach
a backend (swapper/forward.py drops them).

`Shares` is what the swap policy (swapper/policy.py) keeps about tenants, pure
(a clock, no lock: the scheduler's lock guards it):

- Within a model, fair order: start-time fair queueing. Each ticket gets a tag
  when it is submitted, max(the model's virtual time, the tenant's last tag on
  that model + 1 / weight); waiting tickets of an epoch are admitted by tag, and
  an admitted ticket moves the model's virtual time to its tag. A tenant's batch
  of 20 so takes every other slot at most against another tenant's agent (with
  equal weights), in the weights' ratio otherwise; within one tenant tags grow
  with each submission: first come, first served, as before. A tenant coming
  back after a pause starts at the virtual time: idle time is no credit.
- Between models, an account: each load's seconds are charged to the tenants
  whose waiting requests caused it (split by their weights: a load that several
  tenants waited for puts none of them over its share), in an account
  that decays by half every `half_life` seconds. A tenant is *over its share*
  when its charge exceeds its weight's share (weight / the sum of the weights of
  the tenants that have a charge or wait now) of all charges by more than
  `slack` (and by more than a second). The hold policy then lets its waiting
  requests wait for the next stint instead of forcing one (swapper/policy.py).
  With one tenant, no tenant is ever over its share: the policy is the one
  without tenants, to the decision.
- Per request (`split`): each tenant's part of a load is split evenly among its
  requests that waited for it (the tickets of the load's epoch when it ends),
  added to each ticket's `load_seconds`; the swapper tells each answer its
  share (common/queuewait.py), so the proxy's per-key totals add up to the
  tenants' charges. A tenant charged whose requests all went away before the
  load ended tells no answer, nor does a /load (its tenant is charged: the
  proxy names the key's tenant there too, but /load is not a model request).
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Iterable

from common import scope

TENANT_HEADER = "X-Coding-Stack-Tenant"
WEIGHT_HEADER = "X-Coding-Stack-Weight"
HEADERS = (TENANT_HEADER, WEIGHT_HEADER, scope.MODELS_HEADER)
DEFAULT_TENANT = "default"
MAX_NAME = 64
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0
OTHER = "other"                 # the metrics label of the tenants beyond the cap

_ENVIRON = {name: "HTTP_" + name.upper().replace("-", "_") for name in HEADERS}


def parse(name: str | None, weight: str | None) -> tuple[str, float]:
    """(tenant, weight) from the two fields' values; the default tenant when the
    name is absent or anything fails the checks."""
    default = (DEFAULT_TENANT, 1.0)
    if name is None or not (1 <= len(name) <= MAX_NAME) or \
            not all(" " <= c <= "~" for c in name) or name != name.strip():
        return default
    if weight is None:
        return name, 1.0
    if len(weight) > 32:
        return default
    try:
        w = float(weight)
    except ValueError:
        return default
    if not math.isfinite(w) or not MIN_WEIGHT <= w <= MAX_WEIGHT:
        return default
    return name, w


def tenant_of(environ: dict) -> tuple[str, float]:
    """A WSGI request's (tenant, weight), from the proxy's fields."""
    return parse(environ.get(_ENVIRON[TENANT_HEADER]), environ.get(_ENVIRON[WEIGHT_HEADER]))


def scope_of(environ: dict) -> tuple[str, ...] | None:
    """The models a WSGI request's key may use (common/scope.py; None: every one)."""
    return scope.parse(environ.get(_ENVIRON[scope.MODELS_HEADER]))


def without_tenant(headers) -> None:
    """Drop the tenant fields from headers about to go to a backend (in place:
    werkzeug Headers, case-insensitive)."""
    for name in HEADERS:
        headers.pop(name, None)


class Shares:
    """Fair order within a model and the load-seconds account (see the module)."""

    def __init__(self, clock: Callable[[], float], half_life: float = 900.0,
                 slack: float = 0.1, max_tenants: int = 256):
        self._clock = clock
        self.half_life = half_life
        self.slack = slack
        self.max_tenants = max_tenants
        self._vtime: dict[str | None, float] = {}            # model -> virtual time
        self._last: collections.OrderedDict[tuple, float] = collections.OrderedDict()
        # tenant -> [decayed charge, when it was last decayed, all-time charge, weight]
        self._acct: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._version = 0             # bumped by any change of charges or weights
        self._overs: tuple | None = None     # (its key, the answer): asked many times a tick

    # ------------------------------------------------------------ fair order
    def tag(self, ticket) -> None:
        """Give a ticket its start tag as it is submitted."""
        key = (ticket.model, ticket.tenant)
        start = max(self._vtime.get(ticket.model, 0.0), self._last.get(key, 0.0))
        ticket.tag = start
        self._last[key] = start + 1.0 / ticket.weight
        self._last.move_to_end(key)
        while len(self._last) > 4 * self.max_tenants:
            self._last.popitem(last=False)
        self._seen(ticket.tenant, ticket.weight)

    def admitted(self, ticket) -> None:
        if ticket.tag > self._vtime.get(ticket.model, 0.0):
            self._vtime[ticket.model] = ticket.tag

    @staticmethod
    def order(tickets: Iterable) -> list:
        """Tickets in fair order: by tag, then as they came."""
        return sorted(tickets, key=lambda t: (t.tag, t.seq))

    # --------------------------------------------------------------- account
    def charge(self, seconds: float, tenants: Iterable[str]) -> dict[str, float]:
        """Charge a load's `seconds` to `tenants`, split by their weights (a
        load they all waited for costs each its weighted share: none of them
        goes over its share by it); returns each tenant's part."""
        names = sorted(set(tenants))
        if not names or seconds <= 0:
            return {}
        weights = sum(self.weight(n) for n in names)
        parts = {n: seconds * self.weight(n) / weights for n in names}
        for name, part in parts.items():
            a = self._entry(name)
            a[0] += part
            a[2] += part
        self._version += 1
        return parts

    def charged(self, tenant: str) -> float:
        """The tenant's decayed charge, seconds."""
        a = self._acct.get(tenant)
        if a is None:
            return 0.0
        self._decay(a)
        return a[0]

    def overs(self, waiting: Iterable[str]) -> set[str]:
        """The tenants that have caused more than their weighted share of the
        load seconds, among those with a charge and those in `waiting` (the
        tenants of the waiting requests)."""
        waiting = frozenset(waiting)
        # The same answer within 50 ms (what decays meanwhile is negligible) for
        # the same charges and waiting tenants: one decision asks several times.
        key = (int(self._clock() * 20), self._version, waiting)
        if self._overs is not None and self._overs[0] == key:
            return set(self._overs[1])
        out = self._compute_overs(waiting)
        self._overs = (key, frozenset(out))
        return out

    def _compute_overs(self, waiting: frozenset) -> set[str]:
        charged = {t: self.charged(t) for t in self._acct}
        if not any(c > 1.0 for c in charged.values()):
            return set()            # nobody can be over by more than a second
        present = {t for t, c in charged.items() if c > 0.01} | waiting
        if len(present) < 2:
            return set()
        total = sum(charged.get(t, 0.0) for t in present)
        weights = sum(self.weight(t) for t in present)
        out = set()
        for t in present:
            mine, fair = charged.get(t, 0.0), total * self.weight(t) / weights
            if mine > fair * (1.0 + self.slack) and mine - fair > 1.0:
                out.add(t)
        return out

    def weight(self, tenant: str) -> float:
        a = self._acct.get(tenant)
        return 1.0 if a is None else a[3]

    def status(self, queue: Iterable, active: Iterable, cap: int = 32) -> dict:
        """Per tenant: its weight, charged load seconds (decayed, and in all),
        queued and in-flight requests, and whether it is over its share; the
        `cap` tenants with the most charged or queued, the rest summed as OTHER."""
        queued = collections.Counter(t.tenant for t in queue)
        flying = collections.Counter(t.tenant for t in active)
        charged = {n: self.charged(n) for n in self._acct}
        names = set(charged) | set(queued) | set(flying)
        over = self.overs(queued)
        ranked = sorted(names, key=lambda n: (-charged.get(n, 0.0), -queued.get(n, 0), n))

        def total(n):
            a = self._acct.get(n)
            return a[2] if a is not None else 0.0

        out = {n: {"weight": self.weight(n),
                   "charged_load_seconds": round(charged.get(n, 0.0), 1),
                   "charged_load_seconds_total": round(total(n), 1),
                   "queued": queued.get(n, 0), "in_flight": flying.get(n, 0),
                   "over_share": n in over} for n in ranked[:cap]}
        rest = ranked[cap:]
        if rest:
            out[OTHER] = {"tenants": len(rest),
                          "charged_load_seconds": round(sum(charged.get(n, 0.0)
                                                            for n in rest), 1),
                          "charged_load_seconds_total": round(sum(map(total, rest)), 1),
                          "queued": sum(queued.get(n, 0) for n in rest),
                          "in_flight": sum(flying.get(n, 0) for n in rest)}
        return out

    def _seen(self, tenant: str, weight: float) -> None:
        a = self._acct.get(tenant)
        if a is None or a[3] != weight:
            self._entry(tenant)[3] = weight
            self._version += 1
        else:
            self._acct.move_to_end(tenant)

    def _entry(self, tenant: str) -> list:
        a = self._acct.get(tenant)
        if a is None:
            a = self._acct[tenant] = [0.0, self._clock(), 0.0, 1.0]
            while len(self._acct) > self.max_tenants:    # the least recently seen goes
                self._acct.popitem(last=False)
        else:
            self._decay(a)
        self._acct.move_to_end(tenant)
        return a

    def _decay(self, a: list) -> None:
        now = self._clock()
        if now > a[1]:
            if self.half_life > 0 and a[0]:
                a[0] *= 0.5 ** ((now - a[1]) / self.half_life)
            a[1] = now


def split(parts: dict[str, float], tickets: Iterable) -> None:
    """Each tenant's part of a load (`Shares.charge`'s answer) split evenly among
    its `tickets` (the requests that waited for the load), added to each one's
    `load_seconds`; a tenant with no ticket here tells no request its part."""
    mine: dict[str, list] = collections.defaultdict(list)
    for t in tickets:
        if t.tenant in parts:
            mine[t.tenant].append(t)
    for tenant, own in mine.items():
        each = parts[tenant] / len(own)
        for t in own:
            t.load_seconds += each


class TenantLabels:
    """A bounded metrics label: the first `cap` tenants seen keep their name,
    any later one is OTHER (an unbounded label would be a memory leak)."""

    def __init__(self, cap: int = 16):
        self.cap = cap
        self._names: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._names:
            return tenant
        if len(self._names) < self.cap:
            self._names.add(tenant)
            return tenant
        return OTHER
