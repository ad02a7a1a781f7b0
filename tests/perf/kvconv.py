"""Every conversation's prompt cache across swaps, measured (issue 33). On demand
(tests/perf/run.sh kvconv), not part of pytest; the figures are in docs/kv-cache.md.

    .venv/bin/python -m tests.perf.kvconv [--parts table,agents] [--words 240]
                                          [--json FILE]

table   the issue's four scenarios, with KV_CACHE_CONVERSATIONS=1 (what a swap kept
        before: the slot's last conversation) and =8 (the default), each on its own
        real swapper (KV_CACHE_DIR set, real Docker, the test bed's llama-server +
        SmolLM2 at -c 16384, one slot, --cache-ram at its default): conversations
        A, C and E of ~3,000 tokens each that differ from their first word; a warm
        turn of A within the stint; a side call in A's session last; a swap to
        another model and back, then A, C and E's next turns; a second swap and back,
        then E, C and A. Per turn: the prompt's tokens processed and reused and
        llama-server's prompt_ms (timings), against the warm in-stint turn; per swap
        the save's seconds, bytes and prompts (the swapper's /running last_swap).
agents  the real agents' own request bodies (Claude Code 2.1.197 and Codex 0.171.0,
        captured from the CLIs: tests/fixtures/templates, the official Qwen 3.5 chat
        template) through the real proxy and swapper, on one model (-c 32768): Claude
        Code's first two turns, Codex's first two, then a Claude Code side call (its
        billing header, a title prompt of its own, the haiku tier, which the stack
        serves on the resident model) last; a swap away and back; each agent's third
        turn: what its first answer reused (the swapper's `reused` event).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from tests.perf.kvswap import Events
from tests.support import agents as captured_agents
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import FIXTURE_BACKENDS, SwapperProcess

WORDS = ["colour", "weight", "size", "price", "origin", "age", "owner", "shape"]
SYSTEM = "You are a careful coding agent. Answer in one word."
MODELS = """
models:
  conv-a:
    kind: llamacpp
    image: ${TESTBED_LLAMACPP_IMAGE}
    volumes: ["${TESTBED_MODELS_DIR}:/models:ro"%(templates)s]
    args: [-m, "/models/${TESTBED_MODEL_FILE}", -c, "%(ctx)d", --override-kv,
           "llama.context_length=int:%(ctx)d", -fa, "on", --parallel, "1", -t, "2"%(template)s]
    slots: 1
    start_timeout: 180
    stop_timeout: 5
  conv-b:
    kind: llamacpp
    image: ${TESTBED_LLAMACPP_IMAGE}
    volumes: ["${TESTBED_MODELS_DIR}:/models:ro"]
    args: [-m, "/models/${TESTBED_MODEL_FILE}", -c, "512", --parallel, "1", -t, "2",
           --no-warmup]
    slots: 1
    start_timeout: 120
    stop_timeout: 5
"""


def log(msg: str) -> None:
    print(f"[kvconv {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def registry(tmp: Path, ctx: int, template: bool) -> Path:
    (tmp / "models").mkdir(parents=True)
    shutil.copytree(FIXTURE_BACKENDS / "kinds", tmp / "kinds")
    (tmp / "models" / "conv.yaml").write_text(MODELS % {
        "ctx": ctx,
        "templates": ', "${AGENTS_TEMPLATES_DIR}:/templates:ro"' if template else "",
        "template": ", --jinja, --chat-template-file, /templates/Qwen3.5-4B.jinja"
        if template else ""})
    return tmp


def swap_away(url: str) -> None:
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "model": "conv-b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]})
    r.raise_for_status()


def last_swap(url: str) -> dict:
    return requests.get(url + "/running", timeout=10).json()["swaps"]["last_swap"] or {}


# ------------------------------------------------------------------ table

def task(name: str, n: int) -> str:
    return f"{name} asks you to remember: " + " ".join(
        f"Item {i} of {name} has {WORDS[i % len(WORDS)]} {(i * 7 + len(name)) % 13}."
        for i in range(n))


class Chat:
    def __init__(self, name: str, words: int, system: str = SYSTEM):
        self.name = name
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": task(name, words)}]

    def turn(self, url: str) -> dict:
        r = requests.post(url + "/v1/chat/completions", timeout=1800, json={
            "model": "conv-a", "max_tokens": 3, "temperature": 0, "messages": self.messages})
        r.raise_for_status()
        body = r.json()
        self.messages += [{"role": "assistant",
                           "content": body["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "Go on."}]
        t = body["timings"]
        return {"turn": self.name, "processed": t["prompt_n"], "reused": t["cache_n"],
                "prompt_ms": round(t["prompt_ms"], 1)}


def table(conversations: int, words: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvconv-"))
    kv = tmp / "kv"
    kv.mkdir()
    os.chmod(kv, 0o777)
    out: dict = {"KV_CACHE_CONVERSATIONS": conversations, "load_before": os.getloadavg()}
    try:
        with SwapperProcess(backends_dir=registry(tmp / "backends", 16384, False),
                            KV_CACHE_DIR=str(kv), LOG_LEVEL="WARNING",
                            KV_CACHE_CONVERSATIONS=str(conversations),
                            KV_CACHE_SAVE_TIMEOUT="120", KV_CACHE_RESTORE_TIMEOUT="120") as sw:
            a, c, e = (Chat(n, words) for n in ("Alice", "Carol", "Erin"))
            side = Chat("Alice", 20, system="Write a five-word title for this conversation.")
            out["cold"] = [x.turn(sw.url) for x in (a, c, e)]
            log(f"[{conversations}] cold: {out['cold']}")
            out["warm"] = [a.turn(sw.url), c.turn(sw.url)]      # the RAM cache, in-stint
            out["side"] = side.turn(sw.url)
            log(f"[{conversations}] warm: {out['warm']} side: {out['side']}")
            out["rounds"] = []
            for order in ((a, c, e), (e, c, a)):
                swap_away(sw.url)
                away = last_swap(sw.url)
                turns = [x.turn(sw.url) for x in order]
                back = last_swap(sw.url)
                # the same conversations again within the stint (llama-server's RAM
                # cache), seconds later: each turn's warm pair under the same load
                warm = [x.turn(sw.url) for x in order]
                out["rounds"].append({"saved": away.get("saved"), "turns": turns, "warm": warm,
                                      "phases": back.get("phases"),
                                      "restored": back.get("restored")})
                log(f"[{conversations}] after a swap back: {out['rounds'][-1]}")
            requests.post(sw.url + "/unload", timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    return out


def report_table(runs: list[dict]) -> str:
    lines = ["| KV_CACHE_CONVERSATIONS | next turn after a swap-back | processed / prompt | "
             "prompt_ms | its warm pair's prompt_ms (processed) |",
             "|---|---|---|---|---|"]
    for run in runs:
        for i, rnd in enumerate(run["rounds"]):
            for t, w in zip(rnd["turns"], rnd["warm"]):
                total = t["processed"] + t["reused"]
                lines.append(f"| {run['KV_CACHE_CONVERSATIONS']} | round {i + 1}: {t['turn']} "
                             f"| {t['processed']:,} / {total:,} ({t['processed'] / total:.1%}) "
                             f"| {t['prompt_ms']:,.0f} | {w['prompt_ms']:,.0f} "
                             f"({w['processed']}) |")
        ratios = [t["prompt_ms"] / w["prompt_ms"] for rnd in run["rounds"]
                  for t, w in zip(rnd["turns"], rnd["warm"])]
        lines.append(f"| {run['KV_CACHE_CONVERSATIONS']} | median ratio to the warm pair | | "
                     f"{statistics.median(ratios):.2f}x | |")
    for run in runs:
        for i, rnd in enumerate(run["rounds"]):
            s = rnd["saved"] or {}
            lines.append(f"\nKV_CACHE_CONVERSATIONS={run['KV_CACHE_CONVERSATIONS']}, swap "
                         f"{i + 1}: saved {s.get('prompts')} prompts, {s.get('bytes', 0) / 1e6:.1f}"
                         f" MB in {s.get('seconds')} s; phases back {rnd['phases']}")
    return "\n".join(lines)


# ------------------------------------------------------------------ agents

CAPS = {"claude": ("/v1/messages", "max_tokens"), "codex": ("/v1/responses",
                                                              "max_output_tokens")}


def send(proxy: str, agent: str, body: dict, cap: int = 8) -> float:
    b = copy.deepcopy(body)
    b.update({"stream": True, CAPS[agent][1]: cap, "temperature": 0, "model": "conv-a"})
    t0 = time.monotonic()
    with requests.post(proxy + CAPS[agent][0], json=b, stream=True, timeout=3600,
                       headers={"authorization": "Bearer x", "x-api-key": "x"}) as r:
        r.raise_for_status()
        for _ in r.iter_content(None):
            pass
    return round(time.monotonic() - t0, 2)


def side_call(first: dict) -> dict:
    """A Claude Code side call: its billing header, a system prompt of its own, the
    session's first prompt, no tools, the haiku tier."""
    header = first["system"][0]
    user = first["messages"][0]
    return {"model": "claude-haiku-4-5", "max_tokens": 32,
            "system": [header, {"type": "text", "text": "Write a 3-7 word title for the "
                                "coding task below. Reply with the title only."}],
            "messages": [user], "metadata": first.get("metadata", {})}


def agents(turns: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvconv-agents-"))
    kv = tmp / "kv"
    kv.mkdir()
    os.chmod(kv, 0o777)
    claude = captured_agents.captured("claude")[0]
    codex = captured_agents.captured("codex")[0]
    out: dict = {"load_before": os.getloadavg(), "turns": []}
    try:
        with SwapperProcess(backends_dir=registry(tmp / "backends", 32768, True),
                            KV_CACHE_DIR=str(kv), LOG_LEVEL="WARNING",
                            AGENTS_TEMPLATES_DIR=str(captured_agents.TEMPLATES),
                            KV_CACHE_SAVE_TIMEOUT="300", KV_CACHE_RESTORE_TIMEOUT="300") as sw, \
                ProxyProcess(BACKEND_URL=sw.url, LOG_LEVEL="WARNING",
                             TOOL_MAX_TOKENS_FLOOR="0") as proxy:
            ev = Events(sw.url)
            for agent, session in (("claude", claude), ("codex", codex)):
                for i in range(turns):
                    s = send(proxy.url, agent, session[i])
                    out["turns"].append({"agent": agent, "turn": i + 1, "seconds": s})
                    log(f"{agent} turn {i + 1}: {s} s")
            s = send(proxy.url, "claude", side_call(claude[0]), cap=16)
            out["turns"].append({"agent": "claude", "turn": "side call", "seconds": s})
            log(f"claude side call: {s} s")
            swap_away(sw.url)
            out["saved"] = last_swap(sw.url).get("saved")
            log(f"swapped away: saved {out['saved']}")
            mark = len(ev.items)
            for agent, session in (("codex", codex), ("claude", claude)):
                s = send(proxy.url, agent, session[turns])
                time.sleep(0.5)
                reused = [e for e in ev.items[mark:] if e.get("event") == "reused"]
                out["turns"].append({"agent": agent, "turn": turns + 1, "seconds": s,
                                     "after_swap_back": True,
                                     "reused": reused[-1] if reused else None})
                mark = len(ev.items)
                log(f"{agent} turn {turns + 1} after the swap back: {out['turns'][-1]}")
            out["swap_back"] = last_swap(sw.url)
            ev.close()
            requests.post(sw.url + "/unload", timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="table,agents")
    ap.add_argument("--words", type=int, default=240, help="items per conversation (~12 tokens each)")
    ap.add_argument("--turns", type=int, default=2, help="agent turns before the swap")
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict = {}
    parts = args.parts.split(",")
    if "table" in parts:
        res["table"] = [table(n, args.words) for n in (1, 8)]
        print(report_table(res["table"]), flush=True)
    if "agents" in parts:
        res["agents"] = agents(args.turns)
        print(json.dumps(res["agents"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
