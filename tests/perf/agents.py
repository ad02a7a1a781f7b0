"""Agent turns measured: real Claude Code 2.1.197 and Codex 0.171.0 sessions replayed
direct to llama-server and through the stack (proxy -> swapper -> the same backend),
with the official Qwen 3.5 chat template. On demand (tests/perf/run.sh agents), not
part of pytest.

    .venv/bin/python -m tests.perf.agents [--agents claude,codex] [--turns N]
                                          [--repeats R] [--json FILE]

Inputs: the request bodies the real CLIs sent (tests/fixtures/templates/*.json, rebuilt
by tests.support.agents.captured()): per agent a session "A" of six turns (a prompt
answered with two tool calls and a final answer, then a new user prompt in the same
session, again two tool calls) and a session "B" of three turns (another first prompt,
for Claude Code another billing header). Turn N+1 is turn N's history + the answer
(reasoning, a tool call) + the tool result, as the agent sent it. Only the generation
is capped (max_tokens / max_output_tokens and llama-server's n_predict = --max-tokens,
temperature 0): nothing of what reaches the template is changed.

Backend: the test bed's llama-server + SmolLM2 in a container the swapper starts
(tests/perf/agents_backends: --jinja --chat-template-file Qwen3.5-4B.jinja, -c 32768
--override-kv llama.context_length=int:32768, -fa on, --parallel 1, --cache-ram 0).

Paths, all to that one backend (one slot = one prompt cache):
  direct raw    the agent's body to llama-server's /v1/messages or /v1/responses
                (status only: the template refuses the late system message with 500)
  direct        the body after proxy.agents.fix (what the proxy does first), same URL
  stack         the agent's raw body to the proxy (default settings but
                TOOL_MAX_TOKENS_FLOOR=0: see main) -> swapper

Each path replays all sessions from an erased slot (A1..A6 then B1..B3, so B1 meets
A6's cache), and the paths take turns: turn N on one path, then turn N on the other
(the order alternating per turn and per repeat), each path's slot saved after its turn
and restored before its next one (llama-server's /slots save/restore, not timed), so the
two halves of a pair run seconds apart, not a session apart: machine noise (other
processes taking the two cores) falls on both. Per turn: HTTP status, prompt tokens,
tokens reused from the cache and processed (llama-server's own counters: /metrics
prompt_tokens_total and /slots, checked against the answer's usage), TTFT (time to the
first event carrying a generated token), the backend's own prefill seconds
(/metrics prompt_seconds_total), so TTFT outside the prefill, which is all the stack
can add (the backend computes the same prompt either way), and total time. Targets
(issue 21) are checked and printed; nothing is asserted.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from proxy.agents import fix
from proxy.dialects import BY_NAME
from tests.perf import client
from tests.support import agents as captured_agents
from tests.support.process import REPO
from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import SwapperProcess

BACKENDS = REPO / "tests" / "perf" / "agents_backends"
MODEL = "smollm2-qwen35"
AGENTS = {  # dialect for fix(), backend path, list key, the token cap's key
    "claude": ("messages", "/v1/messages", "messages", "max_tokens"),
    "codex": ("responses", "/v1/responses", "input", "max_output_tokens"),
}
NAMES = {"claude": "Claude Code 2.1.197", "codex": "Codex 0.171.0"}
TTFT_TOLERANCE = 0.05


# ------------------------------------------------------------------- bodies

def kind_of(agent: str, si: int, ti: int, body: dict) -> str:
    if ti == 0:
        return "first prompt" if si == 0 else "new session"
    last = body[AGENTS[agent][2]][-1]
    c = last.get("content")
    if last.get("type") == "function_call_output" or (
            isinstance(c, list) and any(isinstance(b, dict) and b.get("type") == "tool_result"
                                        for b in c)):
        return "tool result"
    return "new prompt"


def capped(agent: str, body: dict, n: int) -> dict:
    b = copy.deepcopy(body)
    b["stream"] = True
    b[AGENTS[agent][3]] = n
    b["n_predict"] = n          # /v1/responses: llama-server takes it before max_tokens
    b["temperature"] = 0
    return b


def fixed(agent: str, body: dict) -> dict:
    b = copy.deepcopy(body)
    fix(BY_NAME[AGENTS[agent][0]], b, {})
    return b


# ------------------------------------------------------------------- HTTP

def post_stream(url: str, path: str, body: dict, timeout: float = 3600) -> dict:
    """One streamed POST on a fresh connection (llama-server closes after a stream).
    Times are relative to the request's first byte sent."""
    host, port = client._split(url)
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    events: list[tuple[float, str, dict | None]] = []
    raw_body = bytearray()
    head = dech = None
    buf = b""
    tail = b""
    comments = 0
    try:
        t0 = time.perf_counter()
        sock.sendall(client.request_bytes(host, port, path, body))
        while True:
            data = sock.recv(262144)
            now = time.perf_counter()
            if not data:
                break
            if dech is None:
                buf += data
                head = client._head(buf)
                if head is None:
                    continue
                dech = client.Dechunker(head[1])
                data = head[2]
            payload = dech.feed(data)
            if head[0] != 200:
                raw_body.extend(payload)
            else:
                joined = tail + payload
                *blocks, tail = joined.replace(b"\r\n", b"\n").split(b"\n\n")
                for blk in blocks:
                    name, datas = "", []
                    for line in blk.split(b"\n"):
                        if line.startswith(b":"):
                            comments += 1
                        elif line.startswith(b"event:"):
                            name = line[6:].strip().decode()
                        elif line.startswith(b"data:"):
                            datas.append(line[5:].strip())
                    if datas:
                        d = b"\n".join(datas)
                        try:
                            obj = json.loads(d)
                        except ValueError:
                            obj = None
                        if not name and isinstance(obj, dict):
                            name = str(obj.get("type", ""))
                        events.append((now - t0, name, obj))
            if dech.done:
                break
        total = time.perf_counter() - t0
    finally:
        sock.close()
    if head is None:
        raise ConnectionError(f"{url}{path}: no response")
    out = {"status": head[0], "total_s": total, "events": len(events), "comments": comments}
    if head[0] != 200:
        try:
            err = json.loads(bytes(raw_body))
            e = err.get("error", err)
            msg = e.get("message") if isinstance(e, dict) else str(e)
            m = re.search(r"System message must be at the beginning\.?|Jinja Exception: [^\n]*",
                          msg or "")
            out["error"] = m.group(0) if m else " ".join(str(msg).split())[:200]
        except (ValueError, AttributeError):
            out["error"] = bytes(raw_body)[:200].decode("utf-8", "replace")
        return out
    out["ttft_s"] = next((t for t, n, _ in events if is_token_event(n)), None)
    out["first_event_s"] = events[0][0] if events else None
    out["usage"] = usage_of(events)
    return out


def is_token_event(name: str) -> bool:
    """An event carrying a generated token: Messages' content_block_delta,
    Responses' *.delta (reasoning_text, output_text, function_call_arguments)."""
    return name == "content_block_delta" or (name.startswith("response.") and
                                             name.endswith(".delta"))


def usage_of(events) -> dict:
    """What the answer reports: prompt tokens, cached tokens, backend timings."""
    u: dict = {}
    for _, name, obj in events:
        if not isinstance(obj, dict):
            continue
        if name == "message_start":
            us = (obj.get("message") or {}).get("usage") or {}
            if "input_tokens" in us:
                u["cached"] = us.get("cache_read_input_tokens")
                u["input"] = us.get("input_tokens")     # Anthropic: the uncached part
                u["prompt"] = (us.get("input_tokens") or 0) + (us.get("cache_read_input_tokens") or 0)
        elif name == "message_delta":
            us = obj.get("usage") or {}
            if us.get("input_tokens") is not None:
                u["final_input"] = us.get("input_tokens")
                u["final_cached"] = us.get("cache_read_input_tokens")
        elif name == "response.completed":
            us = (obj.get("response") or {}).get("usage") or {}
            u["prompt"] = us.get("input_tokens")
            u["cached"] = (us.get("input_tokens_details") or {}).get("cached_tokens")
        if isinstance(obj.get("timings"), dict):
            u["cache_n"] = obj["timings"].get("cache_n")
            u["prompt_n"] = obj["timings"].get("prompt_n")
    return u


class Backend:
    """The backend's own counters: processed prompt tokens (/metrics) and the slot's
    token count (/slots), read around each request."""

    def __init__(self, url: str):
        self.url = url
        self.http = requests.Session()
        self.http.trust_env = False

    def metrics(self) -> dict:
        text = self.http.get(self.url + "/metrics", timeout=30).text
        out = {}
        for key in ("prompt_tokens_total", "tokens_predicted_total", "prompt_seconds_total"):
            m = re.search(rf"^llamacpp:{key} (\S+)$", text, re.M)
            out[key] = float(m.group(1)) if m else None
        for key in ("prompt_tokens_total", "tokens_predicted_total"):
            out[key] = int(out[key]) if out[key] is not None else None
        return out

    def slot(self) -> dict:
        for _ in range(600):
            s = self.http.get(self.url + "/slots", timeout=30).json()[0]
            if not s.get("is_processing"):
                return s
            time.sleep(0.05)
        return s

    def erase(self) -> None:
        r = self.http.post(self.url + "/slots/0?action=erase", timeout=60)
        r.raise_for_status()

    def keep(self, action: str, name: str) -> None:
        """Save the slot to (or restore it from) a file under --slot-save-path."""
        r = self.http.post(self.url + f"/slots/0?action={action}",
                           json={"filename": f"agents-{name}.bin"}, timeout=600)
        r.raise_for_status()

    def token_ids(self, text: str) -> list[int]:
        r = self.http.post(self.url + "/tokenize", json={"content": text}, timeout=120)
        return r.json()["tokens"]


def measured(backend: Backend, url: str, path: str, body: dict) -> dict:
    before = backend.metrics()
    r = post_stream(url, path, body)
    s = backend.slot()
    after = backend.metrics()
    processed = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    gen = after["tokens_predicted_total"] - before["tokens_predicted_total"]
    r["processed"] = processed
    r["generated"] = gen
    r["prefill_s"] = round(after["prompt_seconds_total"] - before["prompt_seconds_total"], 4)
    if r.get("ttft_s") is not None:
        r["outside_s"] = r["ttft_s"] - r["prefill_s"]
    r["slot_tokens"] = s.get("n_prompt_tokens")
    r["task"] = s.get("id_task")
    r["_text"] = s.get("prompt") if r["status"] == 200 else None   # (SLOTS_DEBUG)
    if r["status"] == 200:
        # the slot holds the prompt and the generated tokens but the last
        # (checked against the direct answer's own usage in the JSON)
        prompt = s.get("n_prompt_tokens", 0) - max(gen - 1, 0)
        r["prompt"] = prompt
        r["reused"] = prompt - processed
    return r


# ------------------------------------------------------------------- expectations

def compare(run: dict) -> None:
    """Where the stack's prompt (as the backend rendered it) parts from direct's."""
    for drows, srows in zip(run["direct"], run["stack"]):
        for d, s in zip(drows, srows):
            a, b = d.get("_text"), s.get("_text")
            if a and b and a != b:
                n = lcp(a, b)
                s["differs_at"] = n
                s["differs_snippet"] = b[max(n - 40, 0):n + 80]

def lcp(a, b) -> int:
    n, lim = 0, min(len(a), len(b))
    while n < lim and a[n] == b[n]:
        n += 1
    return n


def expectations(rows: list[dict], backend: Backend) -> None:
    """From the prompts the backend itself rendered (the slot's prompt text, with
    LLAMA_SERVER_SLOTS_DEBUG=1), per turn after the first: the tokens the template lets
    the cache give (the common token prefix with the slot's previous prompt), so
    `expected_processed`; the system+tools head (up to the first user turn). In place."""
    prev = None
    for r in rows:
        text = r.pop("_text", None)
        if not text:
            prev = None
            continue
        toks = backend.token_ids(text)
        head = text.find("<|im_start|>user")
        r["head_tokens"] = len(backend.token_ids(text[:head])) if head >= 0 else None
        if prev is not None:
            ptext, ptoks = prev
            r["common_tokens"] = lcp(ptoks, toks)
            r["prev_is_prefix"] = text.startswith(ptext)
            r["diverges_at_char"] = lcp(ptext, text)
            r["diverges_at"] = text[max(r["diverges_at_char"] - 60, 0):
                                    r["diverges_at_char"] + 40]
            r["expected_processed"] = len(toks) - r["common_tokens"]
            r["new_since_last_prompt"] = len(toks) - len(ptoks)
        if r.get("kind") == "new prompt":
            # at best only the last answer (scripted, so never in the cache) and the
            # new user message are processed
            la = text.rfind("<|im_start|>assistant", 0, text.rfind("<|im_start|>user"))
            r["ideal_processed"] = len(toks) - len(backend.token_ids(text[:la]))
        prev = (text, toks)


# ------------------------------------------------------------------- the run

def turn(label: str, agent: str, body: dict, backend: Backend, stack_url: str) -> dict:
    _, path, _, _ = AGENTS[agent]
    if label == "stack":
        return measured(backend, stack_url, path, capped(agent, body, args.max_tokens))
    before = backend.metrics()["prompt_tokens_total"]
    raw = post_stream(backend.url, path, capped(agent, body, args.max_tokens))
    raw["processed"] = backend.metrics()["prompt_tokens_total"] - before
    r = measured(backend, backend.url, path, capped(agent, fixed(agent, body), args.max_tokens))
    r["raw"] = {k: raw.get(k) for k in ("status", "error", "processed", "total_s")}
    return r


def run_paired(agent: str, sessions, backend: Backend, stack_url: str, rep: int,
               log) -> dict:
    """Both paths, turn by turn: each path's slot restored before its turn and saved
    after it (never timed), so a pair runs seconds apart."""
    run = {"direct": [], "stack": []}
    n = 0
    for si, bodies in enumerate(sessions):
        for label in run:
            run[label].append([])
        for ti, body in enumerate(bodies):
            name = f"{'AB'[si]}{ti + 1}"
            order = ["direct", "stack"] if (rep + n) % 2 == 0 else ["stack", "direct"]
            n += 1
            for label in order:
                if si == 0 and ti == 0:
                    backend.erase()
                else:
                    backend.keep("restore", label)
                r = turn(label, agent, body, backend, stack_url)
                backend.keep("save", label)
                r["turn"] = name
                r["kind"] = kind_of(agent, si, ti, body)
                log(f"{agent} {label} {name} ({r['kind']}): HTTP {r['status']}"
                    + (f" raw {r['raw']['status']}" if "raw" in r else "")
                    + f", prompt {r.get('prompt')}, reused {r.get('reused')}, processed "
                      f"{r['processed']}, TTFT {fmt_ms(r.get('ttft_s'))} ms (prefill "
                      f"{fmt_ms(r.get('prefill_s'))}), total {fmt_ms(r['total_s'])} ms"
                    + (f", error {r.get('error')}" if r.get("error") else ""))
                run[label][si].append(r)
    return run


def fmt_ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def med(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def summarise(agent: str, runs: list[dict]) -> dict:
    """Per turn: the first repeat's counts (they repeat exactly), TTFT medians over
    repeats; the targets."""
    first = runs[0]
    turns = []
    for si, rows in enumerate(first["direct"]):
        for ti, d in enumerate(rows):
            s = first["stack"][si][ti]
            td = [r["direct"][si][ti].get("ttft_s") for r in runs]
            ts = [r["stack"][si][ti].get("ttft_s") for r in runs]
            ratios = [b / a for a, b in zip(td, ts) if a and b]
            # what the stack adds: TTFT outside the backend's own prefill, stack - direct
            added = [r["stack"][si][ti]["outside_s"] - r["direct"][si][ti]["outside_s"]
                     for r in runs if "outside_s" in r["stack"][si][ti]
                     and "outside_s" in r["direct"][si][ti]]
            t = {"turn": d["turn"], "kind": d["kind"], "status_raw": d["raw"]["status"],
                 "raw_error": d["raw"].get("error"), "raw_processed": d["raw"]["processed"],
                 "status_direct": d["status"], "status_stack": s["status"],
                 "prompt_direct": d.get("prompt"), "prompt_stack": s.get("prompt"),
                 "reused_direct": d.get("reused"), "reused_stack": s.get("reused"),
                 "processed_direct": d["processed"], "processed_stack": s["processed"],
                 "reported_direct": d.get("usage"), "reported_stack": s.get("usage"),
                 "ttft_direct_s": med(td), "ttft_stack_s": med(ts),
                 "ttft_ratio": med(ratios), "ttft_direct_all_s": td, "ttft_stack_all_s": ts,
                 "prefill_direct_s": med([r["direct"][si][ti].get("prefill_s") for r in runs]),
                 "prefill_stack_s": med([r["stack"][si][ti].get("prefill_s") for r in runs]),
                 "added_s": med(added), "added_all_s": added,
                 # TTFT had the backend computed as fast on both paths
                 "ttft_ratio_same_backend": (1 + med(added) / med(td)) if added and med(td)
                 else None,
                 "total_direct_s": med([r["direct"][si][ti]["total_s"] for r in runs]),
                 "total_stack_s": med([r["stack"][si][ti]["total_s"] for r in runs]),
                 "stack_differs_at": s.get("differs_at"),
                 "stack_differs_snippet": s.get("differs_snippet")}
            for k in ("head_tokens", "common_tokens", "prev_is_prefix", "diverges_at_char",
                      "diverges_at", "expected_processed", "new_since_last_prompt", "ideal_processed"):
                t[k] = d.get(k)
                t[k + "_stack"] = s.get(k)
            turns.append(t)
    checks = []

    def check(name, ok, detail):
        checks.append({"target": name, "met": ok, "detail": detail})

    bad = [t["turn"] for t in turns if t["status_stack"] != 200]
    check("every turn 200 through the stack", not bad,
          "all 200" if not bad else f"not 200: {', '.join(bad)}")
    raw = sorted({t["status_raw"] for t in turns})
    check("(for the record) direct with the agent's raw body", None,
          f"HTTP {', '.join(map(str, raw))}: {turns[0]['raw_error']}")
    later = [t for t in turns if t["turn"] != "A1"]
    eq = [t["turn"] for t in later if t["reused_stack"] != t["reused_direct"]]
    offsets = sorted({(t["reused_stack"] or 0) - (t["reused_direct"] or 0) for t in later})
    poffs = sorted({(t["prompt_stack"] or 0) - (t["prompt_direct"] or 0) for t in turns})
    peq = [t["turn"] for t in later if t["processed_stack"] != t["processed_direct"]]
    if not eq:
        detail = "equal on every turn"
    else:
        detail = (f"differ on {', '.join(eq)} by {offsets} tokens; the stack's prompt is "
                  f"{poffs} tokens longer than direct's on every turn")
    detail += ("; processed equal on every turn" if not peq else
               f"; processed differ on {', '.join(peq)}")
    check("from turn 2 on reused(stack) == reused(direct fixed)", not eq, detail)
    if not eq and not peq and len(offsets) == 1 and offsets == poffs:
        check("... the same counted as processed tokens (the stack's extra prompt all reused)",
              True, f"reused(stack) = reused(direct) + {offsets[0]} (its longer prompt's "
                    "extra tokens, reused every turn) and processed equal")
    within = [t for t in turns if t["ttft_ratio"] is not None]
    over = [f"{t['turn']} {t['ttft_ratio']:.3f}" for t in within
            if t["ttft_ratio"] > 1 + TTFT_TOLERANCE]
    mr = med([t["ttft_ratio"] for t in within])
    if not within:
        detail = "no TTFT measured"
    else:
        later_r = med([t["ttft_ratio"] for t in within if t["turn"] != "A1"])
        detail = f"median ratio stack/direct {mr:.3f} (turns after A1: {later_r:.3f}); " + (
            "every turn within" if not over else f"over on {', '.join(over)}")
    check(f"TTFT through the stack within {TTFT_TOLERANCE:.0%} of direct per turn",
          not over and bool(within), detail)
    same = [t for t in turns if t["ttft_ratio_same_backend"] is not None]
    over = [f"{t['turn']} {t['ttft_ratio_same_backend']:.3f}" for t in same
            if t["ttft_ratio_same_backend"] > 1 + TTFT_TOLERANCE]
    check(f"... the stack's own share (TTFT outside the backend's prefill, stack - direct) "
          f"within {TTFT_TOLERANCE:.0%} of direct's TTFT per turn", not over and bool(same),
          "no TTFT measured" if not same else
          f"the stack adds a median {med([t['added_s'] for t in same]) * 1e3:.1f} ms a turn "
          f"(range {min(t['added_s'] for t in same) * 1e3:.1f} to "
          f"{max(t['added_s'] for t in same) * 1e3:.1f}); backend prefill direct / stack "
          f"differs by a median "
          f"{med([t['prefill_stack_s'] / t['prefill_direct_s'] for t in same if t['prefill_direct_s']]):.3f}x "
          f"(the same prompt computed: machine noise); "
          + ("every turn within" if not over else f"over on {', '.join(over)}"))
    for t in turns:
        if t["kind"] == "new session":
            head = t["head_tokens"]
            ok = all(head is not None and (t[f"reused_{p}"] or 0) >= t[f"head_tokens{sfx}"]
                     for p, sfx in (("direct", ""), ("stack", "_stack")))
            check(f"a second session ({t['turn']}) reuses its whole system+tools prefix", ok,
                  f"system+tools head {t['head_tokens']} / {t['head_tokens_stack']} tokens "
                  f"(direct / stack); reused {t['reused_direct']} / {t['reused_stack']} of "
                  f"{t['prompt_direct']} / {t['prompt_stack']}; processed "
                  f"{t['processed_direct']} / {t['processed_stack']}, the text in common "
                  f"with the slot's last prompt (the other session's) leaves "
                  f"{t['expected_processed']} / {t['expected_processed_stack']}; it parts at "
                  f"...{t['diverges_at']!r}")
        if t["kind"] == "new prompt":
            ideal = t["ideal_processed"]
            ok = all(t[f"processed_{p}"] is not None and ideal is not None and
                     t[f"processed_{p}"] <= ideal + 8 for p in ("direct", "stack"))
            check(f"a new user prompt ({t['turn']}) re-processes only itself", ok,
                  f"the new user message and the last answer before it (scripted, never "
                  f"cached): {ideal} tokens; processed {t['processed_direct']} / "
                  f"{t['processed_stack']} (direct / stack); the prompt "
                  f"{'extends' if t['prev_is_prefix'] else 'no longer extends'} the last "
                  f"one: it parts at char {t['diverges_at_char']} ...{t['diverges_at']!r}, "
                  f"which leaves {t['expected_processed']} to process")
    for p in ("direct", "stack"):
        wrong = [f"{t['turn']} {(t[f'reported_{p}'] or {}).get('cached')} (backend {t[f'reused_{p}']})"
                 for t in turns if (t[f"reported_{p}"] or {}).get("cached") != t[f"reused_{p}"]]
        check(f"(for the record) cached tokens the answer reports, {p}", None,
              "the backend's on every turn" if not wrong else
              f"not the backend's on {len(wrong)} turns: {'; '.join(wrong[:4])}"
              f"{' ...' if len(wrong) > 4 else ''}")
    diffs = [f"{t['turn']} at char {t['stack_differs_at']}" for t in turns
             if t.get("stack_differs_at") is not None]
    check("(for the record) the stack's prompt vs direct's (fixed)", None,
          "identical on every turn" if not diffs else
          f"differs on {len(diffs)} turns, first at ...{turns[0].get('stack_differs_snippet')!r}"
          f" ({'; '.join(diffs[:3])}{' ...' if len(diffs) > 3 else ''})")
    return {"agent": agent, "turns": turns, "checks": checks}


def report(summary: dict, repeats: int) -> str:
    a = summary["agent"]
    lines = [f"### {NAMES[a]} ({'/v1/messages' if a == 'claude' else '/v1/responses'})\n",
             "| turn | kind | status raw / fixed / stack | prompt tokens direct / stack | "
             "reused direct / stack | processed direct / stack | template allows | "
             f"TTFT ms direct / stack{' (median of ' + str(repeats) + ')' if repeats > 1 else ''}"
             " | stack / direct | backend prefill ms direct / stack | stack adds ms "
             "| total ms direct / stack |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in summary["turns"]:
        ratio = "—" if t["ttft_ratio"] is None else f"{t['ttft_ratio']:.3f}"
        lines.append(
            f"| {t['turn']} | {t['kind']} | {t['status_raw']} / {t['status_direct']} / "
            f"{t['status_stack']} | {t['prompt_direct']} / {t['prompt_stack']} | "
            f"{t['reused_direct']} / {t['reused_stack']} | {t['processed_direct']} / "
            f"{t['processed_stack']} | {t.get('expected_processed') if t.get('expected_processed') is not None else '—'} | "
            f"{fmt_ms(t['ttft_direct_s'])} / {fmt_ms(t['ttft_stack_s'])} | {ratio} | "
            f"{fmt_ms(t['prefill_direct_s'])} / {fmt_ms(t['prefill_stack_s'])} | "
            f"{'—' if t['added_s'] is None else format(t['added_s'] * 1e3, '.1f')} | "
            f"{fmt_ms(t['total_direct_s'])} / {fmt_ms(t['total_stack_s'])} |")
    lines.append("")
    for c in summary["checks"]:
        mark = {True: "MET", False: "NOT MET", None: "note"}[c["met"]]
        lines.append(f"- **{mark}**: {c['target']}: {c['detail']}")
    lines.append("")
    return "\n".join(lines)


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "loadavg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    except (OSError, StopIteration):
        pass
    return info


def commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "proxy", "swapper",
                                "common"], cwd=REPO, capture_output=True, text=True).stdout
        return rev + (" (+ uncommitted changes in proxy/swapper/common)" if dirty.strip() else "")
    except OSError:
        return "?"


args: argparse.Namespace


def main() -> None:
    global args
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="codex,claude", help="comma-separated: claude, codex")
    ap.add_argument("--turns", type=int, default=0,
                    help="at most this many turns of each session (0: all: A1-A6, B1-B3)")
    ap.add_argument("--sessions", type=int, default=2, help="sessions per agent (1 or 2)")
    ap.add_argument("--repeats", default="1",
                    help="replays per path (the path order alternates): N, or per agent "
                         "e.g. codex=3,claude=1")
    ap.add_argument("--max-tokens", type=int, default=8, help="generation cap per turn")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--out", default=os.environ.get("PERF_OUT", "/tmp/coding-stack-perf"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    agents = [a for a in args.agents.split(",") if a]
    if "=" in args.repeats:
        reps = {k: int(v) for k, v in (x.split("=") for x in args.repeats.split(",") if x)}
    else:
        reps = {a: int(args.repeats) for a in agents}
    t_start = time.monotonic()

    def log(msg):
        print(f"[agents {time.monotonic() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    res = {"started": stamp, "commit": commit(), "machine": machine(), "args": vars(args),
           "agents": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with SwapperProcess(backends_dir=BACKENDS, LOG_LEVEL="WARNING", DEFAULT_MODEL=MODEL,
                        AGENTS_TEMPLATES_DIR=str(captured_agents.TEMPLATES),
                        AGENTS_THREADS=str(args.threads)) as sw:
        log("loading the backend (llama-server, Qwen 3.5 template, -c 32768)")
        requests.post(sw.url + f"/load/{MODEL}", timeout=600).raise_for_status()
        # The tool floor raises max_tokens 8 -> 1,024, and this llama-server's
        # /v1/messages ignores n_predict: Claude Code's turns generated 1,024 tokens
        # through the stack (5+ min a turn here) against 8 direct. The floor only sets
        # the generation's length, never the prompt: off, so both paths generate 8.
        proxy = ProxyProcess(BACKEND_URL=sw.url, LOG_LEVEL="WARNING",
                             TOOL_MAX_TOKENS_FLOOR="0").start()
        try:
            backend = Backend(sw.backend_url)
            res["backend_props"] = {k: v for k, v in backend.http.get(
                backend.url + "/props", timeout=30).json().items()
                if k in ("build_info", "model_path", "total_slots")}
            for agent in agents:
                sessions = [s[:args.turns] if args.turns else s
                            for s in captured_agents.captured(agent)[:args.sessions]]
                runs = []
                for rep in range(reps.get(agent, 1)):
                    log(f"{agent}: repeat {rep + 1}")
                    run = run_paired(agent, sessions, backend, proxy.url, rep, log)
                    compare(run)
                    for label in run:
                        expectations([r for rows in run[label] for r in rows], backend)
                    runs.append(run)
                res["agents"][agent] = {"runs": runs}
                (out_dir / f"agents-{stamp}.json").write_text(json.dumps(res, indent=1,
                                                                         default=str))
                summary = summarise(agent, runs)
                res["agents"][agent]["summary"] = summary
                print(report(summary, reps.get(agent, 1)), flush=True)
                (out_dir / f"agents-{stamp}.json").write_text(json.dumps(res, indent=1,
                                                                         default=str))
        finally:
            proxy.stop()
    res["seconds"] = round(time.monotonic() - t_start, 1)
    res["machine"]["loadavg_end"] = os.getloadavg()
    text = "\n".join(report(res["agents"][a]["summary"], reps.get(a, 1)) for a in res["agents"])
    (out_dir / f"agents-{stamp}.md").write_text(text + "\n")
    js = json.dumps(res, indent=1, default=str)
    (out_dir / f"agents-{stamp}.json").write_text(js)
    if args.json:
        Path(args.json).write_text(js)
    print(f"\n{res['seconds']:.0f} s; commit {res['commit']}; machine {res['machine']}; "
          f"backend {res.get('backend_props')}; JSON: {out_dir / f'agents-{stamp}.json'}")


if __name__ == "__main__":
    main()
