"""The stack's performance, side by side in one run (run by tests/perf/run.sh).

Paths, all to the same backend container (the swapper starts it; "direct" is
its published port):
  direct          the backend itself
  proxy           python -m proxy (default settings) -> backend
  swapper         python -m swapper -> backend
  stack           proxy (default settings: web_search injected) -> swapper -> backend
  stack-nosearch  the same with WEB_SEARCH=0
  litellm         a LiteLLM proxy (litellm[proxy], plain pass-through) -> backend

Workloads (paired and rotated: every round sends one request per path, in an
order that rotates from round to round; "added" is the median of the per-round
differences to direct, so slow phases of a noisy machine cancel out):
  real     the test bed's llama-server + SmolLM2 via the swapper: 1-token
           non-stream latency, streamed TTFT, 256-token decode tok/s
  hop      non-streaming requests to the synthetic backend (it answers at
           once): what each hop adds in wall time and CPU ms per request, for
           a tiny body and an agent-sized one
  synth    tests/perf/synth.py in a container: chunks/s of one fast stream, CPU
           seconds per 1,000 chunks in the proxy and swapper processes;
           1/16/64/256 concurrent paced streams: errors, TTFT p50/p99,
           aggregate chunks/s, memory of each service
  swap     alpha -> beta through the swapper against beta's own cold start
  health   backend healthy -> request forwarded (and -> first byte at the client)

Prints markdown tables (medians, p99, ratios to direct) and writes JSON.
Asserts nothing: speed is benchmarked, not asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import docker
import requests

from swapper.registry import Registry
from swapper.runtime import DockerRuntime
from swapper.settings import Settings as SwapperSettings
from tests.perf import client
from tests.support.process import REPO, ServiceProcess
from tests.support.proxyproc import ProxyProcess
from tests.support.servers import free_port
from tests.support.swapperproc import SwapperProcess, load_testbed_env, reap

PERF_DIR = REPO / "tests" / "perf"
PERF_BACKENDS = PERF_DIR / "backends"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
LITELLM_KEY = client.AUTH


# ----------------------------------------------------------------- processes

class LiteLLMProcess(ServiceProcess):
    """`litellm --config` from its own venv, every model a plain openai/ pass-through."""
    name = "litellm"
    health_path = "/health/liveliness"
    ready_timeout = 180.0

    def __init__(self, binary: str, backend_url: str, models: list[str]):
        super().__init__({"LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                          "LITELLM_LOG": "ERROR", "NO_DOCS": "True"})
        self.binary = binary
        cfg = "model_list:\n" + "".join(
            f"  - model_name: {m}\n    litellm_params:\n      model: openai/{m}\n"
            f"      api_base: {backend_url}/v1\n      api_key: none\n" for m in models)
        cfg += "litellm_settings:\n  telemetry: false\n"
        self.config = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        self.config.write(cfg)
        self.config.close()

    def command(self) -> list[str]:
        return [self.binary, "--config", self.config.name, "--host", "127.0.0.1",
                "--port", str(self.port), "--num_workers", "1"]


def group_pids(leader: int) -> list[int]:
    """Every process in the leader's process group (gunicorn master + workers)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            fields = st[st.rindex(")") + 2:].split()
            if int(fields[2]) == leader:          # pgrp
                pids.append(int(d))
        except (OSError, ValueError):
            pass
    return pids


def cpu_seconds(leader: int) -> float:
    """CPU time of the leader's whole process group, to the nanosecond: the
    scheduler's own account of every thread (/proc/*/task/*/schedstat), not
    utime+stime, which count in ticks of 10 ms."""
    total = 0
    for pid in group_pids(leader):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def cpu_of(services: dict[str, int]) -> dict[str, float]:
    """cpu_seconds() of each service (name -> its leader's pid)."""
    return {svc: cpu_seconds(pid) for svc, pid in services.items()}


def memory_mb(leader: int) -> dict:
    """PSS of the whole group (shared pages counted once) and the largest RSS."""
    pss = rss_max = 0
    for pid in group_pids(leader):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1])
                    elif line.startswith("Rss:"):
                        rss_max = max(rss_max, int(line.split()[1]))
        except OSError:
            pass
    return {"pss_mb": round(pss / 1024, 1), "rss_max_mb": round(rss_max / 1024, 1)}


class MemorySampler(threading.Thread):
    def __init__(self, leaders: dict[str, int], every: float = 0.25):
        super().__init__(daemon=True)
        self.leaders, self.every = leaders, every
        self.peak: dict[str, dict] = {k: {"pss_mb": 0.0, "rss_max_mb": 0.0} for k in leaders}
        self.stop_ev = threading.Event()

    def run(self):
        while not self.stop_ev.is_set():
            self.sample()
            self.stop_ev.wait(self.every)

    def sample(self):
        for k, pid in self.leaders.items():
            m = memory_mb(pid)
            p = self.peak[k]
            for f in m:
                p[f] = max(p[f], m[f])

    def stop(self):
        self.stop_ev.set()
        self.join()
        self.sample()
        return self.peak


# ------------------------------------------------------------------ statistics

def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def med(xs):
    return pct(xs, 50)


def paired(samples: dict[str, list], base: str = "direct", ratio: bool = False) -> dict:
    """Median of per-round differences (or ratios) to the base path."""
    out = {}
    for k, v in samples.items():
        pairs = [(a, b) for a, b in zip(v, samples[base]) if a is not None and b]
        if not pairs:
            out[k] = None
        elif ratio:
            out[k] = med([a / b for a, b in pairs])
        else:
            out[k] = med([a - b for a, b in pairs])
    return out


def rotations(names: list[str], rounds: int):
    for i in range(rounds):
        j = i % len(names)
        yield names[j:] + names[:j]


# ------------------------------------------------------------------ workloads

def chat(model: str, max_tokens: int, stream: bool, prompt: str = "Say hi.", **extra) -> dict:
    # n_predict too: llama-server takes it before max_tokens, so every path
    # generates the same tokens although the stack's default web_search tool
    # raises max_tokens to the tool floor (TOOL_MAX_TOKENS_FLOOR).
    return {"model": model, "messages": [SYSTEM, {"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "n_predict": max_tokens, "temperature": 0,
            "stream": stream, **extra}


def auth_headers_ok(status: int, what: str, body: bytes = b""):
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status}: {body[:300]!r}")


def real_workloads(paths: dict[str, str], leaders: dict[str, dict[str, int]], a) -> dict:
    names = list(paths)
    sessions = {k: client.Session(u) for k, u in paths.items()}
    one = chat("llama", 1, False)
    ttft_body = chat("llama", 4, True)
    decode_body = chat("llama", a.decode_tokens, True, prompt="Write a long story about a "
                       "lighthouse keeper and the sea.", ignore_eos=True)

    def nonstream(k):
        time.sleep(a.gap)
        st, out, dt = sessions[k].post("/v1/chat/completions", one)
        auth_headers_ok(st, f"{k} non-stream", out)
        return dt

    def ttft(k):
        time.sleep(a.gap)
        r = client.stream(paths[k], ttft_body, keep_times=True)
        auth_headers_ok(r["status"], f"{k} stream")
        return r["first_content"]

    def decode(k):
        time.sleep(a.gap)
        before = cpu_of(leaders[k])
        r = client.stream(paths[k], decode_body, keep_times=True)
        after = cpu_of(leaders[k])
        auth_headers_ok(r["status"], f"{k} decode")
        t = r["content_times"]
        for svc in before:
            cpu[k].setdefault(svc, []).append((after[svc] - before[svc]) / max(len(t), 1) * 1e3)
        if len(t) < 2:
            return None, r["first_content"], len(t)
        return (len(t) - 1) / (t[-1] - t[0]), r["first_content"], len(t)

    for order in rotations(names, a.warmup):             # caches, pools, prompt cache
        for k in order:
            nonstream(k)
            ttft(k)
    lat = {k: [] for k in names}
    first = {k: [] for k in names}
    for order in rotations(names, a.rounds):
        for k in order:
            lat[k].append(nonstream(k))
        for k in order:
            first[k].append(ttft(k))
    rate = {k: [] for k in names}
    cpu: dict[str, dict[str, list]] = {k: {} for k in names}      # ms of CPU per token
    dfirst = {k: [] for k in names}
    tokens = {k: [] for k in names}
    for order in rotations(names, a.decode_rounds):
        for k in order:
            r, f, n = decode(k)
            rate[k].append(r)
            dfirst[k].append(f)
            tokens[k].append(n)
    for s in sessions.values():
        s.close()
    return {"nonstream_s": lat, "ttft_s": first, "decode_tok_s": rate,
            "decode_ttft_s": dfirst, "decode_tokens": tokens, "decode_cpu_ms_per_token": cpu,
            "nonstream_added_s": paired(lat), "ttft_added_s": paired(first),
            "decode_ratio": paired(rate, ratio=True)}


def agent_body(kb: int) -> dict:
    """A coding agent's request of about `kb` KB, shaped like one: a long system
    prompt, 30 tool schemas, and turns of code, tool calls and tool output."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Reads, edits or runs something. " * 12,
        "parameters": {"type": "object", "required": ["path"], "properties": {
            f"arg{j}": {"type": "string", "description": "what it means " * 4}
            for j in range(8)}}}} for i in range(30)]
    turns = [{"role": "system", "content": "You are a coding agent. " * 200}]
    size, i = len(json.dumps(tools)) + 4800, 0
    while size < kb * 1024:
        call = {"id": f"call_{i}", "type": "function", "function": {
            "name": "tool_1", "arguments": json.dumps({"path": f"src/mod_{i}.py"})}}
        turns += [{"role": "user", "content": [{"type": "text",
                                                "text": "def f(x):\n    return x\n" * 20}]},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": f"call_{i}",
                   "content": "    line of the file\n" * 40}]
        size, i = size + 1900, i + 1
    turns.append({"role": "user", "content": "Say hi."})
    return {**chat("synth", 1, False), "messages": turns, "tools": tools}


def hop(paths: dict[str, str], leaders: dict[str, dict[str, int]], a) -> dict:
    """What each hop adds to a non-streaming request when the backend answers at
    once (the synthetic backend): wall time added (paired, rotated) and CPU ms
    per request of each service, for a tiny body and an agent-sized one."""
    names = list(paths)
    sessions = {k: client.Session(u) for k, u in paths.items()}
    bodies = {"tiny": chat("synth", 1, False),
              f"{a.hop_kb}kb": agent_body(a.hop_kb)}
    out = {}
    for label, body in bodies.items():
        lat = {k: [] for k in names}
        cpu: dict[str, dict[str, float]] = {k: {} for k in names}
        for order in rotations(names, a.warmup):
            for k in order:
                sessions[k].post("/v1/chat/completions", body)
        for order in rotations(names, a.hop_rounds):
            for k in order:
                before = cpu_of(leaders[k])
                st, resp, dt = sessions[k].post("/v1/chat/completions", body)
                after = cpu_of(leaders[k])
                auth_headers_ok(st, f"{k} hop {label}", resp)
                lat[k].append(dt)
                for svc in before:
                    cpu[k][svc] = cpu[k].get(svc, 0.0) + after[svc] - before[svc]
        out[label] = {"latency_s": lat, "added_s": paired(lat),
                      "cpu_ms_per_request": {k: {svc: t / a.hop_rounds * 1e3
                                                 for svc, t in v.items()}
                                             for k, v in cpu.items()}}
    for s in sessions.values():
        s.close()
    return out


def synth_throughput(paths: dict[str, str], leaders: dict[str, dict[str, int]], a) -> dict:
    """One unpaced stream of a.chunks chunks per path per round."""
    names = list(paths)
    body = chat("synth", a.chunks, True)
    rate = {k: [] for k in names}
    cpu = {k: {} for k in names}
    short: dict[str, list[int]] = {}                   # streams that ended early
    for order in rotations(names, 1):                   # warm-up
        for k in order:
            client.stream(paths[k], chat("synth", 2000, True))
    for order in rotations(names, a.synth_rounds):
        for k in order:
            before = cpu_of(leaders[k])
            r = client.stream(paths[k], body)
            after = cpu_of(leaders[k])
            auth_headers_ok(r["status"], f"{k} synth stream")
            if r["events"] < a.chunks:
                short.setdefault(k, []).append(r["events"])
            rate[k].append(r["events"] / r["last_event"])
            for svc in leaders[k]:
                cpu[k].setdefault(svc, []).append((after[svc] - before[svc]) / r["events"] * 1000)
    return {"chunks_per_s": rate, "chunks_ratio": paired(rate, ratio=True),
            "cpu_s_per_1000_chunks": cpu, "short_streams": short}


def synth_concurrency(paths: dict[str, str], leaders_all: dict[str, int], a) -> dict:
    names = list(paths)
    out = {}
    body = chat("synth", a.conc_chunks, True, perf_interval_ms=a.conc_interval_ms)
    expect = a.conc_chunks + 2
    for c in a.concurrency:
        out[c] = {}
        j = a.concurrency.index(c) % len(names)        # one pass; the order rotates by level
        order = names[j:] + names[:j]
        for k in order:
            sampler = MemorySampler(leaders_all)
            sampler.start()

            async def run():
                return await asyncio.gather(*(client.astream(paths[k], body, expect)
                                              for _ in range(c)))
            t0 = time.perf_counter()
            res = asyncio.run(run())
            wall = time.perf_counter() - t0
            peak = sampler.stop()
            errors = [r["error"] for r in res if r["error"]]
            ttfts = [r["ttft"] for r in res if r["ttft"] is not None]
            out[c][k] = {"errors": len(errors), "error_kinds": sorted(set(errors))[:5],
                         "ttft_p50_s": med(ttfts), "ttft_p99_s": pct(ttfts, 99),
                         "chunks_per_s": sum(r["events"] for r in res) / wall,
                         "wall_s": wall, "memory": peak}
            time.sleep(0.5)
    return out


def first_token(url: str, model: str) -> float:
    r = client.stream(url, chat(model, 1, True), keep_times=True)
    auth_headers_ok(r["status"], f"{model} first token")
    return r["first_content"] if r["first_content"] is not None else r["first_event"]


def direct_cold_start(dclient, model_id: str, env: dict) -> tuple[float, float]:
    """(L, F): the model's container started by hand, health polled every 10 ms
    until 200; then its first token."""
    port = free_port()
    stack = f"perf-direct-{port}"
    settings = SwapperSettings.from_env({**env, "STACK_NAME": stack,
                                         "BACKEND_PUBLISH_PORT": str(port),
                                         "BACKENDS_DIR": str(PERF_BACKENDS)})
    registry = Registry.load(settings.BACKENDS_DIR, settings.env)
    rt = DockerRuntime(settings, registry, dclient)
    spec = registry.models[model_id]
    url = f"http://127.0.0.1:{port}"
    http = requests.Session()
    http.trust_env = False
    t0 = time.perf_counter()
    dclient.containers.run(detach=True, **rt._create_args(spec, f"{stack}-{model_id}"))
    try:
        while True:
            try:
                if http.get(url + spec.health_path, timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.01)
        load = time.perf_counter() - t0
        return load, first_token(url, model_id)
    finally:
        reap(dclient, stack)


def swap(sw: SwapperProcess, env: dict, a) -> dict:
    dclient = docker.from_env()
    T, L, F, O, measured = [], [], [], [], []
    for _ in range(a.swap_runs):
        requests.post(sw.url + "/unload", timeout=60).raise_for_status()
        load, ftt = direct_cold_start(dclient, "beta", env)
        requests.post(sw.url + "/load/alpha", timeout=300).raise_for_status()
        first_token(sw.url, "alpha")
        t = first_token(sw.url, "beta")
        T.append(t)
        L.append(load)
        F.append(ftt)
        O.append(t - load - ftt)
        measured.append(requests.get(sw.url + "/running", timeout=10).json()["last_load_seconds"])
    return {"client_swap_to_first_token_s": T, "beta_cold_start_to_healthy_s": L,
            "beta_first_token_s": F, "overhead_s": O, "swapper_last_load_s": measured}


def health_lag(sw: SwapperProcess, a) -> dict:
    req, byte = [], []
    http = requests.Session()
    http.trust_env = False
    for _ in range(a.health_runs):
        requests.post(sw.url + "/unload", timeout=60).raise_for_status()
        t0 = time.time()
        r = client.stream(sw.url, chat("synth-late", 1, True))
        auth_headers_ok(r["status"], "synth-late")
        first_byte_at = t0 + r["first_event"]          # wall clock, like the stamps
        stamps = http.get(sw.backend_url + "/perf/stamps", timeout=5).json()
        req.append(stamps["first_request"] - stamps["ready_at"])
        byte.append(first_byte_at - stamps["ready_at"])
    return {"ready_to_request_forwarded_s": req, "ready_to_first_byte_s": byte}


# -------------------------------------------------------------------- report

def fmt(x, scale=1.0, nd=1, sign=False):
    if x is None:
        return "—"
    return f"{x * scale:+.{nd}f}" if sign else f"{x * scale:.{nd}f}"


def report(res: dict) -> str:
    lines = []
    add = lines.append
    if "real" in res:
        r = res["real"]
        add("### Real backend (llama-server + SmolLM2, CPU)\n")
        add("| path | 1-token non-stream ms, median (p99) | added, ms | streamed TTFT ms, "
            f"median (p99) | added, ms | {res['args']['decode_tokens']}-token decode tok/s | ratio to direct | "
            "stack CPU ms per decoded token |")
        add("|---|---|---|---|---|---|---|---|")
        for k in r["nonstream_s"]:
            ns, tt, dr = r["nonstream_s"][k], r["ttft_s"][k], r["decode_tok_s"][k]
            add(f"| {k} | {fmt(med(ns), 1e3)} ({fmt(pct(ns, 99), 1e3)}) | "
                f"{fmt(r['nonstream_added_s'][k], 1e3, sign=True)} | "
                f"{fmt(med(tt), 1e3)} ({fmt(pct(tt, 99), 1e3)}) | "
                f"{fmt(r['ttft_added_s'][k], 1e3, sign=True)} | {fmt(med(dr))} | "
                f"{fmt(r['decode_ratio'][k], nd=3)} | "
                + (", ".join(f"{svc} {med(x):.3f}" for svc, x in
                             r["decode_cpu_ms_per_token"][k].items()) or "—") + " |")
        add("")
    if "hop" in res:
        add("### What a hop adds: non-streaming requests to the synthetic backend "
            "(answers at once)\n")
        add("| body | path | ms, median (p99) | added, ms | CPU ms per request |")
        add("|---|---|---|---|---|")
        for label, h in res["hop"].items():
            for k, v in h["latency_s"].items():
                cpus = ", ".join(f"{svc} {x:.2f}" for svc, x in
                                 h["cpu_ms_per_request"][k].items()) or "—"
                add(f"| {label} | {k} | {fmt(med(v), 1e3, 2)} ({fmt(pct(v, 99), 1e3, 2)}) | "
                    f"{fmt(h['added_s'][k], 1e3, 2, sign=True)} | {cpus} |")
        add("")
    if "synth" in res:
        s = res["synth"]
        add("### Synthetic fast SSE backend: one unpaced stream\n")
        add("| path | chunks/s, median (min) | ratio to direct | CPU s / 1,000 chunks |")
        add("|---|---|---|---|")
        for k, v in s["chunks_per_s"].items():
            cpu = s["cpu_s_per_1000_chunks"][k]
            cpus = ", ".join(f"{svc} {med(x):.3f}" for svc, x in cpu.items()) or "—"
            add(f"| {k} | {fmt(med(v), nd=0)} ({fmt(min(v), nd=0)}) | "
                f"{fmt(s['chunks_ratio'][k], nd=3)} | {cpus} |")
        add("")
    if "concurrency" in res:
        c = res["concurrency"]
        add(f"### Concurrent paced streams (synthetic, {res['args']['conc_chunks']} chunks at "
            f"{res['args']['conc_interval_ms']} ms each)\n")
        add("| clients | path | errors | TTFT p50 ms | TTFT p99 ms | aggregate chunks/s | "
            "memory MB (PSS of all its processes; largest RSS) |")
        add("|---|---|---|---|---|---|---|")
        for level, per in c.items():
            for k, v in per.items():
                mem = ", ".join(f"{svc} {m['pss_mb']:.0f}; {m['rss_max_mb']:.0f}"
                                for svc, m in v["memory"].items())
                err = str(v["errors"]) + (f" ({'; '.join(v['error_kinds'])})" if v["errors"] else "")
                add(f"| {level} | {k} | {err} | {fmt(v['ttft_p50_s'], 1e3)} | "
                    f"{fmt(v['ttft_p99_s'], 1e3)} | {fmt(v['chunks_per_s'], nd=0)} | {mem} |")
        add("")
    if "swap" in res:
        w = res["swap"]
        add("### Swap alpha -> beta (real llama-server containers), medians of runs\n")
        add("| client-seen swap to first token | beta's own start to healthy | beta's first token "
            "| overhead (per-run T - L - F) | p99 | swapper's own load time |")
        add("|---|---|---|---|---|---|")
        add(f"| {fmt(med(w['client_swap_to_first_token_s']), 1e3, 0)} ms | "
            f"{fmt(med(w['beta_cold_start_to_healthy_s']), 1e3, 0)} ms | "
            f"{fmt(med(w['beta_first_token_s']), 1e3, 0)} ms | "
            f"**{fmt(med(w['overhead_s']), 1e3, 0)} ms** | {fmt(pct(w['overhead_s'], 99), 1e3, 0)} ms | "
            f"{fmt(med(w['swapper_last_load_s']), 1e3, 0)} ms |")
        add("")
    if "health" in res:
        h = res["health"]
        add("### Health detection lag (backend turns healthy -> ...), medians of runs\n")
        add("| request forwarded to it, median (p99) | first byte at the client, median (p99) |")
        add("|---|---|")
        add(f"| {fmt(med(h['ready_to_request_forwarded_s']), 1e3)} "
            f"({fmt(pct(h['ready_to_request_forwarded_s'], 99), 1e3)}) ms | "
            f"{fmt(med(h['ready_to_first_byte_s']), 1e3)} "
            f"({fmt(pct(h['ready_to_first_byte_s'], 99), 1e3)}) ms |")
        add("")
    return "\n".join(lines)


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


# ---------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="real,hop,synth,concurrency,swap,health",
                    help="comma-separated workloads")
    ap.add_argument("--paths", default="direct,proxy,swapper,stack,stack-nosearch,litellm")
    ap.add_argument("--litellm", default=os.environ.get("PERF_LITELLM", ""),
                    help="the litellm binary (run.sh installs it in its own venv)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=100,
                    help="rounds of 1-token requests (fewer: medians move by a millisecond)")
    ap.add_argument("--gap", type=float, default=0.1,
                    help="seconds between real-backend requests (llama-server closes a "
                         "connection after a stream a moment later than it says)")
    ap.add_argument("--decode-rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--hop-rounds", type=int, default=300,
                    help="rounds of non-streaming requests to the synthetic backend")
    ap.add_argument("--hop-kb", type=int, default=150, help="size of the agent-sized body")
    ap.add_argument("--chunks", type=int, default=20000, help="chunks of the unpaced stream")
    ap.add_argument("--synth-rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--conc-chunks", type=int, default=100)
    ap.add_argument("--conc-interval-ms", type=float, default=20.0)
    ap.add_argument("--swap-runs", type=int, default=5)
    ap.add_argument("--health-runs", type=int, default=5)
    ap.add_argument("--profile", default="",
                    help="py-spy binary: record the proxy and swapper workers during the "
                         "hop and synthetic stream workloads (raw folded stacks next to "
                         "the JSON)")
    ap.add_argument("--out", default=os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    a = ap.parse_args()
    # SIGTERM (timeout, Ctrl-C from a wrapper) unwinds: services stopped, containers reaped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x]
    only = set(a.only.split(","))
    wanted = a.paths.split(",")
    if "litellm" in wanted and not a.litellm:
        wanted.remove("litellm")
        print("no --litellm binary: the LiteLLM path is left out", file=sys.stderr)

    env = {**os.environ, **load_testbed_env()}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    res: dict = {"started": stamp, "machine": machine(), "args": vars(a)}
    t_start = time.monotonic()

    def log(msg):
        print(f"[perf {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)
        res.setdefault("phases", {})[msg] = round(time.monotonic() - t_start, 1)

    with SwapperProcess(backends_dir=PERF_BACKENDS, PERF_DIR=str(PERF_DIR), MAX_QUEUE=4096,
                        LOG_LEVEL="WARNING") as sw:
        procs: dict[str, ServiceProcess] = {"swapper": sw}
        try:
            if "proxy" in wanted:
                procs["proxy"] = ProxyProcess(BACKEND_URL=sw.backend_url, LOG_LEVEL="WARNING").start()
            if "stack" in wanted:
                procs["stack"] = ProxyProcess(BACKEND_URL=sw.url, LOG_LEVEL="WARNING").start()
            if "stack-nosearch" in wanted:
                procs["stack-nosearch"] = ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="0",
                                                       LOG_LEVEL="WARNING").start()
            if "litellm" in wanted:
                log("starting LiteLLM (it takes a while)")
                procs["litellm"] = LiteLLMProcess(a.litellm, sw.backend_url,
                                                  ["llama", "synth"]).start()
            paths = {"direct": sw.backend_url}
            for k in wanted:
                if k != "direct":
                    paths[k] = procs[k].url
            pid = {k: p.proc.pid for k, p in procs.items()}
            # whose CPU each path spends (besides the backend's)
            leaders = {"direct": {}, "proxy": {"proxy": pid.get("proxy")},
                       "swapper": {"swapper": pid["swapper"]},
                       "stack": {"proxy": pid.get("stack"), "swapper": pid["swapper"]},
                       "stack-nosearch": {"proxy": pid.get("stack-nosearch"),
                                          "swapper": pid["swapper"]},
                       "litellm": {"litellm": pid.get("litellm")}}
            leaders = {k: leaders[k] for k in paths}

            if "real" in only:
                log("loading llama (real llama-server)")
                requests.post(sw.url + "/load/llama", timeout=300).raise_for_status()
                log("real workloads")
                res["real"] = real_workloads(paths, leaders, a)
            if only & {"hop", "synth", "concurrency"}:
                log("loading synth")
                requests.post(sw.url + "/load/synth", timeout=300).raise_for_status()
                profilers = []
                if a.profile:
                    for svc in [k for k in procs if k != "litellm"]:
                        workers = [p for p in group_pids(pid[svc]) if p != pid[svc]]
                        for w in workers:
                            f = out_dir / f"profile-{stamp}-{svc}-{w}.txt"
                            profilers.append(subprocess.Popen(
                                [a.profile, "record", "-p", str(w), "-r", "200", "-f", "raw",
                                 "-o", str(f), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    time.sleep(1)
                if "hop" in only:
                    log("hop costs (non-streaming, synthetic backend)")
                    res["hop"] = hop(paths, leaders, a)
                if "synth" in only:
                    log("synthetic stream throughput")
                    res["synth"] = synth_throughput(paths, leaders, a)
                for p in profilers:
                    p.send_signal(2)
                    p.wait(30)
                if "concurrency" in only:
                    log("concurrency")
                    services = {k: pid[k] for k in procs}
                    res["concurrency"] = synth_concurrency(paths, services, a)
            if "swap" in only:
                log("swap alpha -> beta")
                res["swap"] = swap(sw, env, a)
            if "health" in only:
                log("health detection lag")
                res["health"] = health_lag(sw, a)
        finally:
            for k, p in procs.items():
                if k != "swapper":
                    p.stop()
            (out_dir / f"perf-{stamp}.json").write_text(json.dumps(res, indent=1, default=str))
    res["seconds"] = round(time.monotonic() - t_start, 1)
    res["machine"]["loadavg_end"] = os.getloadavg()
    path = out_dir / f"perf-{stamp}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    table = report(res)
    (out_dir / f"perf-{stamp}.md").write_text(table + "\n")
    print(table)
    print(f"\n{res['seconds']:.0f} s; machine {res['machine']}; JSON: {path}")


if __name__ == "__main__":
    main()
