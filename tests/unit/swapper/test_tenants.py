"""Tenants (issue 35, swapper side: swapper/tenants.py, swapper/policy.py): the
proxy's fields read strictly, fair order within a model (weighted), each load's
seconds charged to the tenants that caused it, a tenant over its share deferred
to the next stint without starving, and one tenant deciding exactly as before.
The scheduler and the policy on a hand-moved clock; the header's path through
the app on the fake runtime with a backend that records what it gets."""
import random

import pytest

from swapper.policy import Hold, Stint, SwapPolicy
from swapper.scheduler import LOADING, READY, Scheduler
from swapper.tenants import (DEFAULT_TENANT, OTHER, Shares, TenantLabels, parse,
                             tenant_of)
from swapper.tickets import Ticket
from tests.support.clock import Clock
from tests.support.scheduler import step
from tests.support.servers import Scripted
from tests.support.swapper_app import make_app, settled


def make(slots=None, clock=None, policy=None):
    slots = slots or {}
    return Scheduler(lambda m: slots.get(m, 1), max_queue=256, backoff_base=1.0,
                     backoff_max=8.0, clock=clock or Clock(), policy=policy)


def admit_order(s, tickets):
    """Release the admitted ticket one at a time (slots 1); the tenants in the
    order they were admitted."""
    out = []
    while True:
        active = [t for t in tickets if t.state == "admitted"]
        if not active:
            return out
        (t,) = active
        out.append(t.tenant)
        s.release(t)


# ------------------------------------------------------------------ fields
@pytest.mark.parametrize("name, weight, want", [
    (None, None, (DEFAULT_TENANT, 1.0)),
    ("alice", None, ("alice", 1.0)),
    ("alice", "2.5", ("alice", 2.5)),
    ("team ci", "0.5", ("team ci", 0.5)),
    ("", "2", (DEFAULT_TENANT, 1.0)),
    ("x" * 65, "1", (DEFAULT_TENANT, 1.0)),          # too long
    ("x" * 64, "1", ("x" * 64, 1.0)),
    ("al\x00ice", "1", (DEFAULT_TENANT, 1.0)),        # not printable
    ("al\u00e9", "1", (DEFAULT_TENANT, 1.0)),         # not ASCII
    (" alice", "1", (DEFAULT_TENANT, 1.0)),           # padded
    ("alice", "nan", (DEFAULT_TENANT, 1.0)),
    ("alice", "inf", (DEFAULT_TENANT, 1.0)),
    ("alice", "0", (DEFAULT_TENANT, 1.0)),
    ("alice", "-1", (DEFAULT_TENANT, 1.0)),
    ("alice", "1e9", (DEFAULT_TENANT, 1.0)),
    ("alice", "two", (DEFAULT_TENANT, 1.0)),
    ("alice", "1" * 40, (DEFAULT_TENANT, 1.0)),
])
def test_the_proxys_fields_are_read_strictly(name, weight, want):
    assert parse(name, weight) == want
    environ = {}
    if name is not None:
        environ["HTTP_X_CODING_STACK_TENANT"] = name
    if weight is not None:
        environ["HTTP_X_CODING_STACK_WEIGHT"] = weight
    assert tenant_of(environ) == want


def test_the_metrics_label_is_bounded():
    label = TenantLabels(3)
    assert [label(t) for t in "abcdeab"] == ["a", "b", "c", OTHER, OTHER, "a", "b"]


# ------------------------------------------------------- within a model
def test_a_batch_does_not_starve_another_tenants_agent():
    s = make()
    batch = [s.submit("x", tenant="ci") for _ in range(20)]
    step(s)                                     # x loads; the batch's first is admitted
    s.release(batch[0])
    s.release(batch[1])                         # two of the batch done
    agent = s.submit("x", session="a", tenant="alice")
    assert agent.state == "waiting"
    s.release(batch[2])
    assert agent.state == "admitted"            # next, not after the 17 others
    assert sum(t.state == "waiting" for t in batch) == 17


def test_fair_order_follows_the_weights():
    s = make()
    s.submit("x", tenant="warm")
    step(s)
    (first,) = [t for t in s._active]
    tickets = [s.submit("x", tenant="a", weight=3.0) for _ in range(9)] + \
              [s.submit("x", tenant="b", weight=1.0) for _ in range(3)]
    s.release(first)
    order = admit_order(s, tickets)
    assert order[:4].count("a") == 3 and order[:8].count("a") == 6
    assert sorted(order) == sorted(t.tenant for t in tickets)


def test_within_one_tenant_first_come_first_served():
    s = make()
    ts = [s.submit("x", tenant=random.choice("ab"), weight=random.choice([0.5, 1, 4]))
          for _ in range(30)]
    step(s)
    admitted = []
    while any(t.state == "admitted" for t in ts):
        (t,) = [t for t in ts if t.state == "admitted"]
        admitted.append(t)
        s.release(t)
    for tenant in "ab":
        mine = [t.seq for t in admitted if t.tenant == tenant]
        assert mine == sorted(mine)


def test_idle_time_is_no_credit():
    s = make()
    s.submit("x", tenant="b")
    step(s)
    ts = [s.submit("x", tenant="b") for _ in range(10)]
    for t in [t for t in s._active]:
        s.release(t)
    for t in ts[:8]:                            # b alone for a while
        s.release(t)
    late = [s.submit("x", tenant="a") for _ in range(4)]
    order = admit_order(s, ts[8:] + late)
    # a, back after b's long run, alternates with b; it does not take 8 in a row
    assert order[:4].count("a") <= 2 and order.count("a") == 4


# ------------------------------------------------------------ charging
def test_a_loads_seconds_are_charged_to_the_tenants_that_waited_for_it():
    clock = Clock()
    s = make(clock=clock)
    events = []
    s.listeners.subscribe(lambda e, f: events.append((e, f)) if e == "charged" else None)
    s.submit("x", tenant="a")
    s.submit("x", tenant="a")
    s.submit("x", tenant="b")
    assert s.phase == LOADING
    s.submit("y", tenant="c")                   # waits for another model: not charged
    clock.now += 12.0
    step(s)
    assert sorted((f["tenant"], f["seconds"]) for _, f in events) == [("a", 6.0), ("b", 6.0)]
    snap = s.snapshot()["tenants"]
    assert snap["a"]["charged_load_seconds"] == 6.0 and snap["a"]["in_flight"] == 1
    assert snap["a"]["queued"] + snap["b"]["queued"] == 2
    assert snap["c"]["charged_load_seconds"] == 0.0 and snap["c"]["queued"] == 1


def test_a_shared_load_is_split_by_weight_and_puts_nobody_over():
    sh = Shares(Clock())
    for name, w in (("a", 1.0), ("b", 3.0)):
        sh.tag(Ticket(1, "x", tenant=name, weight=w))
    assert sh.charge(20.0, ["a", "b"]) == {"a": 5.0, "b": 15.0}
    assert sh.overs(["a", "b"]) == set()
    sh.charge(20.0, ["a"])                      # a load only a wanted: all its own
    assert sh.charged("a") == 25.0 and sh.overs(["a", "b"]) == {"a"}


def test_each_request_is_told_its_share_of_the_load_it_waited_for():
    """The policy alone: a tenant's part of a load (split by weight, as charged)
    split evenly among its requests that waited; the parts told add up to the
    charges, except a tenant whose requests all went away (told to nobody)."""
    clock = Clock()
    p = SETTINGS.build(clock, {"x": 10.0}.get)
    a1, a2 = Ticket(1, "x", tenant="a"), Ticket(2, "x", tenant="a")
    b = Ticket(3, "x", tenant="b", weight=3.0)
    for t in (a1, a2, b, Ticket(4, "x", tenant="gone")):
        p.tag(t)
    p.loaded("x", 20.0, ["a", "b", "gone"], [a1, a2, b])   # weights 1 + 3 + 1
    assert (a1.load_seconds, a2.load_seconds, b.load_seconds) == (2.0, 2.0, 12.0)
    clock.now += 5.0
    p.loaded("x", 3.0, ["a"], [a1])            # a1 waited for a second load (a reload)
    assert a1.load_seconds == 5.0
    status = p.tenants([], [])
    assert status["a"]["charged_load_seconds_total"] == a1.load_seconds + a2.load_seconds
    assert status["b"]["charged_load_seconds_total"] == b.load_seconds
    assert status["gone"]["charged_load_seconds_total"] == 4.0


def test_the_scheduler_tells_the_tickets_of_a_load_their_shares():
    clock = Clock()
    s = make(clock=clock)
    first = [s.submit("x", tenant="a"), s.submit("x", tenant="b", weight=3.0)]
    assert s.phase == LOADING
    clock.now += 4.0
    late = s.submit("x", tenant="b", weight=3.0)        # joins the load while it runs
    other = s.submit("y", tenant="c")                   # waits for another model
    clock.now += 4.0
    step(s)
    a, b = first
    assert (a.load_seconds, b.load_seconds, late.load_seconds) == (2.0, 3.0, 3.0)
    assert other.load_seconds == 0.0
    tenants = s.snapshot()["tenants"]
    assert tenants["a"]["charged_load_seconds_total"] == a.load_seconds
    assert tenants["b"]["charged_load_seconds_total"] == b.load_seconds + late.load_seconds


def test_running_lists_the_most_charged_tenants_and_sums_the_rest():
    sh = Shares(Clock())
    queue = [Ticket(i, "x", tenant=f"t{i}") for i in range(40)]
    for t in queue:
        sh.tag(t)
    for i in range(40):
        sh.charge(float(i + 1), [f"t{i}"])
    status = sh.status(queue, [])
    assert len(status) == 33 and "t39" in status and "t0" not in status
    assert status["other"]["tenants"] == 8 and status["other"]["queued"] == 8
    assert status["other"]["charged_load_seconds_total"] == sum(range(1, 9))


def test_the_account_decays_by_half_each_half_life():
    clock = Clock()
    sh = Shares(clock, half_life=100.0)
    sh.charge(40.0, ["a"])
    clock.now += 100.0
    assert sh.charged("a") == pytest.approx(20.0)
    clock.now += 200.0
    assert sh.charged("a") == pytest.approx(5.0)


def test_over_its_share_by_weight():
    clock = Clock()
    sh = Shares(clock, slack=0.1)
    for name, w in (("a", 1.0), ("b", 3.0)):
        sh.tag(Ticket(1, "x", tenant=name, weight=w))
    sh.charge(30.0, ["a"])
    sh.charge(70.0, ["b"])                      # a: 30 % of the loads, its share 25 %
    assert sh.overs(["a", "b"]) == {"a"}
    sh.charge(10.0, ["b"])                      # a: 27 %, within the slack
    assert sh.overs(["a", "b"]) == set()
    lone = Shares(clock)
    lone.charge(1000.0, ["solo"])
    assert lone.overs(["solo"]) == set()        # one tenant is never over its share


# ------------------------------------------------------------ between models
SETTINGS = SwapPolicy(hold=10.0, first_hold=3.0, quantum_factor=3.0, quantum_min=5.0,
                      quantum_max=300.0, unknown_load=10.0)


def heavy_bed():
    """A hold policy where tenant "heavy" caused 90 s of loads and "light" 10 s."""
    clock = Clock(1000.0)
    p = SETTINGS.build(clock, {"x": 10.0, "y": 10.0}.get)
    for name in ("heavy", "light"):
        p.tag(Ticket(0, "x", tenant=name))
    p.loaded("y", 90.0, ["heavy"])
    p.loaded("x", 10.0, ["light"])
    return clock, p


def test_a_tenant_over_its_share_does_not_end_the_stint():
    clock, p = heavy_bed()
    stint = Stint("x", 1, 1000.0, "x")
    served = Ticket(1, "x", "A", epoch=1, tenant="light")
    p.came("A", "x", stint)
    p.released(served, True, None, stint, [])           # A holds x (3 s)
    wait = [Ticket(2, "y", "B", queued_at=1000.0, tenant="heavy")]
    clock.now = 1002.0
    assert p.held(wait, stint) is not None
    assert p._quantum_end(wait, stint) == 1000.0 + 300.0     # quantum_max, not 3 x 10 s
    # the same wait by the light tenant ends the stint after 3 x 10 s
    light = [Ticket(3, "y", "C", queued_at=1000.0, tenant="light")]
    assert p._quantum_end(light, stint) == 1000.0 + 30.0


def test_the_next_stint_goes_to_a_tenant_within_its_share():
    clock, p = heavy_bed()
    stint = Stint("z", 3, 1000.0, "z")
    queue = [Ticket(1, "y", queued_at=900.0, tenant="heavy"),    # older, more waiting
             Ticket(2, "y", queued_at=900.0, tenant="heavy"),
             Ticket(3, "x", queued_at=990.0, tenant="light")]
    assert p.next_model(queue, stint) == "x"
    # nobody else waits: the heavy tenant's model goes (the GPU never idles)
    assert p.next_model(queue[:2], stint) == "y"


def test_a_deferred_tenant_is_not_starved():
    clock, p = heavy_bed()
    stint = Stint("z", 3, 1000.0, "z")
    queue = [Ticket(1, "y", queued_at=1000.0, tenant="heavy"),
             Ticket(2, "x", queued_at=1001.0, tenant="light")]
    clock.now = 1000.0 + 299.0
    assert p.next_model(queue, stint) == "x"
    clock.now = 1000.0 + 300.0                  # waited quantum_max: first, whatever
    assert p.next_model(queue, stint) == "y"


def test_a_heavy_tenant_waits_for_the_next_stint_through_the_scheduler():
    clock = Clock()
    s = make(clock=clock, slots={"x": 4, "y": 4})
    s.policy.loaded("y", 200.0, ["heavy"])       # heavy caused 200 s of loads lately
    s.policy.loaded("x", 20.0, ["light"])
    a = s.submit("x", session="A", tenant="light")
    clock.now += 10.0
    step(s)                                     # x loads
    y = s.submit("y", session="H", tenant="heavy")
    s.release(a)                                # A's turn ends well: it holds x
    for _ in range(20):                         # A comes back every 2 s for 40 s
        clock.now += 2.0
        s.tick()
        t = s.submit("x", session="A", tenant="light")
        assert t.state == "admitted" and s.model == "x", s.snapshot()
        s.release(t)
    assert y.state == "waiting"
    clock.now += 10.0                           # A gone: its hold ends, y loads
    s.tick()
    step(s)
    step(s)
    assert (s.phase, s.model) == (READY, "y") and y.state == "admitted"


# ------------------------------------------------------------ one tenant
class Untenanted(Hold):
    """The hold policy as it was before tenants: no fair order, no account."""

    def tag(self, ticket):
        pass

    def order(self, tickets):
        return list(tickets)

    def loaded(self, model, seconds, tenants, tickets=()):
        pass

    def _over(self, queue):
        return set()


def trace(s: Scheduler, clock: Clock, seed: int, tenant: str, weight: float) -> list:
    """A random run of requests, releases, holds and loads; what was decided."""
    rnd = random.Random(seed)
    out, tickets = [], []
    for _ in range(300):
        r = rnd.random()
        if r < 0.35:
            tickets.append(s.submit(rnd.choice("xyz"), session=rnd.choice("ABC"),
                                    tenant=tenant, weight=weight))
        elif r < 0.6:
            active = sorted((t for t in tickets if t.state == "admitted"), key=lambda t: t.seq)
            if active:
                s.release(rnd.choice(active), ok=rnd.random() < 0.9)
        elif r < 0.8:
            a = s.next_action(timeout=0)
            if a is not None:
                clock.now += rnd.uniform(1, 20)
                (s.load_done(a.epoch, backend=a.model) if a.kind == "load" else s.stop_done())
                out.append((a.kind, a.model, a.cause))
        else:
            clock.now += rnd.uniform(0, 6)
            s.tick()
        out.append(tuple(t.state for t in tickets))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_one_tenant_decides_exactly_as_without_tenants(seed):
    c1, c2, c3 = Clock(), Clock(), Clock()
    before = make(clock=c1, slots={"x": 2, "y": 1, "z": 3})
    before.policy = Untenanted(SwapPolicy(), c1, lambda m: before.load_times.expected(m))
    default = make(clock=c2, slots={"x": 2, "y": 1, "z": 3})
    named = make(clock=c3, slots={"x": 2, "y": 1, "z": 3})
    want = trace(before, c1, seed, DEFAULT_TENANT, 1.0)
    assert trace(default, c2, seed, DEFAULT_TENANT, 1.0) == want
    assert trace(named, c3, seed, "alice", 2.5) == want


# ------------------------------------------------------------ through the app
def test_the_fields_reach_the_scheduler_not_the_backend():
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    backend = Scripted(*[ok] * 3)
    try:
        app, _ = make_app({"tiny-a": backend.url})
        c = app.test_client()
        seen = []
        sched = app.extensions["swapper"].scheduler
        submit = sched.submit_many
        sched.submit_many = lambda *a, **k: seen.append(a[3:]) or submit(*a, **k)
        r = c.post("/v1/chat/completions", buffered=True, headers={
            "X-Coding-Stack-Tenant": "alice", "X-Coding-Stack-Weight": "2"},
            json={"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.data
        assert seen[-1] == (False, "alice", 2.0)
        head = backend.heads[-1].lower()
        assert b"x-coding-stack-tenant" not in head and b"x-coding-stack-weight" not in head
        assert settled(app)["in_flight"] == 0
        running = c.get("/running").get_json()
        assert running["tenants"]["alice"]["weight"] == 2.0
        metrics = c.get("/metrics").get_data(as_text=True)
        assert 'swapper_tenant_queued{tenant="alice"} 0.0' in metrics
    finally:
        backend.close()
