"""Fair shares between tenants on one GPU (issue 35), through the real swapper on
the real Docker engine, in the style of tests/perf/thrash.py.

    tests/perf/run.sh fairshare [--loads 3,20] [--turns 60] [--answer 0.25]

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
Output: a markdown report on stdout, JSON in $PERF_OUT (default
/tmp/coding-stack-perf).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests.perf.thrash import Watch, metric_sum
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
    model: str
    turns: int
    name: str = ""
    done: list[float] = field(default_factory=list)      # when each answer came
    failures: list[str] = field(default_factory=list)
    finished: float | None = None


def run_agent(url: str, agent: Agent, answer: float) -> None:
    headers = {"x-session-id": agent.name}
    if agent.tenant is not None:
        headers["X-Coding-Stack-Tenant"] = agent.tenant
        headers["X-Coding-Stack-Weight"] = f"{agent.weight:g}"
    left = [agent.turns]
    lock = threading.Lock()

    def worker():
        with requests.Session() as http:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                try:
                    r = http.post(url + "/v1/chat/completions", headers=headers, timeout=900,
                                  json={"model": agent.model, "max_tokens": 1,
                                        "perf_first_ms": int(answer * 1000),
                                        "messages": [{"role": "user", "content": "go"}]})
                    if r.status_code != 200:
                        agent.failures.append(f"{r.status_code} {r.text[:200]}")
                except requests.RequestException as e:
                    agent.failures.append(str(e))
                with lock:
                    agent.done.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.finished = time.monotonic()


def run(loads: tuple[float, float], turns: int, answer: float, tenants: bool) -> dict:
    agents = [Agent(t if tenants else None, w, m, turns, name=f"{t}-{m}")
              for t, w in TENANTS.items() for m in MODELS]
    env = {"FAIR_LOAD_X": str(loads[0]), "FAIR_LOAD_Y": str(loads[1])}
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), LOG_LEVEL="WARNING",
                        **env) as sw:
        for m in MODELS:        # warm: each loaded once (its load time known)
            requests.post(f"{sw.url}/load/{m}", timeout=300).raise_for_status()
        requests.post(f"{sw.url}/unload", timeout=60).raise_for_status()
        before = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
        metrics0 = requests.get(sw.url + "/metrics", timeout=10).text
        watch = Watch(sw.stack)
        watch.start()
        t0 = time.monotonic()
        threads = [threading.Thread(target=run_agent, args=(sw.url, a, answer)) for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        watch.stop.set()
        watch.join()
        after = requests.get(sw.url + "/running", timeout=10).json()["tenants"]
        metrics1 = requests.get(sw.url + "/metrics", timeout=10).text
    n_loads = metric_sum(metrics1, "swapper_loads_total") - metric_sum(metrics0,
                                                                       "swapper_loads_total")
    loading = (metric_sum(metrics1, "swapper_load_seconds_sum")
               - metric_sum(metrics0, "swapper_load_seconds_sum"))
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
            "most_backends": watch.most}


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
    ap.add_argument("--one-tenant", default="yes", choices=("yes", "no"))
    ap.add_argument("--out", default=os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    a = ap.parse_args(argv)
    os.environ.update(load_testbed_env())
    lx, ly = (float(x) for x in a.loads.split(","))
    rows = [run((lx, ly), a.turns, a.answer, True)]
    print(f"[fairshare] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    if a.one_tenant == "yes":
        rows.append(run((lx, ly), a.turns, a.answer, False))
        print(f"[fairshare] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(report(rows))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"fairshare-{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"fairshare-{stamp}.md").write_text(report(rows) + "\n")
    bad = [r for r in rows if r["failures"] or r["most_backends"] > 1]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
