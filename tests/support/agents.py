"""The real agent CLIs (Claude Code, Codex) and a scripted model that makes them search.

`searching_model` answers by looking at each request, as a model would: when it is
offered web search it searches, when it has the results it answers with the first
result's URL (so an answer that names it was built on the search result), anything
else (titles, summaries) gets a short "ok".
"""
from __future__ import annotations

import json
import os
import re
import shutil

from .chat import Reply, call

QUERY = "flask 3.1 changelog"
URL_RE = re.compile(r"https://example\.com/[\w./-]+")


def agents_bin() -> str | None:
    d = os.environ.get("TESTBED_AGENTS_BIN")
    if d and os.path.isdir(d):
        return d
    cache = os.environ.get("CODING_STACK_CACHE", "/var/cache/coding-stack")
    for name in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        if name.startswith("agents-"):
            return os.path.join(cache, name, "node_modules", ".bin")
    return None


def tool(bin_dir: str | None, name: str) -> str | None:
    p = os.path.join(bin_dir, name) if bin_dir else None
    if p and os.access(p, os.X_OK) and shutil.which("node"):
        return p
    return None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content or []:
        if isinstance(b, dict):
            out.append(_text(b.get("content")) if b.get("type") == "tool_result"
                       else str(b.get("text") or b.get("output") or ""))
    return "\n".join(out)


def answer(found: str) -> Reply:
    urls = URL_RE.findall(found)
    return Reply(content=f"ANSWER: the changelog is at {urls[0]} [1]" if urls
                 else "ANSWER: no search result reached me")


def searching_model(body: dict, path: str) -> Reply:
    if path == "/v1/messages":
        names = [t.get("name") for t in body.get("tools") or []]
        msgs = body.get("messages") or []
        last = msgs[-1] if msgs else {}
        results = [b for b in last.get("content") or [] if isinstance(b, dict)
                   and b.get("type") == "tool_result"] if isinstance(last.get("content"),
                                                                    list) else []
        if results:
            return answer(_text(results))
        if "web_search" in names:
            return Reply(tool_calls=[call("web_search", {"query": QUERY})])
        if "WebSearch" in names:
            return Reply(tool_calls=[call("WebSearch", {"query": QUERY})])
        return Reply(content="ok")
    if path == "/v1/responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        outs = [i for i in items if isinstance(i, dict)
                and i.get("type") == "function_call_output"]
        if outs:
            return answer(json.dumps(outs[-1].get("output")))
        if any(t.get("name") == "web_search" for t in body.get("tools") or []):
            return Reply(tool_calls=[call("web_search", {"query": QUERY})])
        return Reply(content="ok")
    return Reply(content="ok")
