"""Swap overhead of the swapper, measured against the backend's own costs.

    python -m tests.perf.swap_overhead [--runs 7] [--source tiny-a] [--target tiny-b]

For each run, side by side on one machine:
  T  through the swapper: SOURCE resident, then a 1-token chat for TARGET;
     time from sending the request to the first streamed token.
  L  the backend alone: `docker run` of the same TARGET container (same image,
     args, volumes) by hand, polled for its health path every 10 ms until 200.
  F  first-token time of that fresh TARGET backend's first request (the
     swapped-in backend's first request is cold too), requested directly.
Swap overhead = T - L - F: what the swapper adds (draining and stopping the old
container, scheduling, health polling granularity, forwarding). Medians are
reported; nothing is asserted (benchmarks never gate tests).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import docker
import requests

from swapper.registry import Registry
from swapper.runtime import DockerRuntime
from swapper.settings import Settings
from tests.support.servers import free_port
from tests.support.swapperproc import FIXTURE_BACKENDS, SwapperProcess, reap, load_testbed_env

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
        "stream": True, "temperature": 0}


def first_token(url: str, model: str | None = None) -> float:
    body = dict(BODY, **({"model": model} if model else {}))
    t0 = time.perf_counter()
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and b'"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token in the stream")


def direct_cold_start(client, model_id: str, env: dict) -> tuple[float, float]:
    """(L, F): start the model's container by hand, poll health at 10 ms."""
    port = free_port()
    stack = f"perf-direct-{port}"
    settings = Settings.from_env({**env, "STACK_NAME": stack, "BACKEND_PUBLISH_PORT": str(port),
                                  "BACKENDS_DIR": str(FIXTURE_BACKENDS)})
    registry = Registry.load(settings.backends_dir, settings.env)
    rt = DockerRuntime(settings, registry, client)
    spec = registry.models[model_id]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    client.containers.run(detach=True, **rt._create_args(spec, f"{stack}-{model_id}"))
    try:
        while True:
            try:
                if requests.get(url + spec.health_path, timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.01)
        load = time.perf_counter() - t0
        return load, first_token(url)
    finally:
        reap(client, stack)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--source", default="tiny-a", help="model resident before the swap")
    ap.add_argument("--target", default="tiny-b", help="model swapped in")
    args = ap.parse_args()
    client = docker.from_env()
    env = {**os.environ, **load_testbed_env()}
    T, L, F, swapper_load = [], [], [], []
    with SwapperProcess() as sw:
        for _ in range(args.runs):
            requests.post(sw.url + "/unload", timeout=60)
            load, ftt = direct_cold_start(client, args.target, env)
            L.append(load)
            F.append(ftt)
            requests.post(sw.url + "/load/" + args.source, timeout=900).raise_for_status()
            T.append(first_token(sw.url, args.target))
            swapper_load.append(requests.get(sw.url + "/running", timeout=10).json()["last_load_seconds"])
    m = {k: statistics.median(v) for k, v in (("T_swap_to_first_token", T),
                                             ("L_backend_cold_start", L),
                                             ("F_backend_first_token", F))}
    m["swap_overhead"] = m["T_swap_to_first_token"] - m["L_backend_cold_start"] - m["F_backend_first_token"]
    per_run = [t - l - f for t, l, f in zip(T, L, F)]
    m["swap_overhead_median_of_runs"] = statistics.median(per_run)
    m["swapper_measured_load"] = statistics.median(swapper_load)
    m["runs"] = args.runs
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        for k, v in m.items():
            print(f"{k:32} {v*1000:9.0f} ms" if k != "runs" else f"{k:32} {v:9d}")


if __name__ == "__main__":
    main()
