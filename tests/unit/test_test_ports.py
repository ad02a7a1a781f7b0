"""Two test processes on one machine never share a port block (tests/support/servers.py):
a second test command beside CI (one process: "gw0") once got the same ports as CI's
gw0 worker, and the fleet's router port answered as the other run's scripted chat."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.process import REPO
from tests.support.servers import PORTS_PER_WORKER
# Takes a port, says its block's first port, and holds the block until stdin closes.
HOLDER = ("import sys; from tests.support import servers; p = servers.free_port(); "
          "assert p in servers.port_block(); print(servers.port_block().start, flush=True); "
          "sys.stdin.read()")


def holder(worker: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=REPO, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={**os.environ, "PYTEST_XDIST_WORKER": worker})
    return p, int(p.stdout.readline())


def release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(30) == 0


def test_a_block_is_held_by_one_process_and_freed_when_it_ends():
    a, block_a = holder("gw5")
    b, block_b = holder("gw5")          # the same worker name: another block
    try:
        assert block_a != block_b
        assert abs(block_a - block_b) >= PORTS_PER_WORKER
    finally:
        release(a)
    c, block_c = holder("gw5")          # a's block is free again: gw5's first choice
    try:
        assert block_c == block_a
    finally:
        release(b)
        release(c)
