"""What the agent fixes (proxy/agents.py `fix`) cost an ordinary request: a chat
body of 41 messages, its late system prompt converted; rounds of 2,000 calls,
the median per call. A figure, never an assertion (it was a unit test's 50 µs
bound, which a loaded machine broke).

    .venv/bin/python -m tests.perf.fixcost [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

from proxy.agents import fix
from proxy.dialects import BY_NAME

BODY = {"model": "m", "messages": [{"role": "system", "content": "be brief"}] +
        [{"role": r, "content": "x" * 200} for r in ("user", "assistant") * 20]}
INFO = {"late_system": "convert", "preserve_reasoning": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    chat, n, per = BY_NAME["chat"], 2000, []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(n):
            fix(chat, BODY, INFO)
        per.append((time.perf_counter() - t) / n)
    print(f"agents.fix on 41 messages: median {statistics.median(per) * 1e6:.1f} µs "
          f"per request ({args.rounds} rounds of {n})")


if __name__ == "__main__":
    main()
