"""Fair shares between tenants on one GPU (issue 35), through the real swapper on
the real Docker engine, in the style of tests/perf/thrash.py.

    tests/perf/run.sh fairshare [--loads 3,20] [--turns 60] [--answer 0.25]
                                [--runs tenants,one,switcher] [--switcher-loads 3,5]

Three tenants with weights 1, 2, 3 (the proxy's fields X-Coding-Stack-Tenant /
X-Coding-Stack-Weight, sent here as the proxy sends them on the internal hop),
two agents each: one on model fx, one on fy. The models are stand-ins
(tests/perf/synth.py, tests/perf/fairshare_backends: one slot each, healthy
LOAD seconds after their container starts: fx in 3 s, fy in 20 s by default).
An agent works like a parallel agent or a batch: WORKERS requests in flight at
once under one session, TURNS answers in all, each answer ANSWER seconds on
the backend, so every tenant always has requests waiting.

Reported per tenant: its share of the GPU's serving time while all tenants still
had work (answers completed before the first agent finished, x ANSWER) against
its weight's share (target: within 10 %), the load seconds charged to it
(/running's tenants), and the makespan against the ideal schedule (each model
loaded once, then its answers back to back; target: within 1.3x). The same
agents then run as one tenant (no fields: the box without keys), which is
today's behaviour by construction (tests/unit/swapper/test_tenants.py).
`--runs switcher`: a tenant that forces swaps (see `switcher`), with and
without tenants: loads, when the others were done, its longest wait, and
the load seconds charged.
Output: a markdown report on stdout, JSON in $PERF_OUT (default
/tmp/coding-stack-perf).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests.perf.thrash import all_at_once, metric_sum
from tests.support.swapperproc import SwapperProcess, load_testbed_env

REPO = Path(__file__).resolve().parents[2]
PERF_DIR = REPO / "tests" / "perf"
BACKENDS = PERF_DIR / "fairshare_backends"
TENANTS = {"A": 1.0, "B": 2.0, "C": 3.0}
MODELS = ("fx", "fy")
WORKERS = 3                     # an agent's requests in flight at once


@dataclass
class Agent:
    tenant: str | None          # None: no fields (the default tenant)
    weight: float
    model: str                  # or several, comma-separated: one turn each, in turn
    turns: int
    name: str = ""
    workers: int = WORKERS
    gap: float = 0.0            # a worker's pause between an answer and its next request
    done: list[float] = field(default_factory=list)      # when each answer came
    waits: list[float] = field(default_factory=list)     # each request's time less its answer
    failures: list[str] = field(default_factory=list)
    finished: float | None = None


def run_agent(url: str, agent: Agent, answer: float) -> None:
    headers = {"x-session-id": agent.name}
    if agent.tenant is not None:
        headers["X-Coding-Stack-Tenant"] = agent.tenant
        headers["X-Coding-Stack-Weight"] = f"{agent.weight:g}"
    left = [agent.turns]
    lock = threading.Lock()
    models = agent.model.split(",")

    def worker():
        with requests.Session() as http:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                    model = models[(agent.turns - left[0] - 1) % len(models)]
                t = time.monotonic()
                try:
                    r = http.post(url + "/v1/chat/completions", headers=headers, timeout=900,
                                  json={"model": model, "max_tokens": 1,
                                        "perf_first_ms": int(answer * 1000),
                                        "messages": [{"role": "user", "content": "go"}]})
                    if r.status_code != 200:
                        agent.failures.append(f"{r.status_code} {r.text[:200]}")
                except requests.RequestException as e:
                    agent.failures.append(str(e))
                with lock:
                    agent.done.append(time.monotonic())
                    agent.waits.append(max(0.0, agent.done[-1] - t - answer))
                if left[0]:
                    time.sleep(agent.gap)

    threads = [threading.Thread(target=worker) for _ in range(agent.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.finished = time.monotonic()


class Played:
    """What one scenario gave: its start and wall time, /running's tenants and
    /metrics before and after, the model loads between, the most backends at once."""

    def __init__(self, t0, wall, before, after, metrics0, metrics1, most):
        self.t0, self.wall, self.before, self.after = t0, wall, before, after
        self.metrics0, self.metrics1, self.most = metrics0, metrics1, most

    def delta(self, metric: str) -> float:
        return metric_sum(self.metrics1, metric) - metric_sum(self.metrics0, metric)


def play(loads: tuple[float, float], agents: list[Agent], answer: float) -> Played:
    """A fresh swapper with the stand-in loads, each model loaded once (its load
    time known) and unloaded, then every agent at once until all are done."""
    env = {"FAIR_LOAD_X": str(loads[0]), "FAIR_LOAD_Y": str(loads[1])}
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), LOG_LEVEL="WARNING",
                        **env) as sw:
        for m in MODELS:
            requests.post(f"{sw.url}/load/{m}", timeout=300).raise_for_status()
        requests.post(f"{sw.url}/unload", timeout=60).raise_for_status()
        before = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
        metrics0 = requests.get(sw.url + "/metrics", timeout=10).text
        t0, wall, most = all_at_once(sw.stack, lambda t0: [
            functools.partial(run_agent, sw.url, a, answer) for a in agents])
        after = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
        metrics1 = requests.get(sw.url + "/metrics", timeout=10).text
    return Played(t0, wall, before, after, metrics0, metrics1, most)


def run(loads: tuple[float, float], turns: int, answer: float, tenants: bool) -> dict:
    agents = [Agent(t if tenants else None, w, m, turns, name=f"{t}-{m}")
              for t, w in TENANTS.items() for m in MODELS]
    p = play(loads, agents, answer)
    t0, wall, before, after = p.t0, p.wall, p.before, p.after
    n_loads = p.delta("swapper_loads_total")
    loading = p.delta("swapper_load_seconds_sum")
    window = min(a.finished for a in agents)      # every tenant still had work until then
    names = list(TENANTS) if tenants else ["default"]
    of = (lambda a: a.tenant) if tenants else (lambda a: "default")
    served = {n: answer * sum(1 for a in agents if of(a) == n for d in a.done if d <= window)
              for n in names}
    total = sum(served.values()) or 1.0
    wsum = sum(TENANTS.values())
    shares = {}
    for n in names:
        want = TENANTS[n] / wsum if tenants else 1.0
        got = served[n] / total
        shares[n] = {"weight": TENANTS[n] if tenants else 1.0, "target": round(want, 3),
                     "share": round(got, 3), "off": round(abs(got - want) / want, 3),
                     "charged_load_seconds": round(
                         after.get(n, {}).get("charged_load_seconds_total", 0.0)
                         - before.get(n, {}).get("charged_load_seconds_total", 0.0), 1)}
    ideal = sum(loads) + sum(a.turns for a in agents) * answer
    return {"run": "three tenants, weights 1/2/3" if tenants else "one tenant (no fields)",
            "loads": list(loads), "turns_per_agent": turns, "answer": answer,
            "workers_per_agent": WORKERS, "window_seconds": round(window - t0, 1),
            "tenants": shares, "model_loads": int(n_loads),
            "loading_seconds": round(loading, 1), "wall_seconds": round(wall, 1),
            "ideal_seconds": round(ideal, 1), "x_ideal": round(wall / ideal, 2),
            "failures": [f for a in agents for f in a.failures],
            "most_backends": p.most}


def switcher(loads: tuple[float, float], turns: int, answer: float, tenants: bool) -> dict:
    """A tenant that forces swaps: B (weight 2) and C (3) each run a parallel agent
    on fx; A (weight 1) is one client alternating fx and fy (1 s between turns).
    Without tenants A's every fy request ends fx's stint after its quantum; with
    them, A, over its share of load seconds after its first fy load, waits for
    the next stint (here: until B and C are done, or QUANTUM_MAX_SECONDS)."""
    agents = [Agent("B" if tenants else None, 2.0, "fx", turns, name="B"),
              Agent("C" if tenants else None, 3.0, "fx", turns, name="C"),
              Agent("A" if tenants else None, 1.0, "fx,fy", 6, name="A", workers=1, gap=1.0)]
    p = play(loads, agents, answer)
    t0, wall, before, after = p.t0, p.wall, p.before, p.after
    n_loads = p.delta("swapper_loads_total")
    charged = {a.name: round(after.get(a.tenant or "default", {}).get(
        "charged_load_seconds_total", 0.0) - before.get(a.tenant or "default", {}).get(
        "charged_load_seconds_total", 0.0), 1) for a in agents} if tenants else {
        "default": round(after["default"]["charged_load_seconds_total"]
                         - before.get("default", {}).get("charged_load_seconds_total", 0), 1)}
    return {"run": "switcher, " + ("three tenants" if tenants else "one tenant (no fields)"),
            "loads": list(loads), "model_loads": int(n_loads),
            "b_and_c_done_seconds": round(max(a.finished for a in agents[:2]) - t0, 1),
            "a_wait_max": round(max(agents[2].waits), 1),
            "b_and_c_work_seconds": round(2 * turns * answer, 1),
            "charged": charged, "wall_seconds": round(wall, 1),
            "failures": [f for a in agents for f in a.failures], "most_backends": p.most}


def report_switcher(rows: list[dict]) -> str:
    out = ["| run | loads fx / fy | model loads | B and C done | (their work) | A's longest "
           "wait | load seconds charged | backends at once |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['loads'][0]:g} / {r['loads'][1]:g} s | {r['model_loads']} "
                   f"| {r['b_and_c_done_seconds']} s | {r['b_and_c_work_seconds']} s "
                   f"| {r['a_wait_max']} s | "
                   + ", ".join(f"{k} {v:g}" for k, v in r["charged"].items())
                   + f" | {r['most_backends']} |")
    return "\n".join(out) + "\n"


def report(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append(f"**{r['run']}**, loads fx {r['loads'][0]:g} s / fy {r['loads'][1]:g} s, "
                   f"{r['turns_per_agent']} answers of {r['answer']:g} s per agent "
                   f"({r['workers_per_agent']} in flight): {r['model_loads']} loads "
                   f"({r['loading_seconds']} s), makespan {r['wall_seconds']} s vs ideal "
                   f"{r['ideal_seconds']} s = **{r['x_ideal']}x**; shares measured over the "
                   f"first {r['window_seconds']} s (until the first agent finished); "
                   f"failures {len(r['failures'])}, backends at once {r['most_backends']}")
        out.append("")
        out.append("| tenant | weight | target share | GPU share | off by | load seconds "
                   "charged |")
        out.append("|---|---|---|---|---|---|")
        for n, t in r["tenants"].items():
            out.append(f"| {n} | {t['weight']:g} | {100 * t['target']:.1f} % | "
                       f"{100 * t['share']:.1f} % | {100 * t['off']:.1f} % | "
                       f"{t['charged_load_seconds']:g} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="3,20", help="fx and fy load seconds")
    ap.add_argument("--turns", type=int, default=60, help="answers per agent")
    ap.add_argument("--answer", type=float, default=0.25, help="seconds per answer")
    ap.add_argument("--runs", default="tenants,one",
                    help="tenants (three with weights), one (the same as one tenant), "
                    "switcher (a tenant forcing swaps, with and without tenants)")
    ap.add_argument("--switcher-loads", default="3,5", help="fx and fy load seconds of the "
                    "switcher runs")
    ap.add_argument("--switcher-turns", type=int, default=200, help="answers B and C each "
                    "run in the switcher runs")
    ap.add_argument("--out", default=os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    a = ap.parse_args(argv)
    os.environ.update(load_testbed_env())
    runs = a.runs.split(",")
    lx, ly = (float(x) for x in a.loads.split(","))
    rows = [run((lx, ly), a.turns, a.answer, t == "tenants") for t in ("tenants", "one")
            if t in runs]
    text = report(rows) if rows else ""
    if "switcher" in runs:
        sx, sy = (float(x) for x in a.switcher_loads.split(","))
        sw_rows = [switcher((sx, sy), a.switcher_turns, a.answer, t) for t in (True, False)]
        text += "\n" + report_switcher(sw_rows)
        rows += sw_rows
    for r in rows:
        print(f"[fairshare] {json.dumps(r)}", file=sys.stderr, flush=True)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"fairshare-{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"fairshare-{stamp}.md").write_text(text + "\n")
    bad = [r for r in rows if r["failures"] or r["most_backends"] > 1]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
