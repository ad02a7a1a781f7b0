"""Measure the proxy's added latency vs talking to llama-server directly.

    source tests/testbed/testbed.env
    .venv/bin/python -m tests.perf.proxy_overhead [-n 30]

Starts a real llama-server (SmolLM2-135M) and `python -m proxy` (gunicorn + gevent) twice:
pure pass-through (WEB_SEARCH=0, INJECT_SYSTEM=0) and default settings (web_search tool
injected, so the backend also sees a longer prompt). Sends N rounds of 1-token
non-streaming chat requests, interleaving the paths within every round (same run, same
load), one keep-alive session per path, after a warm-up. Prints medians; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import requests

from tests.support.llama import LlamaServer
from tests.support.proxyproc import ProxyProcess

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
        "temperature": 0}


def one(session: requests.Session, url: str) -> float:
    t0 = time.perf_counter()
    r = session.post(url + "/v1/chat/completions", json=BODY)
    r.raise_for_status()
    r.json()
    return time.perf_counter() - t0


def ttfb(session: requests.Session, url: str) -> float:
    t0 = time.perf_counter()
    with session.post(url + "/v1/chat/completions", json={**BODY, "stream": True},
                      stream=True) as r:
        next(r.iter_content(chunk_size=None))
        t = time.perf_counter() - t0
        for _ in r.iter_content(chunk_size=None):
            pass
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    args = ap.parse_args()
    with LlamaServer(ctx=2048, parallel=2) as llama, \
            ProxyProcess(BACKEND_URL=llama.url, WEB_SEARCH=0, INJECT_SYSTEM=0) as plain, \
            ProxyProcess(BACKEND_URL=llama.url) as default:
        paths = {"direct": llama.url, "proxy (pass-through)": plain.url,
                 "proxy (default: web_search injected)": default.url}
        sessions = {k: requests.Session() for k in paths}
        for s in sessions.values():
            s.trust_env = False
        for _ in range(5):                               # warm-up: caches, pools, slots
            for k, url in paths.items():
                one(sessions[k], url)
                ttfb(sessions[k], url)
        full = {k: [] for k in paths}
        first = {k: [] for k in paths}
        names = list(paths)
        for i in range(args.n):
            order = names[i % len(names):] + names[:i % len(names)]   # rotate the order
            for k in order:
                full[k].append(one(sessions[k], paths[k]))
            for k in order:
                first[k].append(ttfb(sessions[k], paths[k]))
        base = statistics.median(full["direct"])
        base_t = statistics.median(first["direct"])
        print(f"{args.n} interleaved rounds, 1-token chat requests, median (p90) in ms")
        print(f"{'path':40} {'non-stream':>16} {'added':>8} {'stream TTFB':>16} {'added':>8}")
        for k in names:
            m, mt = statistics.median(full[k]), statistics.median(first[k])
            p90 = statistics.quantiles(full[k], n=10)[-1]
            p90t = statistics.quantiles(first[k], n=10)[-1]
            print(f"{k:40} {m * 1e3:7.1f} ({p90 * 1e3:6.1f}) {(m - base) * 1e3:+8.1f} "
                  f"{mt * 1e3:7.1f} ({p90t * 1e3:6.1f}) {(mt - base_t) * 1e3:+8.1f}")


if __name__ == "__main__":
    main()
