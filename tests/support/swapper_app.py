"""The swapper's Flask app on the fake runtime and the test bed's fixture registry,
asked through Flask's test client, for the unit tests."""
import time

from swapper.app import create_app
from swapper.settings import Settings

from .fake_runtime import FakeRuntime
from .swapperproc import ENV, FIXTURE_BACKENDS


def settled(app, timeout=5.0) -> dict:
    """The scheduler's snapshot once nothing is in flight (or the last one)."""
    sched = app.extensions["swapper"].scheduler
    end = time.monotonic() + timeout
    while True:
        snap = sched.snapshot()
        if snap["in_flight"] == 0 and snap["queued"] == 0 or time.monotonic() > end:
            return snap
        time.sleep(0.01)


def make_app(urls: dict, runtime: FakeRuntime | None = None):
    runtime = runtime or FakeRuntime(urls)
    settings = Settings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV, WATCH_INTERVAL=0.05,
                        CRASH_BACKOFF=0.01)
    app = create_app(settings, runtime=runtime)
    return app, runtime


def ask(client, model="tiny-b", stream=False, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body.update(extra)
    return client.post("/v1/chat/completions", json=body, buffered=True)
