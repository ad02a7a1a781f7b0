"""The whole stack's added latency (proxy -> swapper -> backend) against the
resident backend directly, on a running stack (e.g. `docker compose up -d`):

    python -m tests.perf.stack_overhead [--model smollm2] [-n 40]
        [--proxy http://127.0.0.1:11433] [--direct http://127.0.0.1:18080]

Loads the model, then sends N rounds of 1-token non-streaming chat requests,
each round interleaving the two paths (same run, same load), one keep-alive
session per path, after a warm-up. Prints medians; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics

import requests

from tests.perf.proxy_overhead import BODY, one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--proxy", default="http://127.0.0.1:11433")
    ap.add_argument("--direct", default="http://127.0.0.1:18080")
    a = ap.parse_args()
    requests.post(f"{a.proxy}/load/{a.model}", timeout=900).raise_for_status()
    paths = {"direct": a.direct, "stack": a.proxy}
    sessions = {k: requests.Session() for k in paths}
    BODY["model"] = a.model
    times: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(a.n + 5):
        order = list(paths) if i % 2 else list(reversed(paths))
        for k in order:
            t = one(sessions[k], paths[k])
            if i >= 5:
                times[k].append(t)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    for k in paths:
        print(f"{k:7} median {med[k]:7.1f} ms  (n={len(times[k])})")
    print(f"added by the stack: {med['stack'] - med['direct']:+.1f} ms")


if __name__ == "__main__":
    main()
