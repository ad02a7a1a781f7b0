"""The fleet's two numbers (docs/performance.md, "Several stacks behind LiteLLM"):

1. the router hop: the same 1-token request sent to a stack directly, through the
   LiteLLM router with our plugin, and through a plain LiteLLM router (no plugin, one
   deployment), interleaved in one run: TTFT of a streamed request and the wall time
   of a non-streamed one, medians;
2. swaps per 100 requests of a mixed two-model workload over two stacks that both
   declare both models: our routing vs LiteLLM's default (simple-shuffle).

    set -a; . tests/testbed/testbed.env; set +a
    .venv/bin/python -m tests.perf.fleet [--pairs 40] [--requests 100]

Real stacks (swapper + proxy, CPU llama-server + SmolLM2), the pinned LiteLLM of the
test bed (TESTBED_LITELLM). Prints markdown; JSON in $PERF_OUT/fleet.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import requests

from tests.support.fleet import KEY, LiteLLMRouter, served_by, swapper_counts
from tests.support.process import REPO
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess

B_DIR = REPO / "tests" / "fixtures" / "fleet" / "b"      # declares beta and gamma
BODY = {"max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def one(base: str, model: str, stream: bool, auth: bool) -> float:
    """Seconds to the first content chunk (stream) or to the whole answer."""
    headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
    t0 = time.perf_counter()
    r = requests.post(base + "/v1/chat/completions", headers=headers, stream=stream,
                      json={"model": model, "stream": stream, **BODY}, timeout=120)
    r.raise_for_status()
    if not stream:
        r.json()
        return time.perf_counter() - t0
    for line in r.iter_lines():
        if line.startswith(b"data: ") and b'"choices"' in line and b'"delta"' in line:
            dt = time.perf_counter() - t0
            r.close()
            return dt
    raise RuntimeError("no chunk")


def hop(paths: dict[str, tuple[str, bool]], pairs: int) -> dict:
    """Each path {name: (base URL, send the router key)} asked in turn, the order
    rotated every round; medians per path, streamed (TTFT) and not."""
    out = {}
    names = list(paths)
    for stream in (True, False):
        times: dict[str, list] = {n: [] for n in names}
        for _ in range(3):                       # warm every path
            for n in names:
                one(paths[n][0], "beta", stream, paths[n][1])
        for i in range(pairs):
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                times[n].append(one(paths[n][0], "beta", stream, paths[n][1]))
        out["ttft" if stream else "full"] = {
            n: round(statistics.median(v) * 1000, 1) for n, v in times.items()}
        out["ttft" if stream else "full"]["pairs"] = pairs
    return out


def mixed(router: str, stacks: dict, swappers: list, n: int, seed: int = 7) -> dict:
    for p in stacks.values():
        requests.post(p + "/unload", timeout=30).raise_for_status()
    time.sleep(1.5)
    before = [swapper_counts(s) for s in swappers]
    rnd = random.Random(seed)
    where = {}
    t0 = time.monotonic()
    for _ in range(n):
        model = rnd.choice(["beta", "gamma"])
        r = requests.post(router + "/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": model, **BODY})
        r.raise_for_status()
        where.setdefault(model, {}).setdefault(served_by(r, stacks), 0)
        where[model][served_by(r, stacks)] += 1
    after = [swapper_counts(s) for s in swappers]
    swaps = sum(a["swaps"] - b["swaps"] for a, b in zip(after, before))
    loads = sum(a["loads"] - b["loads"] for a, b in zip(after, before))
    return {"requests": n, "swaps": swaps, "loads": loads,
            "swaps_per_100": round(swaps * 100 / n, 1), "seconds": round(time.monotonic() - t0, 1),
            "served": where}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--requests", type=int, default=100)
    a = ap.parse_args()
    res = {}
    with SwapperProcess(backends_dir=B_DIR) as s1, SwapperProcess(backends_dir=B_DIR) as s2, \
            ProxyProcess(BACKEND_URL=s1.url, WEB_SEARCH=0, SYSTEM_PROMPT="") as p1, \
            ProxyProcess(BACKEND_URL=s2.url, WEB_SEARCH=0, SYSTEM_PROMPT="") as p2:
        stacks = {"S1": p1.url, "S2": p2.url}
        with LiteLLMRouter(stacks, poll=0.5) as ours, \
                LiteLLMRouter({"S1": p1.url}, strategy="simple-shuffle") as plain:
            requests.post(p1.url + "/load/beta", timeout=120).raise_for_status()
            time.sleep(1.5)
            res["hop"] = hop({"direct": (p1.url, False), "plugin": (ours.url, True),
                              "plain": (plain.url, True)}, a.pairs)
            res["ours"] = mixed(ours.url, stacks, [s1.url, s2.url], a.requests)
        with LiteLLMRouter(stacks, strategy="simple-shuffle") as shuffle:
            res["simple_shuffle"] = mixed(shuffle.url, stacks, [s1.url, s2.url], a.requests)
    h = res["hop"]
    print("| path | TTFT median (ms) | non-stream median (ms) |\n|---|---|---|")
    for n, label in (("direct", "stack directly"),
                     ("plugin", "LiteLLM router, our plugin (2 stacks) -> stack"),
                     ("plain", "LiteLLM router, no plugin (1 stack) -> stack")):
        print(f"| {label} | {h['ttft'][n]} | {h['full'][n]} |")
    print()
    print("| routing | requests | swaps | loads | swaps / 100 | wall s |\n|---|---|---|---|---|---|")
    for k, label in (("ours", "ours (deploy/fleet/routing.py)"),
                     ("simple_shuffle", "LiteLLM default (simple-shuffle)")):
        m = res[k]
        print(f"| {label} | {m['requests']} | {m['swaps']:.0f} | {m['loads']:.0f} | "
              f"{m['swaps_per_100']} | {m['seconds']} |")
    out = Path(os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
