"""Issue 35, keys: the pure parts (proxy/keys/policy.py) on a hand clock: scope
matching, each limit's decision and its Retry-After, failed-auth throttling."""
from __future__ import annotations

import pytest

from proxy.keys import policy
from proxy.keys.policy import DAY, FailedAuth, Key, Usage, decide, may_use
from tests.support.clock import Clock

T0 = 1_800_000_000.0            # wall-clock seconds (UTC)


@pytest.mark.parametrize("models, requested, known, ok", [
    (("*",), None, (), True),                          # all models: even none named
    (("*",), "anything", (), True),
    (("qwen-moe",), "qwen-moe", (), True),
    (("qwen-moe",), "qwen-35b", (), False),
    (("qwen-moe",), "qwen-35b", ("qwen-35b", "qwen36-35b", "qwen-moe"), True),   # an alias
    (("qwen-35b",), "qwen-moe", ("qwen-35b", "qwen-moe"), True),                 # the id
    (("qwen-*",), "qwen-big", ("qwen-122b", "qwen-big"), True),                  # a glob
    (("qwen-*",), "smollm2", ("smollm2", "smol", "cpu"), False),
    (("Qwen-*",), "qwen-big", (), False),             # case-sensitive, as the registry
    (("smollm2",), None, (), False),                  # naming none: only an all-models key
    (("smollm2",), "", (), False),
    (("claude-*", "smollm2"), "claude-opus-4-8[1m]", (), True),   # the name itself matches
    (("smollm2",), "claude-opus-4-8", (), False),     # (the door defers such names: swapper)
])
def test_scope(models, requested, known, ok):
    assert may_use(models, requested, known) is ok


def test_names_and_models_are_checked():
    assert policy.check_name("alice.bot_2-x") == "alice.bot_2-x"
    for bad in ("", "@api-key", "-x", "a b", "x" * 65, "a/b", "ä"):
        with pytest.raises(ValueError):
            policy.check_name(bad)
    assert policy.check_models([" a ", "", "b*"]) == ("a", "b*")
    with pytest.raises(ValueError):
        policy.check_models(["", " "])


def test_no_limits_never_refuse():
    assert decide(Key("k"), Usage(10**6, 10**6, 10**12), T0) is None
    assert not Key("k").limited and Key("k", rpm=1).limited


def test_concurrency():
    k = Key("k", max_concurrent=2)
    assert decide(k, Usage(in_flight=1), T0) is None
    r = decide(k, Usage(in_flight=2), T0)
    assert (r.limit, r.retry_after) == ("max_concurrent", 1)


def test_requests_per_minute_wait_for_the_next_minute():
    clock = Clock(T0 - T0 % 60 + 45.5)            # 45.5 s into a minute
    k = Key("k", rpm=3)
    assert decide(k, Usage(this_minute=2), clock()) is None
    r = decide(k, Usage(this_minute=3), clock())
    assert (r.limit, r.retry_after) == ("rpm", 15)          # 14.5 s, rounded up
    clock.sleep(14.5)                               # the next minute: counted anew
    assert policy.minute_of(clock()) == policy.minute_of(T0 - T0 % 60) + 1


def test_tokens_per_day_wait_for_the_next_utc_day():
    clock = Clock(T0 - T0 % DAY + DAY - 100.25)    # 100.25 s before midnight UTC
    k = Key("k", tokens_per_day=1000)
    assert decide(k, Usage(tokens_today=999), clock()) is None
    r = decide(k, Usage(tokens_today=1000), clock())
    assert (r.limit, r.retry_after) == ("tokens_per_day", 101)
    day = policy.day_of(clock())
    clock.sleep(100.25)
    assert policy.day_of(clock()) == day + 1


def test_the_tokens_limit_is_told_first():
    k = Key("k", max_concurrent=1, rpm=1, tokens_per_day=1)
    assert decide(k, Usage(1, 1, 1), T0).limit == "tokens_per_day"
    assert decide(k, Usage(1, 1, 0), T0).limit == "max_concurrent"
    assert decide(k, Usage(0, 1, 0), T0).limit == "rpm"


def test_failed_checks_slow_an_address_for_a_minute():
    clock = Clock()
    f = FailedAuth(3, clock)
    for _ in range(3):
        assert f.blocked("1.2.3.4") is None
        f.failed("1.2.3.4")
        clock.sleep(10)
    assert f.blocked("1.2.3.4") == 30               # the first failure is 30 s old
    assert f.blocked("5.6.7.8") is None             # another address is not
    clock.sleep(30)
    assert f.blocked("1.2.3.4") is None             # the first is a minute old


def test_failed_checks_remember_a_bounded_number_of_addresses():
    f = FailedAuth(1, Clock(), max_addresses=100)
    for i in range(1000):
        f.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(f._fails) == 100
    assert f.blocked("10.0.3.231") == 60            # the newest are kept


def test_a_token_that_passed_is_known_for_ten_minutes_and_a_bounded_number_are():
    clock = Clock()
    f = FailedAuth(1, clock, max_addresses=100)
    assert not f.known("cs-a") and not f.known("")
    f.passed("cs-a")
    clock.sleep(FailedAuth.KNOWN_SECONDS - 1)
    assert f.known("cs-a") and not f.known("cs-b")
    clock.sleep(2)
    assert not f.known("cs-a")                      # ten minutes since it last passed
    for i in range(1000):
        f.passed(f"cs-{i}")
    assert len(f._passed) == 100
    assert f.known("cs-999") and not f.known("cs-0")    # the newest are kept
