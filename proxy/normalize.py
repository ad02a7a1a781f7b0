"""Agent-friendly request/response fixes: validation, system prompt, max_tokens floor,
reasoning fields served under both names. Pure functions, no I/O."""
from __future__ import annotations

import json
from typing import Iterable, Iterator

from common import sse
from common.errors import ApiError

REASONING_KEYS = ("reasoning_content", "reasoning")


# ---------------------------------------------------------------- validation

def parse_chat_body(raw: bytes) -> dict:
    """Parse and validate a chat completions body; ApiError(400) says what is wrong."""
    if not raw or not raw.strip():
        raise ApiError("request body is empty; expected a JSON object with 'messages'", 400,
                       code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}", 400, code="invalid_json")
    validate_chat(body)
    return body


def _bad(msg: str, param: str | None = None):
    raise ApiError(msg, 400, code="invalid_request", param=param)


def validate_chat(body) -> None:
    if not isinstance(body, dict):
        _bad(f"request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        _bad("'messages' is required: a list of {role, content} objects", "messages")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        _bad(f"'messages' must be a list, got {type(msgs).__name__}", "messages")
    if not msgs:
        _bad("'messages' must not be empty", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            _bad(f"messages[{i}] must be an object, got {type(m).__name__}", f"messages[{i}]")
        if not isinstance(m.get("role"), str):
            _bad(f"messages[{i}].role must be a string", f"messages[{i}].role")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            _bad(f"messages[{i}].content must be a string, a list of parts or null, "
                 f"got {type(c).__name__}", f"messages[{i}].content")
    _type(body, "model", str)
    _type(body, "stream", bool)
    _type(body, "tools", list)
    _type(body, "tool_choice", (str, dict))
    for k in ("max_tokens", "max_completion_tokens", "n"):
        if k in body and body[k] is not None and (not isinstance(body[k], int)
                                                  or isinstance(body[k], bool)):
            _bad(f"'{k}' must be an integer, got {type(body[k]).__name__}", k)
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict):
            _bad(f"tools[{i}] must be an object", f"tools[{i}]")
        fn = t.get("function")
        if t.get("type", "function") == "function" and (
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            _bad(f"tools[{i}].function.name must be a string", f"tools[{i}].function")


def _type(body: dict, key: str, typ) -> None:
    if key in body and body[key] is not None and not isinstance(body[key], typ):
        names = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
        _bad(f"'{key}' must be {names}, got {type(body[key]).__name__}", key)


# ---------------------------------------------------------------- request fixes

def inject_system_prompt(body: dict, text: str | None) -> bool:
    """Prepend a system message when the conversation does not start with one."""
    if not text:
        return False
    msgs = body["messages"]
    if msgs and msgs[0].get("role") in ("system", "developer"):
        return False
    msgs.insert(0, {"role": "system", "content": text})
    return True


def apply_token_floor(body: dict, floor: int | None,
                      keys=("max_tokens", "max_completion_tokens")) -> bool:
    """With tools present, raise a too-small max_tokens / max_completion_tokens to floor.

    An unset limit stays unset (the backend's default is usually larger than any floor),
    and a larger client value stands.
    """
    if not floor or not body.get("tools"):
        return False
    changed = False
    for key in keys:
        v = body.get(key)
        if isinstance(v, int) and 0 < v < floor:
            body[key] = floor
            changed = True
    return changed


# ---------------------------------------------------------------- response fixes

def mirror_reasoning(d: dict) -> bool:
    """Make `reasoning_content` and `reasoning` both present when either is (in place)."""
    rc, r = d.get("reasoning_content"), d.get("reasoning")
    if rc is not None and r is None:
        d["reasoning"] = rc
        return True
    if r is not None and rc is None:
        d["reasoning_content"] = r
        return True
    return False


def normalize_completion(obj: dict) -> bool:
    changed = False
    for ch in obj.get("choices") or []:
        if isinstance(ch, dict):
            for key in ("message", "delta"):
                if isinstance(ch.get(key), dict):
                    changed |= mirror_reasoning(ch[key])
    return changed


def normalize_completion_bytes(raw: bytes) -> bytes:
    """A full chat response with reasoning mirrored; the same bytes if nothing changes."""
    if b'"reasoning' not in raw:
        return raw
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(obj, dict) and normalize_completion(obj):
        return json.dumps(obj, ensure_ascii=False).encode()
    return raw


def normalize_sse(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Pass an SSE stream through, rewriting only events that carry a reasoning field.

    Complete events are forwarded as soon as they are complete; bytes are not held
    beyond the end of the event they belong to.
    """
    parser = sse.Parser()
    for chunk in chunks:
        if b'"reasoning' not in chunk and not parser._buf and chunk.endswith(b"\n\n"):
            yield chunk          # fast path: whole events, nothing to rewrite
            continue
        out = []
        for ev in parser.feed(chunk):
            out.append(_normalize_event(ev))
        if out:
            yield b"".join(out)
    rest = parser.flush()
    if rest:
        yield b"".join(_normalize_event(ev) for ev in rest)


def _normalize_event(ev: sse.Event) -> bytes:
    if ev.data is None or b'"reasoning' not in ev.raw or ev.is_done:
        return ev.raw
    try:
        obj = json.loads(ev.data)
    except ValueError:
        return ev.raw
    if isinstance(obj, dict) and normalize_completion(obj):
        return sse.emit(obj)
    return ev.raw
