"""Latency and throughput of one model, from streaming chat requests (run by benchmark.sh).

Per run, two streamed requests with `tool_choice: "none"` (so the proxy injects no
web_search tool) and an explicit system message (so it injects no system prompt): the
proxy and the backend see the same request.

  short prompt, N output tokens -> TTFT (request sent -> first streamed token) and decode
      tok/s = (tokens - 1) / (last token - first token); tokens from the stream's usage,
      else one per content chunk. llama.cpp's own `timings` (final chunk) shown alongside.
  long prompt (~P tokens), 1 output token -> prefill tok/s = prompt tokens / TTFT, and
      the backend's prompt_per_second when it reports timings.

Every prompt starts with a fresh nonce so no run is served from the prompt cache. One
warm-up request first (it also loads the model when going through the stack). Medians
over the runs. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid

FILLER = ("The quick brown fox jumps over the lazy dog while the old lighthouse keeper "
          "writes the date, the hour and the direction of the wind into his logbook. ")
# ~31 tokens per FILLER with common BPE vocabularies; measured prompt sizes come from usage.
FILLER_TOKENS = 31


class BenchError(RuntimeError):
    pass


def build_url(base: str) -> str:
    base = base.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def list_models(base: str, headers: dict, timeout: float) -> list[str]:
    base = base.rstrip("/")
    url = base + ("/models" if base.endswith("/v1") else "/v1/models")
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            data = json.load(r)
    except Exception:
        return []
    return [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]


def stream_chat(url: str, headers: dict, body: dict) -> dict:
    """One streamed request; returns timings measured on this side and what the stream said."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={**headers, "Content-Type": "application/json",
                                                          "Accept": "text/event-stream"})
    t0 = time.perf_counter()
    try:
        # Reads never time out: a first request may have to wait for a model to load.
        resp = urllib.request.urlopen(req, timeout=None)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise BenchError(f"HTTP {e.code} from {url}: {detail}") from None
    except urllib.error.URLError as e:
        raise BenchError(f"cannot reach {url}: {e.reason}") from None
    first = last = None
    chunks = 0
    usage = timings = None
    text = []
    models: set[str] = set()
    done = False
    with resp:
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if "error" in event:
                raise BenchError(f"error in stream: {json.dumps(event['error'])[:300]}")
            if event.get("model"):
                models.add(event["model"])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("timings"):
                timings = event["timings"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or delta.get("reasoning_content")
                         or delta.get("reasoning") or "")
                if piece or delta.get("tool_calls"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    text.append(piece)
    if first is None:
        raise BenchError("the stream carried no tokens")
    tokens = (usage or {}).get("completion_tokens") or chunks
    return {"ttft": first - t0, "decode_time": last - first, "tokens": tokens, "chunks": chunks,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "timings": timings,
            "text": "".join(text), "models": models, "done": done}


def request_body(model: str | None, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt},
        ],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "tool_choice": "none",
    }
    if model:
        body["model"] = model
    return body


def decode_prompt() -> str:
    return (f"[{uuid.uuid4().hex[:12]}] Write a long, detailed story about a lighthouse keeper "
            f"and a ship that appears without lights. Keep writing.")


def prefill_prompt(n_tokens: int) -> str:
    reps = max(1, n_tokens // FILLER_TOKENS)
    return (f"[{uuid.uuid4().hex[:12]}] Read this text, then answer with one word.\n"
            + FILLER * reps + "\nWhat animal jumps?")


def summary(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def run(args) -> dict:
    headers = {}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    url = build_url(args.url)
    model = args.model
    if args.direct:
        # A backend knows its model by id only (vLLM checks it): map an alias or nothing
        # to what the backend serves.
        served = list_models(args.url, headers, 5)
        if served and model not in served:
            model = served[0]

    stream_chat(url, headers, request_body(model, "Say hello.", 8))  # warm-up

    ttft, decode, decode_backend, prefill, prefill_backend, prompt_tokens, out_tokens = ([] for _ in range(7))
    for _ in range(args.runs):
        d = stream_chat(url, headers, request_body(model, decode_prompt(), args.max_tokens))
        ttft.append(d["ttft"] * 1000)
        out_tokens.append(d["tokens"])
        if d["tokens"] > 1 and d["decode_time"] > 0:
            decode.append((d["tokens"] - 1) / d["decode_time"])
        t = d["timings"] or {}
        decode_backend.append(t.get("predicted_per_second"))

        p = stream_chat(url, headers, request_body(model, prefill_prompt(args.prompt_tokens), 1))
        pt = p["prompt_tokens"]
        prompt_tokens.append(pt)
        if pt:
            prefill.append(pt / p["ttft"])
        t = p["timings"] or {}
        prefill_backend.append(t.get("prompt_per_second"))

    return {
        "url": args.url,
        "mode": args.mode,
        "model": model or "(default)",
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "metrics": {
            "ttft_ms": summary(ttft),
            "decode_tok_s": summary(decode),
            "decode_tok_s_backend": summary(decode_backend),
            "prefill_tok_s": summary(prefill),
            "prefill_tok_s_backend": summary(prefill_backend),
        },
        "completion_tokens": summary(out_tokens),
        "prompt_tokens": summary(prompt_tokens),
    }


def table(result: dict) -> str:
    m = result["metrics"]
    pt = result["prompt_tokens"]
    ptxt = f"{int(pt['median'])}-token prompt" if pt else "long prompt"
    ct = result["completion_tokens"]
    ctxt = f"{int(ct['median'])} tokens" if ct else "stream"
    rows = [
        ("TTFT, short prompt", m["ttft_ms"], "ms", 1),
        (f"decode, client ({ctxt})", m["decode_tok_s"], "tok/s", 1),
        ("decode, backend timings", m["decode_tok_s_backend"], "tok/s", 1),
        (f"prefill, client ({ptxt})", m["prefill_tok_s"], "tok/s", 0),
        ("prefill, backend timings", m["prefill_tok_s_backend"], "tok/s", 0),
    ]
    where = {"direct": " (direct to the backend)", "stack": " (through the stack)"}.get(result["mode"], "")
    name = result["model"]
    name = os.path.basename(name) if name.startswith("/") else name   # llama-server: its file
    out = [f"model {name}  ·  {result['url']}{where}  ·  {result['runs']} runs, median",
           "",
           f"{'metric':<34} {'median':>10} {'min':>10} {'max':>10}  unit",
           f"{'-' * 34} {'-' * 10} {'-' * 10} {'-' * 10}  -----"]
    for name, s, unit, digits in rows:
        if s is None:
            out.append(f"{name:<34} {'n/a':>10} {'':>10} {'':>10}  {unit}")
        else:
            out.append(f"{name:<34} {s['median']:>10.{digits}f} {s['min']:>10.{digits}f} "
                       f"{s['max']:>10.{digits}f}  {unit}")
    if m["decode_tok_s_backend"] is None:
        out.append("\n(backend timings: only llama.cpp reports them)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    publish = os.environ.get("BACKEND_PUBLISH_PORT") or "18080"
    proxy_port = os.environ.get("PROXY_PORT") or "11433"
    p = argparse.ArgumentParser(
        prog="benchmark.sh",
        description="TTFT, decode and prefill speed of a model from streamed requests, median "
                    "of several runs; through the stack (the proxy on :11433) by default.")
    p.add_argument("--model", "-m", help="model id or alias (default: the stack's default model)")
    p.add_argument("--direct", action="store_true",
                   help=f"talk to the resident backend on its published port "
                        f"(http://127.0.0.1:{publish}) instead of the proxy")
    p.add_argument("--url", help="base URL to test (overrides --direct's and the proxy's)")
    p.add_argument("--runs", "-n", type=int, default=5, help="measured runs (default 5)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of the decode request")
    p.add_argument("--prompt-tokens", type=int, default=2000,
                   help="approximate size of the prefill prompt (default 2000)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--api-key", default=None,
                   help="Bearer key (default: $API_KEY for the proxy; with --direct, "
                        "$BACKEND_API_KEY, the backend's own)")
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("BACKEND_API_KEY" if args.direct else "API_KEY") or None
    if args.runs < 1:
        p.error("--runs must be at least 1")
    args.mode = "url" if args.url else ("direct" if args.direct else "stack")
    if not args.url:
        args.url = (f"http://127.0.0.1:{publish}" if args.direct
                    else f"http://localhost:{proxy_port}")
    if not args.json:
        print(f"benchmarking {args.model or 'the default model'} at {args.url} "
              f"({args.runs} runs; the first request may wait for the model to load)...",
              file=sys.stderr, flush=True)
    try:
        result = run(args)
    except BenchError as e:
        hint = ""
        if args.mode == "direct" and "cannot reach" in str(e):
            hint = ("\n  --direct needs a resident backend: load one first (curl -X POST "
                    f"localhost:{proxy_port}/load/MODEL) or run without --direct")
        print(f"benchmark.sh: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
