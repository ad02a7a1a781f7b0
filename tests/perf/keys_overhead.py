"""What keys add per request, side by side with keys off (issue 35): the real
proxy (`python -m proxy`, one gevent worker) in front of a scripted backend,
keys off and on (SQLite; a key with all three limits, or none with --no-limits),
rounds of 25 requests alternating, the median of each.

    .venv/bin/python -m tests.perf.keys_overhead [--no-limits] [--rounds 20]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import requests

from proxy.keys.sqlite import SqliteStore
from tests.support.chat import ScriptedChat
from tests.support.proxyproc import ProxyProcess

BODY = {"model": "smollm2", "input": "x"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-limits", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    db = tempfile.mkdtemp() + "/keys.db"
    limits = {} if args.no_limits else dict(max_concurrent=100, rpm=10**6,
                                            tokens_per_day=10**12)
    with ScriptedChat() as chat, \
            ProxyProcess(BACKEND_URL=chat.url, WEB_SEARCH=0, MODELS_TTL=0) as off, \
            ProxyProcess(BACKEND_URL=chat.url, WEB_SEARCH=0, MODELS_TTL=0, KEYS_DB=db) as on:
        _, token = SqliteStore(db).create("bench", **limits)
        sides = {"off": (requests.Session(), off.url, {}),
                 "on": (requests.Session(), on.url, {"Authorization": f"Bearer {token}"})}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for session, url, headers in sides.values():       # warm: connections, caches
            for _ in range(3):
                session.post(url + "/v1/embeddings", json=BODY, headers=headers)
        for _ in range(args.rounds):
            for name, (session, url, headers) in sides.items():
                for _ in range(25):
                    t = time.perf_counter()
                    r = session.post(url + "/v1/embeddings", json=BODY, headers=headers)
                    times[name].append(time.perf_counter() - t)
                    r.raise_for_status()
        med = {name: statistics.median(v) * 1000 for name, v in times.items()}
        print(f"keys off: {med['off']:.3f} ms, on: {med['on']:.3f} ms (median of "
              f"{len(times['on'])}); added {med['on'] - med['off']:.3f} ms")


if __name__ == "__main__":
    main()
