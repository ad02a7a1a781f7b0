"""Both services started as real processes (`python -m proxy`, `python -m swapper`)
with a bad setting: one line on stderr naming the variable, exit status 2, no
traceback, and nothing listening."""
import os
import subprocess
import sys

import pytest

from tests.support.process import REPO
from tests.support.servers import free_port

CASES = [
    ("proxy", {"PROXY_PORT": "abc"}, "PROXY_PORT must be an integer, got 'abc'"),
    ("proxy", {"WEB_SEARCH": "maybe"}, "WEB_SEARCH must be a boolean"),
    ("proxy", {"PROXY_WORKERS": "0"}, "PROXY_WORKERS must be at least 1"),
    ("swapper", {"SWAPPER_PORT": "abc"}, "SWAPPER_PORT must be an integer, got 'abc'"),
    ("swapper", {"PULL_IMAGES": "maybe"}, "PULL_IMAGES must be a boolean"),
    ("swapper", {"WATCH_INTERVAL": "often"}, "WATCH_INTERVAL must be a number"),
]


@pytest.mark.parametrize("service, bad, message", CASES,
                         ids=[f"{s}-{next(iter(b))}" for s, b, _ in CASES])
def test_bad_setting_stops_the_service_at_start(service, bad, message):
    port = str(free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PROXY_HOST": "127.0.0.1", "PROXY_PORT": port,
           "SWAPPER_HOST": "127.0.0.1", "SWAPPER_PORT": port, **bad}
    p = subprocess.run([sys.executable, "-m", service], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{service}: invalid configuration: {message}"), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
