"""What coding agents send, made into what the model's chat template accepts, with the
prompt's prefix kept byte-stable turn to turn (the backend's prompt cache is an agent's
speed: a miss re-processes the whole ~20k-token conversation).

`fix(dialect, body, info)` runs on the parsed request before the proxy's own changes,
with what the request's dialect declares it takes (its Dialect's `agent_fix`: `fix_chat`,
`fix_messages` or `fix_responses` below; proxy/dialects/base.py):

- Leading system/developer messages become one (joined with "\\n\\n"): they never change
  within a session, so the prefix stays put. Codex opens `input` with two `developer`
  items; the Qwen 3.5/3.6 templates refuse a second system message.
- A system/developer message that is NOT first is converted in place to a user message
  whose text starts with `NOTE` ("[System note]\\n"): Claude Code 2.1.197 sends one inside
  `messages` (after the first user turn), which those templates refuse
  ("System message must be at the beginning."). Never merged into the first system
  message: that would rewrite the prefix every turn. Per model (registry `late_system`):
  `convert` (default), `merge` (convert, then join it to the user message just before it,
  for templates that require user/assistant alternation) or `keep` (the template accepts
  late system messages: pass them through).
- Claude Code's `x-anthropic-billing-header: cc_version=2.1.197.<3 hex>; cc_entrypoint=..;`
  system block is dropped: its suffix follows the session's first prompt (and `cch=`
  changes per request in some versions), so two sessions' system+tools prefixes differed.
  It is billing metadata for Anthropic's API, never an instruction to the model; dropping
  the whole block also covers fields a later version adds (llama.cpp only masks `cch=`).
- Registry `preserve_reasoning: true` sets `chat_template_kwargs.preserve_thinking` (the
  Qwen 3.6 templates' kwarg: earlier turns keep their <think> blocks, so a new user prompt
  re-processes only itself). llama-server passes `chat_template_kwargs` to the template
  in all three dialects (and its `--reasoning-preserve`, on by default, already sets the
  same variable); vLLM takes it on chat completions.

Fields that vary per request but never reach the rendered prompt are left alone:
`metadata.user_id` (llama-server keeps it aside), `cache_control` (moves to the newest
block each turn; templates render only `text`), Codex's `prompt_cache_key`,
`client_metadata` and item `id`s. tests/unit/proxy/test_agents_prefix.py renders captured
sessions through the official Qwen 3.5 template to prove it.

`backend_error(status, body)` turns llama-server's template exceptions and
prompt-longer-than-context errors into a 400 an agent acts on instead of retrying.
"""
from __future__ import annotations

import json
import re

NOTE = "[System note]\n"          # the stable marker a converted late system message starts with
_SYS = ("system", "developer")
_TEXT_PARTS = ("text", "input_text", "output_text")
_BILLING = "x-anthropic-billing-header:"
# the header's `key=value;` pairs (and the newline after them, when text follows)
_BILLING_RE = re.compile(r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\n]*;)*[ \t]*\n?")


def fix(dialect, body: dict, info: dict) -> bool:
    """Make `body` (changed in place) acceptable to the model's template with a stable
    prefix; True when it changed. `dialect`: the request's (proxy/dialects/base.Dialect),
    its declared `agent_fix` the changes its shape takes; `info`: the model's /v1/models
    entry (may be {}). An ordinary request costs one pass over its message roles, no
    copy."""
    mode = (info.get("late_system") if info else None) or "convert"
    changed = dialect.agent_fix(body, mode)
    if info and info.get("preserve_reasoning"):
        changed = _preserve_reasoning(body) or changed
    return changed


# ------------------------------------------------------------------ content helpers

def _text(content) -> str | None:
    """A message's content as the template renders it (parts concatenated), or None
    when it holds anything but text (images: left as they are)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        return None
    out = []
    for p in content:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str):
            out.append(p["text"])
        else:
            return None
    return "".join(out)


def _noted(content, part: str):
    """The content of a late system message as a user message: NOTE first, inside the
    first text part (llama.cpp trims each part, so a part of its own would lose the
    newline)."""
    if isinstance(content, str):
        return NOTE + content
    if isinstance(content, list):
        first = content[0] if content else None
        if isinstance(first, dict) and first.get("type") in _TEXT_PARTS \
                and isinstance(first.get("text"), str):
            first["text"] = NOTE + first["text"]
            return content
        return [{"type": part, "text": NOTE}, *content]
    return NOTE.rstrip("\n")


def _as_content(text: str, like, part: str):
    """`text` in the shape of `like` (a string stays a string, a list becomes one part)."""
    return text if isinstance(like, str) or part == "text" else [{"type": part, "text": text}]


# --------------------------------------------------------------------------- chat

def fix_chat(body: dict, mode: str) -> bool:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or len(msgs) < 2:
        return False
    changed = _merge_leading(msgs, "text")
    if mode != "keep":
        changed = _convert_late(msgs, 1, mode, "text", _chat_user) or changed
    return changed


def _is_sys(m) -> bool:
    return isinstance(m, dict) and m.get("role") in _SYS


def _chat_user(m) -> bool:
    return isinstance(m, dict) and m.get("role") == "user"


def _merge_leading(msgs: list, part: str, start: int = 0) -> bool:
    """msgs[start:k] all system/developer -> msgs[start] holds them all."""
    end = start
    while end < len(msgs) and _is_sys(msgs[end]):
        end += 1
    if end - start < 2:
        return False
    texts = [_text(m.get("content")) for m in msgs[start:end]]
    if any(t is None for t in texts):
        return False
    first = msgs[start]
    first["content"] = _as_content("\n\n".join(texts), first.get("content"), part)
    del msgs[start + 1:end]
    return True


def _convert_late(msgs: list, start: int, mode: str, part: str, plain_user) -> bool:
    """Every system/developer message at index >= start becomes a noted user message
    (mode "merge": joined to a plain user message right before it)."""
    changed = False
    i = start
    while i < len(msgs):
        m = msgs[i]
        if not _is_sys(m):
            i += 1
            continue
        changed = True
        m["role"] = "user"
        m["content"] = _noted(m.get("content"), part)
        prev = msgs[i - 1] if i else None
        if mode == "merge" and plain_user(prev):
            a, b = _text(prev.get("content")), _text(m["content"])
            if a is not None and b is not None:
                prev["content"] = _as_content(a + "\n\n" + b, prev.get("content"), part)
                del msgs[i]
                continue
        i += 1
    return changed


# ------------------------------------------------------------- Anthropic Messages

def fix_messages(body: dict, mode: str) -> bool:
    changed = _drop_billing_header(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return changed
    if _is_sys(msgs[0]):
        changed = _lift_leading_system(body, msgs) or changed
    if mode != "keep":
        changed = _convert_late(msgs, 0, mode, "text", _anthropic_user) or changed
    return changed


def _anthropic_user(m) -> bool:
    """A user message the note can join: not one carrying tool results (llama-server
    would put the text before the results)."""
    if not _chat_user(m):
        return False
    c = m.get("content")
    return isinstance(c, str) or (isinstance(c, list) and not any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in c))


def _drop_billing_header(body: dict) -> bool:
    system = body.get("system")
    if isinstance(system, str):
        if system.startswith(_BILLING):
            body["system"] = _BILLING_RE.sub("", system, count=1)
            return True
        return False
    if not isinstance(system, list):
        return False
    changed = False
    for i in range(len(system) - 1, -1, -1):
        b = system[i]
        text = b.get("text") if isinstance(b, dict) else None
        if isinstance(text, str) and text.startswith(_BILLING):
            rest = _BILLING_RE.sub("", text, count=1)
            if rest.strip():
                b["text"] = rest
            else:
                del system[i]
            changed = True
    return changed


def _lift_leading_system(body: dict, msgs: list) -> bool:
    """System messages opening `messages` join the top-level `system` (llama-server
    would render two system messages)."""
    end = 0
    while end < len(msgs) and _is_sys(msgs[end]):
        end += 1
    texts = [_text(m.get("content")) for m in msgs[:end]]
    if end == len(msgs) or any(t is None for t in texts):
        return False            # nothing but system messages, or images: left as sent
    joined = "\n\n".join(texts)
    system = body.get("system")
    if isinstance(system, list) and system:
        system.append({"type": "text", "text": "\n\n" + joined})
    elif isinstance(system, str) and system:
        body["system"] = system + "\n\n" + joined
    else:
        body["system"] = joined
    del msgs[:end]
    return True


# ---------------------------------------------------------------- OpenAI Responses

def fix_responses(body: dict, mode: str) -> bool:
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return False
    changed = False
    if "instructions" in body and _is_sys(items[0]):
        changed = _fold_into_instructions(body, items)
    else:
        changed = _merge_leading(items, "input_text")
    if mode != "keep":
        # instructions render as the first system message: every item's system is late
        start = 0 if "instructions" in body else 1
        changed = _convert_late(items, start, mode, "input_text", _responses_user) or changed
    return changed


def _responses_user(m) -> bool:
    return _chat_user(m) and m.get("type", "message") == "message"


def _fold_into_instructions(body: dict, items: list) -> bool:
    """`instructions` plus the developer/system items right after it become one
    `instructions` (llama-server makes `instructions` a system message of its own)."""
    end = 0
    while end < len(items) and _is_sys(items[end]):
        end += 1
    texts = [_text(m.get("content")) for m in items[:end]]
    if any(t is None for t in texts):
        return False
    head = body.get("instructions")
    body["instructions"] = "\n\n".join(([head] if isinstance(head, str) and head else []) + texts)
    del items[:end]
    return True


# ------------------------------------------------------------------ reasoning kept

def _preserve_reasoning(body: dict) -> bool:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        body["chat_template_kwargs"] = {"preserve_thinking": True}
        return True
    if isinstance(kw, dict) and "preserve_thinking" not in kw:
        kw["preserve_thinking"] = True
        return True
    return False            # the client's own choice stands


# ------------------------------------------------------------------ backend errors

_CTX_RE = re.compile(r"\((\d+) tokens\).*?\((\d+) tokens\)")


def backend_error(status: int, body: bytes) -> tuple[int, bytes] | None:
    """An error answer of the backend an agent can act on, or None (relay it as is).

    llama-server answers a chat-template exception with 500 `server_error`
    (`Jinja Exception: ...`, JSON or, from its last-resort handler, plain text) and a
    prompt longer than the slot's context with 400 `exceed_context_size_error`
    (`n_prompt_tokens`, `n_ctx`). Claude Code and Codex retry a 500 for minutes; both
    become a 400 `invalid_request_error` in the OpenAI envelope
    `{"error": {"message", "type", "code"}}`, which the caller re-shapes for its dialect:
    - context: code `context_length_exceeded` (OpenAI's), message
      "prompt is too long: N tokens > C maximum ..." (the form Claude Code parses to
      compact the conversation);
    - template: code `chat_template_error`, message naming the template's own words.
    Cheap: a byte search before any parsing; other errors return None.
    """
    if status < 400 or (b"Jinja Exception" not in body and b"exceed_context_size_error" not in body):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {"message": body.decode("utf-8", "replace")}
    if not isinstance(parsed, dict):
        return None
    err = parsed.get("error") if isinstance(parsed.get("error"), dict) else parsed
    message = str(err.get("message") or "")
    if err.get("type") == "exceed_context_size_error" or b"exceed_context_size_error" in body:
        n, ctx = err.get("n_prompt_tokens"), err.get("n_ctx")
        if not (isinstance(n, int) and isinstance(ctx, int)):
            m = _CTX_RE.search(message)
            if not m:
                return None
            n, ctx = int(m.group(1)), int(m.group(2))
        return 400, _envelope(
            f"prompt is too long: {n} tokens > {ctx} maximum (the model's context size); "
            "shorten or compact the conversation, or use a model with a larger context",
            "context_length_exceeded")
    at = message.find("Jinja Exception")
    if at < 0:
        return None
    reason = message[at + len("Jinja Exception"):].lstrip(": ").strip() or message
    return 400, _envelope(f"the model's chat template rejected this conversation: {reason}",
                          "chat_template_error")


def _envelope(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": code}}).encode()
