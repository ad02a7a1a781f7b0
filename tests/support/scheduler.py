"""The scheduler driven by hand: a clock moved by the test, and one pending action
performed the way the driver would."""
from swapper.scheduler import LoadFailed, Scheduler


def step(s: Scheduler, fail: str | None = None):
    """Perform the pending action the way the driver would; return it."""
    a = s.next_action(timeout=0)
    assert a is not None, "expected an action"
    if a.kind == "load":
        s.load_done(a.epoch, backend=f"backend-{a.model}",
                    error=LoadFailed(fail) if fail else None)
    else:
        s.stop_done()
    return a
