"""Markers by area, from where a test lives, so any area runs alone and its time
shows in --durations:

    tests/run.sh -m swapper            the swapper's tests, every level
    tests/run.sh -m "unit and proxy"   the proxy's unit tests
    tests/run.sh -m "not e2e"          all but compose

Levels: unit, integration, reliability, e2e (the folder). Areas: proxy, swapper,
fleet, console, agents (a folder or file name that says so), policy (the swap
policy's tests). Registered in pytest.ini (--strict-markers)."""
from __future__ import annotations

import pytest

# The helpers' and shared fixtures' asserts explain themselves as a test's do.
pytest.register_assert_rewrite("tests.support")

from tests.support.process import ServiceProcess  # noqa: E402  (after the rewrite hook)

LEVELS = ("unit", "integration", "reliability", "e2e")
AREAS = {
    "proxy": ("proxy",),
    "swapper": ("swapper",),
    "fleet": ("fleet",),
    "console": ("console",),
    "agents": ("agents",),
    "policy": ("swap_policy", "test_policy", "test_holds", "test_scheduler"),
}


def pytest_collection_modifyitems(items):
    for item in items:
        parts = item.nodeid.split("::")[0].split("/")
        for level in LEVELS:
            if level in parts[:2]:
                item.add_marker(getattr(pytest.mark, level))
        path = "/".join(parts)
        for area, words in AREAS.items():
            if any(w in path for w in words):
                item.add_marker(getattr(pytest.mark, area))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the last lines of every service process
    (proxy, swapper, llama-server) still running: what CI prints is enough to
    tell a race from a bug."""
    report = yield
    if report.failed:
        for proc in list(ServiceProcess.running):
            try:
                tail = proc.logs()[-3000:]
            except OSError as e:
                tail = f"(log unreadable: {e})"
            report.sections.append((f"{proc.name} log (end) {proc.url}", tail))
    return report
