"""The live gate over the running stack (run by verify.sh): every model, or those named,
loaded and probed through the proxy the way clients use it.

Per model, in order:
  load     POST /load/<id>: the backend starts and gets healthy (seconds measured here)
  chat     a short chat; the answer names the model id and says something
  stream   the same streamed: TTFT and decode tok/s, every chunk names the model id,
           the stream ends with [DONE]
  tools    a client tool (`add`) the model must call with JSON arguments {a, b}
  n=2      two choices in one request
  search   a web_search round trip through the proxy and SearXNG (when SearXNG is
           configured: SEARXNG_URL set, WEB_SEARCH not 0, or --search)

Which models and how hard each is probed comes from scripts/verify.toml; a registry
model without an entry there is refused (exit 2). Any failed probe: exit 1.
Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(REPO))
from benchmark import BenchError, build_url, stream_chat  # noqa: E402

from common.config import read_dotenv  # noqa: E402

GATE = REPO / "scripts" / "verify.toml"
PROBES = ("load", "chat", "stream", "tools", "n=2", "search")
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return their sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
GATE_KEYS = {"max_tokens": int, "tool_choice": str, "search": bool, "note": str}
TOOL_CHOICES = ("auto", "required", "named", "skip")


class Refused(Exception):
    """The gate will not run (exit 2): unknown model, no gate entry, no stack."""


class Probe:
    """ok: True (pass), False (fail), None (skipped / not run); reason: why, in words."""

    def __init__(self, ok: bool | None, reason: str = ""):
        self.ok, self.reason = ok, reason

    @property
    def word(self) -> str:
        return {True: "pass", False: "FAIL", None: "skip"}[self.ok]


def config_env() -> dict[str, str]:
    """The variables verify reads: the environment, else the repo's .env (as compose)."""
    dotenv = read_dotenv(REPO / ".env")
    keys = ("PROXY_PORT", "API_KEY", "SEARXNG_URL", "WEB_SEARCH")
    return {k: os.environ.get(k) or dotenv.get(k) or "" for k in keys}


def load_gate(path: Path) -> dict[str, dict]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise Refused(f"cannot read the gate file {path}: {e}") from None
    for model_id, entry in data.items():
        for key, value in entry.items():
            if key not in GATE_KEYS or not isinstance(value, GATE_KEYS[key]):
                raise Refused(f"{path}: [{model_id}] {key} = {value!r}: known keys are "
                              f"{', '.join(GATE_KEYS)} (see the file's header)")
        if entry.get("tool_choice", "named") not in TOOL_CHOICES:
            raise Refused(f"{path}: [{model_id}] tool_choice must be one of {TOOL_CHOICES}")
    return data


def _short(text, n: int = 160) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


class Stack:
    def __init__(self, base: str, api_key: str = ""):
        self.base = base.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def call(self, method: str, path: str, body: dict | None = None,
             timeout: float | None = None) -> tuple[int, object]:
        """(status, parsed JSON or text). Reads never time out: a load may take minutes."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={**self.headers, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode("utf-8", "replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def models(self) -> list[dict]:
        try:
            status, obj = self.call("GET", "/v1/models", timeout=30)
        except OSError as e:
            raise Refused(f"no stack at {self.base}: {getattr(e, 'reason', e)} "
                          f"(start it: docker compose up -d; or pass --url)") from None
        if status != 200 or not isinstance(obj, dict):
            raise Refused(f"{self.base}/v1/models answered {status}: {_short(obj)}")
        return [m for m in obj.get("data", []) if isinstance(m, dict) and m.get("id")]

    def search_counters(self) -> dict[str, float] | None:
        """The proxy's search counters (per worker process), or None."""
        try:
            status, text = self.call("GET", "/metrics", timeout=30)
        except OSError:
            return None
        if status != 200 or not isinstance(text, str):
            return None
        out = {}
        for m in re.finditer(r'^(proxy_search(?:es|_failures)_total)(?:\{kind="([^"]+)"\})? (\S+)$',
                             text, re.M):
            out[m.group(2) or "searches"] = float(m.group(3))
        return out or None


def _error_text(obj) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return _short(obj["error"].get("message"), 300)
    return _short(obj, 300)


def _said(msg: dict) -> str:
    return (msg.get("content") or msg.get("reasoning_content") or msg.get("reasoning") or "").strip()


class Gate:
    def __init__(self, stack: Stack, search: bool, search_why: str):
        self.stack, self.search, self.search_why = stack, search, search_why

    def chat(self, model: str, body: dict) -> tuple[int, object]:
        return self.stack.call("POST", "/v1/chat/completions",
                               {"model": model, "temperature": 0, **body})

    def run(self, model: str, entry: dict) -> dict:
        res: dict = {"model": model, "note": entry.get("note", ""), "load_s": None,
                     "ttft_ms": None, "tok_s": None, "probes": {}}
        p = res["probes"]
        t0 = time.perf_counter()
        try:
            status, obj = self.stack.call("POST", f"/load/{model}")
        except OSError as e:
            status, obj = 0, f"the stack did not answer: {e}"
        if status != 200:
            p["load"] = Probe(False, f"HTTP {status}: {_error_text(obj)}")
            for name in PROBES[1:]:
                p[name] = Probe(None, "not run: the model did not load")
            return res
        res["load_s"] = time.perf_counter() - t0
        p["load"] = Probe(True, f"ready in {res['load_s']:.1f} s")
        mt = entry.get("max_tokens", 32)
        for name, probe in (("chat", self.probe_chat), ("stream", self.probe_stream),
                            ("tools", self.probe_tools), ("n=2", self.probe_n2),
                            ("search", self.probe_search)):
            try:
                p[name] = probe(model, entry, mt, res)
            except (OSError, BenchError, ValueError, KeyError, IndexError, TypeError,
                    AttributeError) as e:      # a malformed answer is a failed probe
                p[name] = Probe(False, f"{type(e).__name__}: {_short(e, 300)}")
        return res

    def probe_chat(self, model, entry, mt, res) -> Probe:
        status, obj = self.chat(model, {"max_tokens": mt, "tool_choice": "none", "messages": [
            SYSTEM, {"role": "user", "content": "Say hello in one word."}]})
        if status != 200:
            return Probe(False, f"HTTP {status}: {_error_text(obj)}")
        if obj.get("model") != model:
            return Probe(False, f"the response names model {obj.get('model')!r}, not {model!r}")
        said = _said(obj["choices"][0]["message"])
        if not said:
            return Probe(False, "empty answer")
        return Probe(True, f"{_short(said, 60)!r}")

    def probe_stream(self, model, entry, mt, res) -> Probe:
        body = {"model": model, "temperature": 0, "max_tokens": mt, "stream": True,
                "stream_options": {"include_usage": True}, "tool_choice": "none",
                "messages": [SYSTEM, {"role": "user", "content": "Count from one to ten."}]}
        d = stream_chat(build_url(self.stack.base), self.stack.headers, body)
        res["ttft_ms"] = d["ttft"] * 1000
        if d["tokens"] > 1 and d["decode_time"] > 0:
            res["tok_s"] = (d["tokens"] - 1) / d["decode_time"]
        if not d["done"]:
            return Probe(False, "the stream ended without [DONE]")
        if d["models"] != {model}:
            return Probe(False, f"stream chunks name {sorted(d['models'])}, not {model!r}")
        return Probe(True, f"{d['tokens']} tokens")

    def probe_tools(self, model, entry, mt, res) -> Probe:
        how = entry.get("tool_choice", "named")
        if how == "skip":
            return Probe(None, f"skipped by the gate entry: {entry.get('note') or '(no note)'}")
        choice = {"type": "function", "function": {"name": "add"}} if how == "named" else how
        status, obj = self.chat(model, {"max_tokens": mt, "tools": [ADD_TOOL], "tool_choice": choice,
                                        "messages": [SYSTEM, {"role": "user", "content":
                                                     "Use the add tool to add 17 and 25."}]})
        if status != 200:
            return Probe(False, f"HTTP {status}: {_error_text(obj)}")
        msg = obj["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        if not calls:
            return Probe(False, f"no tool call ({how}); it answered {_short(_said(msg), 80)!r}")
        fn = calls[0].get("function") or {}
        if fn.get("name") != "add":
            return Probe(False, f"it called {fn.get('name')!r}, not 'add'")
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError:
            return Probe(False, f"arguments are not JSON: {_short(fn.get('arguments'), 80)!r}")
        if not (isinstance(args, dict) and all(isinstance(args.get(k), int) for k in "ab")):
            return Probe(False, f"arguments do not match the schema: {_short(args, 80)}")
        return Probe(True, f"add(a={args['a']}, b={args['b']}) [tool_choice {how}]")

    def probe_n2(self, model, entry, mt, res) -> Probe:
        status, obj = self.chat(model, {"max_tokens": mt, "n": 2, "temperature": 0.8,
                                        "tool_choice": "none", "messages": [
                                            SYSTEM, {"role": "user", "content": "Name a colour."}]})
        if status != 200:
            return Probe(False, f"HTTP {status}: {_error_text(obj)}")
        choices = obj.get("choices") or []
        if sorted(c.get("index") for c in choices) != [0, 1]:
            return Probe(False, f"{len(choices)} choice(s), indexes "
                                f"{[c.get('index') for c in choices]}, not [0, 1]")
        if not all(_said(c.get("message") or {}) for c in choices):
            return Probe(False, "a choice is empty")
        return Probe(True, "2 choices")

    def probe_search(self, model, entry, mt, res) -> Probe:
        if not self.search:
            return Probe(None, self.search_why)
        if entry.get("search") is False:
            return Probe(None, f"skipped by the gate entry: {entry.get('note') or '(no note)'}")
        before = self.stack.search_counters()
        status, obj = self.chat(model, {
            "max_tokens": mt,
            "tool_choice": {"type": "function", "function": {"name": "web_search"}},
            "messages": [SYSTEM, {"role": "user", "content":
                         "Search the web for the latest Python release, then answer in one sentence."}]})
        after = self.stack.search_counters()
        if status != 200:
            return Probe(False, f"HTTP {status}: {_error_text(obj)}")
        said = _said(obj["choices"][0]["message"])
        if before is not None and after is not None:
            failed = {k: after[k] - before.get(k, 0) for k in after
                      if k != "searches" and after[k] > before.get(k, 0)}
            ran = after.get("searches", 0) - before.get("searches", 0)
            if failed:
                kinds = ", ".join(f"{k} x{v:g}" for k, v in failed.items())
                return Probe(False, f"SearXNG failed ({kinds}): see the proxy's log and "
                                    "docs/troubleshooting.md")
            if ran < 1:
                return Probe(False, "no search ran: the model made no web_search call with a "
                                    "query (or WEB_SEARCH=0 at the proxy)")
            if not said:
                return Probe(False, "searched, but the final answer is empty")
            return Probe(True, f"{ran:g} search(es), answered {_short(said, 50)!r}")
        if "\nSources:\n" in said:        # no /metrics: the answer's Sources block
            return Probe(True, "answered with a Sources block")
        return Probe(False, "no sign of a search (no Sources block; /metrics unreadable)")


def table(results: list[dict]) -> str:
    head = f"{'model':<20} {'load s':>7} {'TTFT ms':>8} {'tok/s':>7}  " + "  ".join(
        f"{n:<6}" for n in PROBES[1:])
    out = [head, "-" * len(head)]

    def num(v, digits):
        return "—" if v is None else f"{v:.{digits}f}"
    for r in results:
        p = r["probes"]
        load = num(r["load_s"], 1) if p["load"].ok else "FAIL"
        out.append(f"{r['model']:<20} {load:>7} {num(r['ttft_ms'], 0):>8} {num(r['tok_s'], 1):>7}  "
                   + "  ".join(f"{p[n].word:<6}" for n in PROBES[1:]))
    out.append("")
    for r in results:
        if r["note"]:
            out.append(f"{r['model']}: {r['note']}")
        for name in PROBES:
            pr = r["probes"][name]
            out.append(f"  {r['model']:<18} {name:<7} {pr.word:<5} {pr.reason}")
    return "\n".join(out)


def as_json(results: list[dict]) -> str:
    return json.dumps([{**r, "probes": {k: {"result": v.word, "reason": v.reason}
                                        for k, v in r["probes"].items()}} for r in results],
                      indent=2)


def select(stack_models: list[dict], names: list[str], gate: dict, gate_path: Path) -> list[str]:
    ids = [m["id"] for m in stack_models]
    by_name = {}
    for m in stack_models:
        for n in (m["id"], *(m.get("aliases") or [])):
            by_name[n] = m["id"]
    chosen = []
    for n in names or ids:
        if n not in by_name:
            raise Refused(f"unknown model {n!r} (the stack serves: {', '.join(ids)})")
        if by_name[n] not in chosen:
            chosen.append(by_name[n])
    missing = [m for m in chosen if m not in gate]
    if missing:
        raise Refused(f"no gate entry for {', '.join(missing)} in {gate_path}: every registry "
                      f"model needs one (see the file's header), so nothing is left unchecked")
    return chosen


def main(argv: list[str] | None = None) -> int:
    env = config_env()
    p = argparse.ArgumentParser(
        prog="verify.sh",
        description="Live gate: load each model of the running stack (or those named) and "
                    "probe chat, streaming, tool calls, n=2 and web_search; a table of the "
                    "results; exit 1 if any probe fails, 2 if the gate refuses to run.")
    p.add_argument("models", nargs="*", help="model ids or aliases (default: every model)")
    p.add_argument("--url", default=f"http://127.0.0.1:{env['PROXY_PORT'] or '11433'}",
                   help="the stack's proxy (default: http://127.0.0.1:$PROXY_PORT)")
    p.add_argument("--gate", type=Path, default=GATE, help=f"gate entries (default: {GATE})")
    p.add_argument("--api-key", default=env["API_KEY"], help="Bearer key (default: $API_KEY)")
    s = p.add_mutually_exclusive_group()
    s.add_argument("--search", action="store_true", default=None,
                   help="run the web_search probe (default: when SEARXNG_URL is set)")
    s.add_argument("--no-search", dest="search", action="store_false",
                   help="skip the web_search probe")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)

    if args.search is None:
        if env["WEB_SEARCH"].strip().lower() in ("0", "false", "no", "off"):
            search, why = False, "skipped: WEB_SEARCH=0"
        elif env["SEARXNG_URL"]:
            search, why = True, ""
        else:
            search, why = False, "skipped: SearXNG not configured (SEARXNG_URL unset; --search forces)"
    else:
        search, why = args.search, "skipped: --no-search"
    stack = Stack(args.url, args.api_key)
    try:
        gate = load_gate(args.gate)
        chosen = select(stack.models(), args.models, gate, args.gate)
    except Refused as e:
        print(f"verify.sh: refused: {e}", file=sys.stderr)
        return 2
    g = Gate(stack, search, why)
    results = []
    for model in chosen:
        if not args.json:
            print(f"verify: {model} ...", file=sys.stderr, flush=True)
        results.append(g.run(model, gate[model]))
    failed = [(r["model"], n) for r in results for n, pr in r["probes"].items() if pr.ok is False]
    if args.json:
        print(as_json(results))
    else:
        print(table(results))
        print()
        print(f"verify: FAILED: {', '.join(f'{m} {n}' for m, n in failed)}" if failed
              else f"verify: all probes passed ({len(results)} model(s))")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
