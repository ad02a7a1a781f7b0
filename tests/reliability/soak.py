"""The soak: the whole stack (proxy + swapper as real processes, the real
Docker engine, the real CPU llama-server and SmolLM2) under mixed load.

    tests/run.sh --co -q >/dev/null   # (lays the test bed if needed)
    set -a; . tests/testbed/testbed.env; set +a
    .venv/bin/python -m tests.reliability.soak --requests 1000 --concurrency 64

Requests: random model (two llama.cpp models, so swaps happen), streamed or
not, raw connections with no retry; a share of clients hang up at a random
moment. Checked: every request not abandoned by its client gets a complete
answer; a Docker watcher samples the stack's running backends (never two);
the swapper's queue and in-flight gauges return to zero; no container is
left after the swapper exits; the services' memory before and after. Prints a
JSON summary and exits non-zero if any check fails. Bounded in count and time;
sends traffic to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import docker

from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import InvariantSampler, SwapperProcess, stack_containers

MODELS = ("tiny-a", "tiny-b")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (gunicorn master + worker)."""
    total = 0
    for p in [pid] + children(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 1024, 1)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


def one(port: int, rnd: random.Random, timeout: float) -> str:
    """One request; returns its outcome kind."""
    model = rnd.choice(MODELS)
    stream = rnd.random() < 0.5
    hang_up = rnd.random() < 0.1
    body = json.dumps({"model": model, "stream": stream, "max_tokens": rnd.randint(1, 12),
                       "messages": [{"role": "user", "content": "Say something short."}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        if hang_up:
            time.sleep(rnd.random() * 0.5)
            conn.sock.shutdown(socket.SHUT_RDWR)
            return "abandoned"
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            try:
                code = json.loads(data)["error"]["code"]
            except Exception:
                code = "?"
            return f"http_{r.status}_{code}"
        if stream:
            if not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
                return "stream_incomplete"
        else:
            json.loads(data)["choices"][0]
        return "ok"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return f"exc_{type(e).__name__}"
    finally:
        conn.close()


def gauges(url: str) -> dict:
    import requests
    return requests.get(url + "/running", timeout=10).json()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    args = ap.parse_args(argv)

    client = docker.from_env()
    outcomes: Counter = Counter()
    with SwapperProcess(MAX_QUEUE="256") as sw, \
            ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="0") as px, \
            InvariantSampler(client, sw.stack, interval=0.05) as inv:
        port = int(px.url.rsplit(":", 1)[1])
        one(port, random.Random(0), args.timeout)          # warm: first load
        mem_before = {"proxy": rss_mb(px.proc.pid), "swapper": rss_mb(sw.proc.pid)}
        rnds = [random.Random(args.seed * 100_003 + i) for i in range(args.requests)]
        t0 = time.monotonic()
        lock = threading.Lock()

        def run(i):
            kind = one(port, rnds[i], args.timeout)
            with lock:
                outcomes[kind] += 1
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(run, range(args.requests)))
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while True:
            g = gauges(sw.url)
            if (g["in_flight"], g["queued"]) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        mem_after = {"proxy": rss_mb(px.proc.pid), "swapper": rss_mb(sw.proc.pid)}
        failures = g.get("failures")
    leaked = len(stack_containers(client, sw.stack))
    lost = sum(v for k, v in outcomes.items() if k not in ("ok", "abandoned"))
    summary = {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(seconds, 1),
        "outcomes": dict(outcomes), "lost": lost,
        "max_concurrent_backends": inv.peak, "docker_samples": inv.samples,
        "models_seen_in_order": len(inv.seen_models),
        "gauges_after": {"in_flight": g["in_flight"], "queued": g["queued"]},
        "leaked_containers": leaked, "rss_mb_before": mem_before, "rss_mb_after": mem_after,
        "failures_by_model": failures,
    }
    print(json.dumps(summary, indent=2))
    ok = lost == 0 and inv.peak == 1 and leaked == 0 and (g["in_flight"], g["queued"]) == (0, 0)
    print("SOAK " + ("PASSED" if ok else "FAILED"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
