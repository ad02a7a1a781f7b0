"""The swap policies (swapper/policy.py) on their own, without a Scheduler:
what `Hold` guarantees (holds, each session's gaps, the quantum, which model
next) and `Fifo`'s order, asked as the scheduler asks them, with hand-made
tickets and stints on a hand-moved clock."""
import itertools

import pytest

from swapper.policy import FIFO, HOLD, Fifo, Gaps, Hold, Stint, SwapPolicy
from swapper.tickets import Ticket
from tests.support.clock import Clock


SETTINGS = SwapPolicy(hold=10.0, first_hold=3.0, quantum_factor=3.0, quantum_min=5.0,
                      quantum_max=300.0, unknown_load=10.0)


class Bed:
    """One policy, its clock, the expected load seconds it is told and the
    events it emits; tickets numbered as the scheduler numbers them."""

    def __init__(self, settings=SETTINGS, loads=None, now=1000.0):
        self.clock = Clock(now)
        self.loads = dict(loads or {})
        self.events = []
        self.policy = settings.build(self.clock, self.loads.get,
                                     lambda event, **f: self.events.append((event, f)))
        self._seq = itertools.count(1)

    def ticket(self, model, session=None, epoch=None, urgent=False, ago=0.0):
        return Ticket(next(self._seq), model, session, urgent, epoch=epoch,
                      queued_at=self.clock.now - ago)

    def names(self):
        return [e for e, _ in self.events]


def ready(model="x", epoch=1, since=1000.0):
    """The scheduler's stint while `model` is ready (since `since`)."""
    return Stint(model, epoch, since, model)


def served(bed, session, model="x", epoch=1, ok=True, cause=None, queue=()):
    """A request of `session` comes, is admitted in the stint and ends."""
    stint = ready(model, epoch)
    bed.policy.came(session, model, stint)
    t = bed.ticket(model, session, epoch=epoch)
    bed.policy.released(t, ok, cause, stint, list(queue))
    return t


# ------------------------------------------------------------------ build
def test_the_settings_build_the_policy_they_name():
    assert isinstance(SwapPolicy().build(), Hold) and SwapPolicy().build().name == HOLD
    fifo = SwapPolicy(name=FIFO).build()
    assert isinstance(fifo, Fifo) and fifo.name == FIFO


# ------------------------------------------------------------------- fifo
def test_fifo_serves_the_oldest_waiting_requests_model_and_never_holds():
    bed = Bed(SwapPolicy(name=FIFO))
    p, stint = bed.policy, ready("x")
    queue = [bed.ticket("y", "B", ago=5), bed.ticket("z", "C", ago=50), bed.ticket("x", "A")]
    assert p.next_model(queue, stint) == "y"        # the first in line, not the oldest age
    served(bed, "A")                                # a well-ended turn: no hold
    assert p.held(queue, stint) is None
    assert p.in_turn("A", stint, queue, []) is False
    assert p.in_turn("A", stint, queue, [bed.ticket("x", "A", epoch=1)]) is False
    assert p.stop_cause(stint) == "swap" and p.status(queue, stint) is None
    assert bed.events == []


def test_fifo_puts_an_unload_and_an_operators_load_in_line_like_the_rest():
    bed = Bed(SwapPolicy(name=FIFO))
    queue = [bed.ticket("y"), bed.ticket(None), bed.ticket("z", urgent=True)]
    assert bed.policy.next_model(queue, ready("x")) == "y"


# ------------------------------------------------------------------- holds
def test_a_well_ended_turn_holds_its_session_first_hold_seconds_then_expires():
    bed = Bed()
    p, stint = bed.policy, ready("x")
    served(bed, "A")
    assert p.holds == {"A": 1003.0}                 # first_hold: it may never come back
    queue = [bed.ticket("y", "B")]
    assert p.held(queue, stint) == 1003.0           # the scheduler wakes then
    assert bed.names() == ["holding"]
    assert p.status(queue, stint) == {"sessions": 1, "until_seconds": 3.0,
                                      "quantum_ends_in": 30.0, "waiting_model": "y"}
    assert p.in_turn("A", stint, queue, []) is True     # its next request goes first
    assert p.in_turn("B", stint, queue, []) is False    # no hold of its own
    assert p.in_turn(None, stint, queue, []) is False   # no session: never jumps
    bed.clock.now = 1003.0
    assert p.in_turn("A", stint, queue, []) is False
    assert p.held(queue, stint) is None and p.holds == {}
    assert bed.names() == ["holding", "hold_expired"]
    assert p.stop_cause(stint) == "swap"                # nothing held: a plain swap


def test_nothing_is_held_when_no_other_model_waits():
    bed = Bed()
    p, stint = bed.policy, ready("x")
    served(bed, "A")
    assert p.held([], stint) is None
    assert p.held([bed.ticket("x", "C", epoch=2)], stint) is None
    assert "holding" not in bed.names()


def test_a_request_in_flight_in_the_epoch_keeps_its_session_in_turn():
    bed = Bed()
    p, stint = bed.policy, ready("x")
    queue = [bed.ticket("y", "B")]
    active = [bed.ticket("x", "A", epoch=1)]
    assert p.in_turn("A", stint, queue, active) is True     # its fan-out's next member
    assert p.in_turn("A", stint, queue, [bed.ticket("x", "A", epoch=0)]) is False
    assert p.in_turn("C", stint, queue, active) is False


def test_only_a_request_of_the_ready_stint_that_ended_well_holds():
    bed = Bed()
    p = bed.policy
    p.released(bed.ticket("x", "A", epoch=0), True, None, ready("x", epoch=1), [])
    assert p.holds == {}                             # of an earlier epoch
    p.released(bed.ticket("x", "A", epoch=1), True, None, Stint("x", 1, None, "x"), [])
    assert p.holds == {}                             # the model is not ready (stopping)
    p.released(bed.ticket("y", "A", epoch=1), True, None, ready("x", epoch=1), [])
    assert p.holds == {}                             # of another model
    p.released(bed.ticket("x", "A", epoch=1), True, None, ready("x", epoch=1), [])
    assert p.holds == {"A": 1003.0}


def test_a_session_already_waiting_for_another_model_gets_no_hold():
    bed = Bed()
    queue = [bed.ticket("y", "A")]                   # its turn moved on already
    served(bed, "A", queue=queue)
    assert bed.policy.holds == {}
    served(bed, "A", queue=[bed.ticket("y", "B"), bed.ticket("x", "A")])
    assert bed.policy.holds == {"A": 1001.0}         # waiting for the same model: held
    # (it came back at once: a gap of 0 s, a hold of 2 x 0 + 1 s)


def test_holds_are_bounded_by_max_holds_but_a_held_session_is_renewed():
    bed = Bed(SwapPolicy(max_holds=2))
    p = bed.policy
    for s in "ABC":
        served(bed, s)
    assert sorted(p.holds) == ["A", "B"]
    bed.clock.now += 1.0
    served(bed, "A")                                 # came back after 1 s: 2 x 1 + 1
    assert p.holds["A"] == bed.clock.now + 3.0 and "C" not in p.holds


# ------------------------------------------------------- what ends a hold
@pytest.mark.parametrize("how, reason", [
    ("other_model", "other_model"), ("gone", "client_gone"),
    ("failed", "failed"), ("hung_up", "client_gone")])
def test_a_hold_ends_when_its_session_moves_on_hangs_up_or_fails(how, reason):
    bed = Bed()
    p, stint = bed.policy, ready("x")
    served(bed, "A")
    served(bed, "B")
    if how == "other_model":
        p.came("A", "y", stint)
    elif how == "gone":
        p.gone("A", stint)
    elif how == "failed":
        p.released(bed.ticket("x", "A", epoch=1), False, "backend_error", stint, [])
    else:
        p.released(bed.ticket("x", "A", epoch=1), False, "client_gone", stint, [])
    assert list(p.holds) == ["B"]
    assert bed.events[-1] == ("hold_broken", {"model": "x", "session": "A", "reason": reason})


def test_a_session_coming_back_to_the_resident_model_keeps_its_hold():
    bed = Bed()
    served(bed, "A")
    bed.policy.came("A", "x", ready("x"))
    assert "A" in bed.policy.holds and "hold_broken" not in bed.names()


def test_an_operators_load_or_unload_waiting_ends_the_holds_effect():
    for op in (dict(model="y", urgent=True), dict(model=None)):
        bed = Bed()
        p, stint = bed.policy, ready("x")
        served(bed, "A")
        queue = [bed.ticket("y", "B"), bed.ticket(op["model"], urgent=op.get("urgent", False))]
        assert p.held(queue, stint) is None
        assert p.in_turn("A", stint, queue, []) is False
        assert p.next_model(queue, stint) == op["model"]    # the operator's goes first


def test_a_new_stint_clears_the_holds():
    bed = Bed()
    p, stint = bed.policy, ready("x")
    served(bed, "A")
    queue = [bed.ticket("y", "B")]
    assert p.held(queue, stint) is not None
    p.new_stint()
    assert p.holds == {} and p.status(queue, stint) is None
    assert p.held(queue, stint) is None


# ------------------------------------------------------------- sessions' gaps
def test_a_hold_is_twice_the_sessions_longest_recent_gap_plus_a_second_at_most_hold():
    bed = Bed()
    p = bed.policy
    served(bed, "A")
    assert p.holds["A"] - bed.clock.now == 3.0       # first_hold before it came back
    for gap, hold in [(1.0, 3.0), (2.5, 6.0), (0.5, 6.0), (0.5, 6.0), (0.5, 2.0),
                      (20.0, 10.0)]:
        bed.clock.now += gap
        served(bed, "A")
        assert p.holds["A"] - bed.clock.now == pytest.approx(hold), gap
    # the last KEEP (3) gaps count: 2.5 is forgotten after three shorter ones;
    # a gap is counted up to `hold` (20 s counts 10 s: 2 x 10 + 1 capped at 10)


def test_first_hold_is_capped_by_hold():
    bed = Bed(SwapPolicy(hold=2.0, first_hold=3.0))
    served(bed, "A")
    assert bed.policy.holds["A"] - bed.clock.now == 2.0


def test_gaps_are_kept_per_session_for_the_last_sessions_seen():
    g = Gaps()
    assert g.longest("A") is None
    g.came_back("A", 5.0, 10.0)                      # never released: no gap
    assert g.longest("A") is None
    g.released("A", 10.0)
    g.came_back("A", 12.0, 10.0)
    g.released("B", 10.0)
    g.came_back("B", 40.0, 10.0)                     # capped at 10
    assert (g.longest("A"), g.longest("B")) == (2.0, 10.0)
    for i in range(Gaps.MAX):
        g.released(f"s{i}", 0.0)
        g.came_back(f"s{i}", 1.0, 10.0)
    assert g.longest("A") is None and g.longest(f"s{Gaps.MAX - 1}") == 1.0


# ------------------------------------------------------------------ quantum
def test_the_quantum_is_priced_by_the_waiting_models_load_and_clamped():
    for loads, quantum in [({"y": 4.0}, 12.0), ({"y": 1.0}, 5.0), ({"y": 500.0}, 300.0),
                           ({}, 30.0)]:                       # never loaded: unknown_load
        bed = Bed(SwapPolicy(hold=1000.0, first_hold=1000.0, quantum_factor=3.0,
                             quantum_min=5.0, quantum_max=300.0), loads=loads)
        p, stint = bed.policy, ready("x", since=1000.0)
        served(bed, "A")
        queue = [bed.ticket("y", "B")]
        assert p.held(queue, stint) == 1000.0 + quantum, loads
        bed.clock.now = 1000.0 + quantum - 0.1
        assert p.in_turn("A", stint, queue, []) is True
        bed.clock.now = 1000.0 + quantum
        assert p.in_turn("A", stint, queue, []) is False
        assert p.held(queue, stint) is None
        assert p.stop_cause(stint) == "quantum"       # its session was still coming
        assert bed.events[-1] == ("quantum_spent", {"model": "x", "sessions": 1})


def test_the_quantum_counts_from_the_oldest_wait_but_not_before_ready():
    bed = Bed(SwapPolicy(hold=1000.0, first_hold=1000.0), loads={"y": 4.0})   # 12 s
    p = bed.policy
    served(bed, "A")
    old = bed.ticket("y", "B", ago=100.0)            # waited through the load of x
    assert p.held([old], ready("x", since=1000.0)) == 1012.0
    bed.clock.now = 1005.0
    later = bed.ticket("y", "C")                     # came during the stint
    assert p.held([later], ready("x", since=1000.0)) == 1017.0
    assert p.held([old, later], ready("x", since=1000.0)) == 1012.0


def test_the_hold_ends_at_its_window_or_the_quantum_whichever_first():
    bed = Bed(loads={"y": 1.0})                      # quantum 5 s: until 1005
    p, stint = bed.policy, ready("x")
    queue = [bed.ticket("y", "B")]
    served(bed, "A")                                 # first hold: until 1003
    assert p.held(queue, stint) == 1003.0
    bed.clock.now = 1002.0
    served(bed, "A")                                 # a gap of 2 s: 5 s, until 1007 ...
    assert p.holds["A"] == 1007.0
    assert p.held(queue, stint) == 1005.0            # ... ends with the quantum


def test_thousands_of_sessions_gain_nothing_beyond_the_quantum():
    bed = Bed(SwapPolicy(hold=1000.0, first_hold=1000.0), loads={"y": 2.0})  # quantum 6 s
    p, stint = bed.policy, ready("x")
    queue = [bed.ticket("y", "B")]
    for i in range(2000):
        served(bed, f"s{i}")
        bed.clock.now += 0.001
    assert len(p.holds) == SETTINGS.max_holds
    assert p.held(queue, stint) == 1006.0
    bed.clock.now = 1006.0
    assert p.held(queue, stint) is None
    assert not any(p.in_turn(f"s{i}", stint, queue, []) for i in range(2000))


# ----------------------------------------------------------- which model next
def test_the_next_model_is_the_one_that_waited_most_per_second_of_load():
    bed = Bed(loads={"y": 2.0, "z": 20.0})
    stint = ready("x")
    queue = [bed.ticket("z", ago=30), bed.ticket("z", ago=30), bed.ticket("y", ago=5)]
    # z: (31 + 31) / 20 = 3.1; y: 6 / 2 = 3.0
    assert bed.policy.next_model(queue, stint) == "z"
    queue.append(bed.ticket("y", ago=1))             # y: (6 + 2) / 2 = 4.0
    assert bed.policy.next_model(queue, stint) == "y"


def test_the_resident_model_goes_next_only_when_no_other_waits():
    bed = Bed()
    stint = ready("x")
    queue = [bed.ticket("x", ago=60), bed.ticket("x", ago=60), bed.ticket("y")]
    assert bed.policy.next_model(queue, stint) == "y"
    assert bed.policy.next_model(queue[:2], stint) == "x"
    # idle after a stop: the model stopped last is the one that yields
    assert bed.policy.next_model(queue, Stint(None, 2, None, "x")) == "y"


def test_a_request_that_waited_quantum_max_goes_first_whatever_its_cost():
    bed = Bed(loads={"y": 1.0, "z": 10000.0})
    stint = ready("x")
    queue = [bed.ticket("z", ago=300.0), bed.ticket("y"), bed.ticket("y"), bed.ticket("y")]
    assert bed.policy.next_model(queue, stint) == "z"
    queue[0].queued_at += 0.5
    assert bed.policy.next_model(queue, stint) == "y"


def test_ties_go_to_the_model_that_waited_first():
    bed = Bed()
    queue = [bed.ticket("z"), bed.ticket("y")]
    assert bed.policy.next_model(queue, ready("x")) == "z"
