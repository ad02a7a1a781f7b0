"""Prompt caches across swaps, measured (issue 22): an agent-like conversation of
~8k and ~24k tokens on model A (the test bed's llama-server + SmolLM2 at -c 32768,
one slot), a swap to B (one request), back to A for the next turn. On demand
(tests/perf/run.sh kvswap), not part of pytest.

    .venv/bin/python -m tests.perf.kvswap [--sizes 8000,24000] [--repeats 3] [--json FILE]

Per size, one real swapper (KV_CACHE_DIR set, real Docker, tests/perf/kvswap_backends):

  build         the history's first turn: the whole prefill (what a swap without the
                cache costs again), timed by llama-server (timings.prompt_ms)
  then R times:
    never       the next turn on the resident A (no swap): its new tokens only
    restored    a request to B (the swap away: A's slot saved), then the next turn
                on A (the swap back: A loaded, its slot restored before admission)
  once:
    no restore  a request to B (saved again), the saved files deleted, the next turn
                on A: the whole prefill again

Every next turn is the same history plus a new user message of its own (~100
tokens, none repeated), so a reused prefix is the history only. Per turn: TTFT (from
sending the streamed request to its first content token, the swap back included),
the load (swapper_load_seconds, which includes the restore), prompt tokens
processed and reused (the answer's timings.prompt_n / cache_n), the swapper's
`saving` / `restoring` events (seconds, bytes) and its `reused` event. The load
average before and after each size is printed: the 2 cores are shared.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from tests.support.swapperproc import SwapperProcess

BACKENDS = Path(__file__).resolve().parent / "kvswap_backends"
A, B = "long-a", "other-b"
WORDS = ("parse", "config", "request", "buffer", "handler", "socket", "retry", "cache",
         "schema", "token", "stream", "worker", "queue", "timeout", "router", "model")


def source_text(n_lines: int, seed: int = 0) -> str:
    """Deterministic code-like lines (an agent's file reads)."""
    out = []
    for i in range(n_lines):
        a, b, c = (WORDS[(i * k + seed) % len(WORDS)] for k in (3, 5, 7))
        out.append(f"def {a}_{b}_{i}(self, {c}, n={i % 97}):  # {b} {c} line {i}\n"
                   f"    return self.{c}.{a}({b}={i * 31 % 1009})")
    return "\n".join(out)


def tokens(url: str, text: str) -> int:
    r = requests.post(f"{url}/upstream/{A}/tokenize", json={"content": text}, timeout=120)
    r.raise_for_status()
    return len(r.json()["tokens"])


def history_of(url: str, target: int) -> list[dict]:
    """A system prompt, a user turn holding files (~target tokens all told), an answer."""
    per_line = tokens(url, source_text(200)) / 200
    files = source_text(max(int((target - 150) / per_line), 10))
    return [{"role": "system", "content": "You are a coding agent. Read the files, then "
             "answer each request about them briefly."},
            {"role": "user", "content": "Here are the files of the project:\n" + files},
            {"role": "assistant", "content": "I have read the files. What should I do?"}]


def next_turn(history: list[dict], tag: str) -> list[dict]:
    ask = (f"Request {tag}: find where {WORDS[len(tag) % 16]} is retried and say which "
           f"function to change; {source_text(2, seed=sum(map(ord, tag)))}")
    return history + [{"role": "user", "content": ask}]


def stream_turn(url: str, messages: list[dict]) -> dict:
    """One streamed turn: TTFT (to the first content token), total, the timings."""
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/chat/completions", stream=True, timeout=1800, json={
        "model": A, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True})
    r.raise_for_status()
    ttft, timings = None, None
    for line in r.iter_lines(decode_unicode=True):
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if ttft is None and any((c.get("delta") or {}).get("content")
                                for c in event.get("choices") or []):
            ttft = time.monotonic() - t0
        timings = event.get("timings") or timings
    return {"ttft": ttft, "total": time.monotonic() - t0, "prompt_n": timings["prompt_n"],
            "cache_n": timings["cache_n"], "prompt_s": timings["prompt_ms"] / 1000}


def metric(url: str, name: str, **labels) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


class Events:
    """The swapper's /events, collected in a thread."""

    def __init__(self, url: str):
        self.items: list[dict] = []
        self._r = requests.get(url + "/events", stream=True, timeout=3600)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for line in self._r.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    self.items.append(json.loads(line[6:]))
        except Exception:
            pass

    def last(self, event: str, since: int, **match) -> dict | None:
        for e in reversed(self.items[since:]):
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    def close(self):
        self._r.close()


def swap_back(url: str, ev: Events, messages: list[dict], drop: Path | None = None) -> dict:
    """B once (A saved on the way out), then A's next turn (restored unless `drop`)."""
    mark = len(ev.items)
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": B, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]})
    r.raise_for_status()
    away = time.monotonic() - t0
    if drop is not None:
        for p in drop.glob("slot*"):
            p.unlink()
    loads = metric(url, "swapper_load_seconds_sum", model=A)
    turn = stream_turn(url, messages)
    time.sleep(0.3)                      # the last events reach the reader
    saving = ev.last("saving", mark, model=A, done=True) or {}
    restoring = ev.last("restoring", mark, model=A, done=True) or {}
    reused = ev.last("reused", mark, model=A) or {}
    return {**turn, "swap_away": away,
            "load": metric(url, "swapper_load_seconds_sum", model=A) - loads,
            "save_s": saving.get("seconds"), "save_bytes": saving.get("bytes"),
            "save_tokens": saving.get("tokens"),
            "restore_s": restoring.get("seconds"), "restored_tokens": restoring.get("tokens"),
            "reused_event": {k: reused.get(k) for k in ("restored", "reused", "processed")}
            if reused else None}


def measure(size: int, repeats: int, cold: bool = True) -> dict:
    kv = Path(tempfile.mkdtemp(prefix="kvswap-"))
    os.chmod(kv, 0o777)
    out: dict = {"size": size, "load_before": os.getloadavg()}
    try:
        with SwapperProcess(backends_dir=BACKENDS, KV_CACHE_DIR=str(kv), LOG_LEVEL="WARNING",
                            KV_CACHE_SAVE_TIMEOUT="120", KV_CACHE_RESTORE_TIMEOUT="120") as sw:
            ev = Events(sw.url)
            requests.post(f"{sw.url}/load/{A}", timeout=600).raise_for_status()
            history = history_of(sw.url, size)
            out["build"] = stream_turn(sw.url, next_turn(history, "build"))
            print(f"[{size}] build: {out['build']}", flush=True)
            out["never"], out["restored"] = [], []
            for i in range(repeats):
                out["never"].append(stream_turn(sw.url, next_turn(history, f"never-{i}")))
                print(f"[{size}] never {i}: {out['never'][-1]}", flush=True)
                out["restored"].append(swap_back(sw.url, ev, next_turn(history, f"rest-{i}")))
                print(f"[{size}] restored {i}: {out['restored'][-1]}", flush=True)
            if cold:
                out["no_restore"] = swap_back(sw.url, ev, next_turn(history, "cold"),
                                              drop=kv / A)
                print(f"[{size}] no restore: {out['no_restore']}", flush=True)
            out["disk_bytes"] = metric(sw.url, "swapper_kv_cache_disk_bytes")
            ev.close()
            requests.post(f"{sw.url}/unload", timeout=600)
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    return out


def med(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def report(results: list[dict]) -> str:
    lines = ["| context | next turn | n | prompt_n | cache_n | TTFT s | load s | "
             "TTFT - load s | save s | restore s | on disk MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        size = res["build"]["prompt_n"]
        rows = [("never swapped", res["never"]), ("swapped, restored", res["restored"]),
                ("swapped, no restore", [res["no_restore"]]) if "no_restore" in res else
                ("full prefill (the build turn; no swap, no load)", [res["build"]])]
        for name, rs in rows:
            ttft, load = med(rs, "ttft"), med(rs, "load")
            cells = [f"{size:,}", name, str(len(rs)), f"{med(rs, 'prompt_n'):g}",
                     f"{med(rs, 'cache_n'):g}", f"{ttft:.2f}",
                     f"{load:.2f}" if load is not None else "-",
                     f"{ttft - load:.2f}" if load is not None else f"{ttft:.2f}",
                     f"{med(rs, 'save_s'):.2f}" if med(rs, "save_s") is not None else "-",
                     f"{med(rs, 'restore_s'):.2f}" if med(rs, "restore_s") is not None else "-",
                     f"{med(rs, 'save_bytes') / 1e6:.0f}" if med(rs, "save_bytes") else "-"]
            lines.append("| " + " | ".join(cells) + " |")
        never, rest = med(res["never"], "ttft"), med(res["restored"], "ttft")
        added = (med(res["restored"], "save_s") or 0) + (med(res["restored"], "restore_s") or 0)
        lines.append(f"\n{size:,} tokens: re-prefill (build) {res['build']['prompt_s']:.1f} s; "
                     f"save+restore {added:.2f} s; TTFT restored / never "
                     f"{rest / never:.2f}x, restored minus load / never "
                     f"{(rest - med(res['restored'], 'load')) / never:.2f}x; load average "
                     f"before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}\n")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8000,24000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", choices=("on", "off"), default="on",
                    help="off: no 'no restore' turn (a second full prefill); the build "
                         "turn's full prefill is reported in its place")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = [measure(int(s), args.repeats, cold=args.cold == "on")
               for s in args.sizes.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
