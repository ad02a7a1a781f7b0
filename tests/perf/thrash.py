"""Several agents on several models sharing one GPU: loads, time and waits under
each swap policy, through the real swapper on the real Docker engine.

    tests/perf/run.sh thrash [--loads 3,20] [--policies fifo,hold] [--only two,three]

Each scenario is a set of scripted agents: an agent sends a turn (a chat request
answered in ANSWER seconds), waits for the answer, runs its "tool" for its gap,
and sends its next turn, with its own session id. The models are stand-ins
(tests/perf/synth.py in the stand-in image, tests/perf/thrash_backends) whose
health turns 200 LOAD seconds after their container starts: a load without the
weights. For every scenario x policy x load time it reports the loads, loads
per 100 turns, the time for all turns against the ideal schedule (each model
loaded once, its agents' turns back to back), p50/p95/max wait per turn (the
turn's time less its answer), the share of the wall time spent loading, and
checks that every turn was answered and that two backends never ran at once.
Output: a markdown table on stdout, JSON in $PERF_OUT (default
/tmp/coding-stack-perf).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import docker
import requests

from tests.support.swapperproc import SwapperProcess, load_testbed_env, stack_containers

REPO = Path(__file__).resolve().parents[2]
PERF_DIR = REPO / "tests" / "perf"
BACKENDS = PERF_DIR / "thrash_backends"
ANSWER = 0.3                  # seconds a turn's answer takes on the backend


@dataclass
class Agent:
    name: str
    models: list[str]         # cycled through, one per turn
    gap: float                # its tool call between an answer and its next turn
    turns: int
    start: float = 0.0        # seconds after the scenario starts
    session: str | None = None   # default: its name; "" sends none
    waits: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def chain(self) -> float:
        """Its turns back to back, on a model that is always there."""
        return self.turns * ANSWER + (self.turns - 1) * self.gap


@dataclass
class Scenario:
    name: str
    title: str
    agents: list[Agent]
    ideal: callable             # (load seconds) -> the ideal schedule's time


def _two(load):
    return 2 * load + Agent("", ["x"], 1.0, 8).chain() * 2


def scenarios() -> dict[str, Scenario]:
    def s(name, title, agents, ideal):
        return name, Scenario(name, title, agents, ideal)
    return dict([
        s("two", "A on x, B on y (1 s gaps, 8 turns each)",
          [Agent("A", ["x"], 1.0, 8), Agent("B", ["y"], 1.0, 8)], _two),
        s("three", "A, B, D on x, y, z (0.2 / 1 / 3 s gaps, 6 turns each)",
          [Agent("A", ["x"], 0.2, 6), Agent("B", ["y"], 1.0, 6), Agent("D", ["z"], 3.0, 6)],
          lambda load: 3 * load + sum(Agent("", ["x"], g, 6).chain() for g in (0.2, 1.0, 3.0))),
        s("alternate", "one client strictly alternating x, y (architect / editor), 6 turns",
          [Agent("aider", ["x", "y"], 0.0, 6)],
          lambda load: 6 * (load + ANSWER)),
        s("steady", "A on x every 1 s (16 turns) + B on y now and then (3 turns, 4 s gaps)",
          [Agent("A", ["x"], 1.0, 16), Agent("B", ["y"], 4.0, 3, start=2.0)],
          lambda load: 2 * load + Agent("", ["x"], 1.0, 16).chain()
          + Agent("", ["y"], 4.0, 3).chain()),
        s("background", "A on x with Claude Code's background calls (claude-haiku-4-5, "
          "mapped to the resident) + B on y (1 s gaps, 6 turns)",
          [Agent("A", ["x", "claude-haiku-4-5"], 1.0, 8), Agent("B", ["y"], 1.0, 6)],
          lambda load: 2 * load + Agent("", ["x"], 1.0, 8).chain()
          + Agent("", ["y"], 1.0, 6).chain()),
        s("burst", "a burst of 20 one-turn agents on x, y, z at once",
          [Agent(f"burst{i}", ["xyz"[i % 3]], 0.0, 1) for i in range(20)],
          lambda load: 3 * (load + ANSWER)),
    ])


def run_agent(url: str, agent: Agent, t0: float, prefix: str = "") -> None:
    time.sleep(max(0.0, t0 + agent.start - time.monotonic()))
    session = agent.name if agent.session is None else agent.session
    headers = {"x-session-id": session} if session else {}
    with requests.Session() as http:
        for turn in range(agent.turns):
            model = agent.models[turn % len(agent.models)]
            model = prefix + model if model in ("x", "y", "z") else model
            t = time.monotonic()
            try:
                r = http.post(url + "/v1/chat/completions", headers=headers, timeout=900, json={
                    "model": model, "max_tokens": 1, "perf_first_ms": int(ANSWER * 1000),
                    "messages": [{"role": "user", "content": f"turn {turn}"}]})
                if r.status_code != 200:
                    agent.failures.append(f"turn {turn}: {r.status_code} {r.text[:200]}")
            except requests.RequestException as e:
                agent.failures.append(f"turn {turn}: {e}")
            agent.waits.append(max(0.0, time.monotonic() - t - ANSWER))
            if turn < agent.turns - 1:
                time.sleep(agent.gap)


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


class Watch(threading.Thread):
    """Counts the stack's running backend containers every 50 ms: never two."""

    def __init__(self, stack: str):
        super().__init__(daemon=True)
        self.client = docker.from_env()
        self.stack = stack
        self.most = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.most = max(self.most, len(stack_containers(self.client, self.stack, True)))
            self.stop.wait(0.05)


def all_at_once(stack: str, jobs: Callable[[float], list[Callable[[], object]]],
                timeout: float | None = None) -> tuple[float, float, int]:
    """Start every job (`jobs(t0)`: the agents' runs, told the start) in a thread of
    its own at once while Docker is watched; join them (each for at most `timeout`).
    (t0, seconds taken, most backends of the stack running at once)."""
    watch = Watch(stack)
    watch.start()
    t0 = time.monotonic()
    try:
        threads = [threading.Thread(target=job) for job in jobs(t0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        seconds = time.monotonic() - t0
    finally:
        watch.stop.set()
        watch.join()
    return t0, seconds, watch.most


def run(sc: Scenario, policy: str, load: float, real: bool = False) -> dict:
    """One scenario under one policy. `real`: the models are the real
    llama-server (rx, ry, rz), `load` is then what their loads take."""
    agents = [Agent(a.name, a.models, a.gap, a.turns, a.start, a.session) for a in sc.agents]
    prefix = "r" if real else ""
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), LOG_LEVEL="WARNING",
                        SWAP_POLICY=policy, THRASH_LOAD_SECONDS=str(load)) as sw:
        # Warm: every model loaded once (its load time known, its image in the page cache).
        for m in ("x", "y", "z"):
            requests.post(f"{sw.url}/load/{prefix}{m}", timeout=300).raise_for_status()
        if real:     # the real load time (the mean of the three), for the ideal schedule
            load = requests.get(sw.url + "/running", timeout=10).json()[
                "load_seconds_last_hour"] / 3
        requests.post(f"{sw.url}/unload", timeout=60).raise_for_status()
        before = requests.get(sw.url + "/metrics", timeout=10).text
        _, wall, most = all_at_once(sw.stack, lambda t0: [
            functools.partial(run_agent, sw.url, a, t0, prefix) for a in agents])
        after = requests.get(sw.url + "/metrics", timeout=10).text
    loads = metric_sum(after, "swapper_loads_total") - metric_sum(before, "swapper_loads_total")
    loading = (metric_sum(after, "swapper_load_seconds_sum")
               - metric_sum(before, "swapper_load_seconds_sum"))
    turns = sum(a.turns for a in agents)
    waits = sorted(w for a in agents for w in a.waits)
    ideal = sc.ideal(load)
    return {
        "scenario": sc.name, "policy": policy, "load_seconds": round(load, 1),
        "backend": "llama-server" if real else "stand-in", "turns": turns,
        "loads": int(loads), "loads_per_100_turns": round(100 * loads / turns, 1),
        "wall_seconds": round(wall, 1), "ideal_seconds": round(ideal, 1),
        "x_ideal": round(wall / ideal, 2),
        "wait_p50": round(statistics.median(waits), 2),
        "wait_p95": round(waits[min(len(waits) - 1, int(0.95 * len(waits)))], 2),
        "wait_max": round(waits[-1], 2),
        "wait_max_by_agent": {a.name: round(max(a.waits), 2) for a in agents},
        "loading_share": round(loading / wall, 2),
        "failures": [f for a in agents for f in a.failures],
        "most_backends": most,
    }


def table(rows: list[dict]) -> str:
    out = ["| scenario | backend, load | policy | loads | /100 turns | time | ideal | x ideal | "
           "wait p50 / p95 / max | loading | lost | backends at once |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['scenario']} | {r.get('backend', 'stand-in')}, {r['load_seconds']:g} s "
                   f"| {r['policy']} | {r['loads']} "
                   f"| {r['loads_per_100_turns']:g} | {r['wall_seconds']} s | "
                   f"{r['ideal_seconds']} s | {r['x_ideal']} | {r['wait_p50']} / "
                   f"{r['wait_p95']} / {r['wait_max']} s | {round(100 * r['loading_share'])} % "
                   f"| {len(r['failures'])} | {r['most_backends']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="3", help="load times, seconds, comma-separated")
    ap.add_argument("--policies", default="fifo,hold")
    ap.add_argument("--only", default="", help="scenarios (default: all): "
                    + ", ".join(scenarios()))
    ap.add_argument("--real", action="store_true",
                    help="the real llama-server + SmolLM2 instead of the stand-ins")
    ap.add_argument("--out", default=os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    a = ap.parse_args(argv)
    os.environ.update(load_testbed_env())
    wanted = [s for s in a.only.split(",") if s] or list(scenarios())
    rows = []
    for load in (float(x) for x in a.loads.split(",")):
        for name in wanted:
            for policy in a.policies.split(","):
                r = run(scenarios()[name], policy, load, a.real)
                print(f"[thrash] {json.dumps(r)}", file=sys.stderr, flush=True)
                rows.append(r)
    print(table(rows))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"thrash-{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"thrash-{stamp}.md").write_text(table(rows) + "\n")
    bad = [r for r in rows if r["failures"] or r["most_backends"] > 1]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
