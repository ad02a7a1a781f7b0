"""Which agent session a request belongs to: what the swap policy holds a model
for (swapper/scheduler.py). Read from what clients send, first found wins:

- a session header: Claude Code's `X-Claude-Code-Session-Id`, `x-session-id`,
  Codex's `session_id` / `conversation_id`;
- the body: Anthropic `metadata.user_id` (Claude Code's is JSON carrying a
  `session_id`), Codex's `client_metadata.session_id` or `prompt_cache_key`,
  OpenAI's `user`;
- else the client itself: its address and User-Agent. So two different agents
  on one host are two sessions, and one client that alternates two models
  (Aider's architect and editor) is one session, whose request for the other
  model releases its own hold at once. Two copies of one agent that send no id
  from one host look like one client: they get no holds against each other.

The key is a digest (bounded, and never the id itself in /running or /events).
"""
from __future__ import annotations

import hashlib
import json

SESSION_HEADERS = ("x-claude-code-session-id", "x-session-id", "session_id", "session-id",
                   "conversation_id", "x-codex-session-id")


def session_of(headers, payload: dict | None, client: str | None) -> str:
    """The session key of a request: a 16-hex-digit digest."""
    return hashlib.sha256(_raw(headers, payload, client).encode("utf-8", "replace")
                          ).hexdigest()[:16]


def _raw(headers, payload: dict | None, client: str | None) -> str:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return "h:" + value[:512]
    if isinstance(payload, dict):
        meta = payload.get("metadata")
        uid = meta.get("user_id") if isinstance(meta, dict) else None
        if isinstance(uid, str) and uid:
            try:
                parsed = json.loads(uid) if uid.startswith("{") else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
                return "s:" + parsed["session_id"][:512]
            return "u:" + uid[:512]
        cm = payload.get("client_metadata")
        if isinstance(cm, dict) and isinstance(cm.get("session_id"), str) and cm["session_id"]:
            return "c:" + cm["session_id"][:512]
        for field in ("prompt_cache_key", "user"):
            value = payload.get(field)
            if isinstance(value, str) and value:
                return f"{field}:" + value[:512]
    return f"a:{client or ''}|{(headers.get('user-agent') or '')[:256]}"
