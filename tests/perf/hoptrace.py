"""Where a request's time goes in each hop, on the real stack: the proxy and
the swapper (as `python -m`, gunicorn + gevent) in front of the test bed's CPU
llama-server, each stamping its socket receives and sends and the moment a
request reaches the app (tests/perf/hoptrace_site: wrapped in the process,
nothing in the services changed).

    python -m tests.perf.hoptrace [--rounds 60] [--gap 0.1] [--proxy-env K=V ...]

Per service, medians over the rounds (ms):

- parse: the request received -> the app called (gunicorn's parser and environ)
- route: the app called -> the request sent on to the next hop
- answer: a non-streamed answer received -> sent on
- stream headers / first token: each piece of a streamed answer received ->
  sent on (the headers cross when the backend sends them; the first token is
  the piece the client waits for)

The numbers are wall time on a machine where the services sleep between
requests, so they include cold CPU caches (docs/performance.md); the trace
itself costs a few µs per stamp.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import requests

from tests.perf import client
from tests.perf.bench import PERF_BACKENDS, PERF_DIR, chat
from tests.support.process import REPO
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess

SITE = Path(__file__).resolve().parent / "hoptrace_site"


def traced(name: str, out: Path) -> dict:
    return {"HOPTRACE_DIR": str(out), "HOPTRACE_NAME": name,
            "PYTHONPATH": f"{SITE}:{REPO}", "LOG_LEVEL": "WARNING"}


def stamps(out: Path, name: str) -> list[tuple[float, str]]:
    ev = []
    for f in out.glob(f"{name}-*.log"):
        for line in f.read_text().splitlines():
            t, tag = line.split()
            ev.append((float(t), tag))
    return sorted(ev)


def phases(events: list[tuple[float, str]], stream: bool) -> dict[str, float] | None:
    """One request's phases in one service, from its stamps (see the module)."""
    tags = [t for _, t in events]
    at = [t for t, _ in events]
    if not tags or tags[0] != "recv" or "app" not in tags or "send" not in tags:
        return None
    app = tags.index("app")
    sent = tags.index("send", app)          # the request, on to the next hop (the body
    out = {"parse": at[app] - at[0],        # may have come in a receive of its own)
           "route": at[sent] - at[app]}
    pieces = []                    # (received, sent on) for each piece of the answer
    i = sent + 1
    while i + 1 < len(events):
        if tags[i] == "recv" and tags[i + 1] == "send":
            pieces.append(at[i + 1] - at[i])
            i += 2
        else:
            i += 1
    if not pieces:
        return None
    if not stream:
        out["answer"] = pieces[0]
    elif len(pieces) >= 2:
        out["stream headers"], out["first token"] = pieces[0], pieces[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--gap", type=float, default=0.1)
    ap.add_argument("--proxy-env", nargs="*", default=[], help="K=V for the proxy")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="hoptrace-"))
    marks: list[tuple[str, float]] = []
    with SwapperProcess(backends_dir=PERF_BACKENDS, PERF_DIR=str(PERF_DIR),
                        **traced("swapper", out)) as sw:
        proxy = ProxyProcess(BACKEND_URL=sw.url, **traced("proxy", out),
                             **dict(kv.split("=", 1) for kv in a.proxy_env)).start()
        try:
            requests.post(sw.url + "/load/llama", timeout=300).raise_for_status()
            session = client.Session(proxy.url)
            one, first = chat("llama", 1, False), chat("llama", 4, True)
            for _ in range(3):                         # caches, pools, prompt cache
                session.post("/v1/chat/completions", one)
                client.stream(proxy.url, first)
            time.sleep(a.gap)
            for f in out.glob("*.log"):
                f.write_text("")
            for _ in range(a.rounds):
                time.sleep(a.gap)
                marks.append(("non-stream", time.time()))
                session.post("/v1/chat/completions", one)
                time.sleep(a.gap)
                marks.append(("stream", time.time()))
                client.stream(proxy.url, first)
            time.sleep(a.gap)
            marks.append(("end", time.time()))
            session.close()
        finally:
            proxy.stop()
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for svc in ("proxy", "swapper"):
        events = stamps(out, svc)
        for (kind, t0), (_, t1) in zip(marks, marks[1:]):
            got = phases([e for e in events if t0 <= e[0] < t1], kind == "stream")
            for k, v in (got or {}).items():
                rows.setdefault((kind, svc), {}).setdefault(k, []).append(v * 1e3)
    print(f"| request | service | phase | ms, median | n |\n|---|---|---|---|---|")
    for (kind, svc), got in rows.items():
        for k, v in got.items():
            print(f"| {kind} | {svc} | {k} | {statistics.median(v):.3f} | {len(v)} |")


if __name__ == "__main__":
    main()
