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

# The files that take a minute or more (real generation on the CPU, CPU vLLM, the
# fleet's LiteLLM, compose), longest first. pytest-xdist hands whole files
# (--dist loadfile) to the workers in collection order: these go first, so the
# small files fill in at the end and the workers finish together, instead of one
# running the verify gate or compose alone after the others are done.
HEAVY = (
    "tests/integration/swapper/test_kvcache.py",
    "tests/integration/swapper/test_dialects_stack.py",
    "tests/integration/test_fleet.py",
    "tests/integration/test_verify.py",
    "tests/integration/test_console.py",
    "tests/integration/swapper/test_vllm.py",
    "tests/integration/proxy/test_agents.py",
    "tests/integration/proxy/test_llama_passthrough.py",
    "tests/integration/swapper/test_conversations.py",
    "tests/e2e/test_compose.py",
    "tests/e2e/test_compose_download.py",
)


def heavy_first(items) -> None:
    """Reorder in place: HEAVY's files first, in its order; the rest as collected
    (a file's tests stay together and in order: the sort is stable)."""
    rank = {path: i for i, path in enumerate(HEAVY)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(HEAVY)))


def pytest_collection_modifyitems(items):
    heavy_first(items)
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
