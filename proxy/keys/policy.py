"""The pure parts of keys: what a key is, whether it may use a model, and whether
a request is over one of its limits. No I/O, no clock of their own (the caller
passes `now`, wall-clock seconds): tests/unit/proxy/test_keys_policy.py drives
them with a hand clock.

- A key's models are ids, aliases or shell-style globs (`qwen-*`, `claude-*`),
  matched case-sensitively (fnmatch.fnmatchcase) against the name a request
  asks for and, when the proxy's catalog (the swapper's /v1/models) knows that
  name, the model's id and every alias. `*` is every model.
- Limits: requests per minute (a fixed window: the minute of the wall clock),
  tokens per day (UTC day, counted when an answer ends: a request under the
  limit may overshoot it), concurrent requests. `decide` says which is over,
  and how long until a retry can pass (Retry-After).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Iterable

from common import scope

ROLES = ("use", "admin")
ALL_MODELS = ("*",)
# A key's name: what the tenant header, the logs and the usage carry. `@` starts
# the names the proxy gives to what is not a key (API_KEY's "@api-key").
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
API_KEY_NAME = "@api-key"
DAY = 86400
MINUTE = 60


@dataclass(frozen=True)
class Key:
    """One key as stored (never its token: only its sha256)."""
    name: str
    role: str = "use"
    models: tuple[str, ...] = ALL_MODELS
    max_concurrent: int | None = None
    rpm: int | None = None
    tokens_per_day: int | None = None
    weight: float = 1.0
    created: float = 0.0
    revoked: float | None = None
    id: int | None = field(default=None, compare=False)

    @property
    def limited(self) -> bool:
        return self.max_concurrent is not None or self.rpm is not None or \
            self.tokens_per_day is not None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def public(self) -> dict:
        """What the CLI and GET /admin/keys show."""
        return {"name": self.name, "role": self.role, "models": list(self.models),
                "max_concurrent": self.max_concurrent, "rpm": self.rpm,
                "tokens_per_day": self.tokens_per_day, "weight": self.weight,
                "created": self.created, "revoked": self.revoked}


API_KEY_IDENTITY = Key(API_KEY_NAME, role="admin")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"a key's name is 1-64 letters, digits, '.', '_' or '-' "
                         f"(starting with a letter or digit), not {name!r}")
    return name


def check_models(models: Iterable[str]) -> tuple[str, ...]:
    out = tuple(m.strip() for m in models if isinstance(m, str) and m.strip())
    if not out:
        raise ValueError("a key needs at least one model (an id, alias or glob; `*`: all)")
    return out


def may_use(models: tuple[str, ...], requested: str | None,
            known_as: Iterable[str] = ()) -> bool:
    """True when a key whose scope is `models` may use the model a request names
    (`requested`; None: it names none) which the catalog knows as `known_as` (its
    id and aliases; empty when the catalog does not know the name). A request
    naming no model goes to whatever is resident: only an all-models key may."""
    if "*" in models:
        return True
    return bool(requested) and scope.matches(models, (requested, *known_as))


@dataclass(frozen=True)
class Usage:
    """What the store counted for a key when a request asks to pass."""
    in_flight: int = 0                  # its requests being served now (all workers)
    this_minute: int = 0                # its requests admitted in the current minute
    tokens_today: int = 0               # its tokens of answers ended today (UTC)


@dataclass(frozen=True)
class Spent:
    """What a key's requests used, for one model and UTC day (one request's, or a
    sum): a row of the usage table (proxy/keys/usage.py, store.add_usage)."""
    requests: int = 0
    prompt_tokens: int = 0              # all of the prompt, cached tokens included
    cached_tokens: int = 0              # of the prompt, served by the backend's cache
    completion_tokens: int = 0
    queue_wait_seconds: float = 0.0     # waited in the swapper (queue, load, swap)
    load_seconds: float = 0.0           # its share of the loads it waited for (swapper)

    def __add__(self, other: "Spent") -> "Spent":
        return Spent(*(a + b for a, b in zip(self.values(), other.values())))

    def values(self) -> tuple:
        return (self.requests, self.prompt_tokens, self.cached_tokens,
                self.completion_tokens, self.queue_wait_seconds, self.load_seconds)

    @property
    def tokens(self) -> int:
        """What the daily token limit counts: prompt + completion."""
        return self.prompt_tokens + self.completion_tokens


SPENT_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                "queue_wait_seconds", "load_seconds")


@dataclass(frozen=True)
class Refusal:
    limit: str                          # "max_concurrent" | "rpm" | "tokens_per_day"
    retry_after: int                    # whole seconds, at least 1
    message: str


def minute_of(now: float) -> int:
    return int(now // MINUTE)


def day_of(now: float) -> int:
    return int(now // DAY)


def _ceil_wait(seconds: float) -> int:
    return max(1, int(-(-seconds // 1)))


def decide(key: Key, usage: Usage, now: float) -> Refusal | None:
    """None when one more request of `key` may start now, else the limit it is over."""
    if key.tokens_per_day is not None and usage.tokens_today >= key.tokens_per_day:
        return Refusal("tokens_per_day", _ceil_wait((day_of(now) + 1) * DAY - now),
                       f"key '{key.name}' has used its {key.tokens_per_day} tokens of today "
                       "(UTC)")
    if key.max_concurrent is not None and usage.in_flight >= key.max_concurrent:
        return Refusal("max_concurrent", 1,
                       f"key '{key.name}' already has {usage.in_flight} request(s) in flight "
                       f"(its limit: {key.max_concurrent})")
    if key.rpm is not None and usage.this_minute >= key.rpm:
        return Refusal("rpm", _ceil_wait((minute_of(now) + 1) * MINUTE - now),
                       f"key '{key.name}' has made its {key.rpm} requests of this minute")
    return None


class FailedAuth:
    """Failed key checks per client address over the last minute: past `limit`
    of them an address is refused (429) without its key being checked, until
    its oldest failure is a minute old, except a token that passed the door in
    the last KNOWN_SECONDS (`known`): behind Docker's port publishing or a NAT
    every client has one address, and one misconfigured client must not lock
    the team's working agents out. Such a token is still checked as ever (a
    revoked key is refused); a guess never passed, so guesses stay slowed.
    Bounded: at most `max_addresses` addresses and as many tokens are
    remembered (the oldest forgotten first); tokens by their sha256 only. One
    per worker process."""

    KNOWN_SECONDS = 600.0

    def __init__(self, limit: int, clock, max_addresses: int = 4096, window: float = MINUTE):
        self.limit, self.clock, self.window = limit, clock, window
        self.max_addresses = max_addresses
        self._fails: dict[str, list[float]] = {}
        self._passed: dict[bytes, float] = {}       # token digest -> when it last passed

    @staticmethod
    def _digest(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "replace")).digest()

    def passed(self, token: str) -> None:
        """`token` passed the door now."""
        d = self._digest(token)
        self._passed.pop(d, None)
        if len(self._passed) >= self.max_addresses:
            self._passed.pop(next(iter(self._passed)))
        self._passed[d] = self.clock()

    def known(self, token: str) -> bool:
        """`token` passed the door within KNOWN_SECONDS."""
        if not token:
            return False
        when = self._passed.get(self._digest(token))
        return when is not None and when > self.clock() - self.KNOWN_SECONDS

    def _recent(self, addr: str, now: float) -> list[float]:
        times = self._fails.get(addr)
        if not times:
            return []
        while times and times[0] <= now - self.window:
            times.pop(0)
        if not times:
            self._fails.pop(addr, None)
        return times

    def blocked(self, addr: str) -> int | None:
        """Seconds until `addr` may try again, or None when it may now."""
        now = self.clock()
        times = self._recent(addr, now)
        if len(times) < self.limit:
            return None
        return _ceil_wait(times[0] + self.window - now)

    def failed(self, addr: str) -> None:
        now = self.clock()
        times = self._recent(addr, now)
        if not times:
            if len(self._fails) >= self.max_addresses:
                self._fails.pop(next(iter(self._fails)))
            self._fails[addr] = times
        times.append(now)
        if len(times) > self.limit:
            del times[:-self.limit]
