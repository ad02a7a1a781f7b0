"""Agent-friendly request/response fixes: validation, system prompt, max_tokens floor,
reasoning fields served under both names. Pure functions, no I/O."""
from __future__ import annotations

import json
from typing import Iterable, Iterator

from common import guard, sse
from common.errors import ApiError

REASONING_KEYS = ("reasoning_content", "reasoning")


# ---------------------------------------------------------------- validation

def parse_chat_body(raw: bytes) -> dict:
    """Parse and validate a chat completions body; ApiError(400) says what is wrong."""
    if not raw or not raw.strip():
        raise ApiError("request body is empty; expected a JSON object with 'messages'", 400,
                       code="invalid_json")
    body = guard.loads(raw)
    validate_chat(body)
    return body


def _bad(msg: str, param: str | None = None):
    raise ApiError(msg, 400, code="invalid_request", param=param)


def validate_chat(body) -> None:
    """Refuse, with a 400 naming the field, what a backend would answer with a 500
    (or silently misread): wrong types, content parts and tool shapes it cannot take."""
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
        _validate_message(i, m)
    _type(body, "model", str)
    _type(body, "stream", bool)
    _type(body, "tools", list)
    _type(body, "tool_choice", (str, dict))
    _type(body, "stop", (str, list))
    _type(body, "response_format", dict)
    _type(body, "stream_options", dict)
    _type(body, "logit_bias", dict)
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_p"):
        if k in body and body[k] is not None and (not isinstance(body[k], (int, float))
                                                  or isinstance(body[k], bool)):
            _bad(f"'{k}' must be a number, got {type(body[k]).__name__}", k)
    for k in ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "top_logprobs"):
        if k in body and body[k] is not None and (not isinstance(body[k], int)
                                                  or isinstance(body[k], bool)):
            _bad(f"'{k}' must be an integer, got {type(body[k]).__name__}", k)
    if isinstance(body.get("n"), int) and body["n"] < 1:
        _bad(f"'n' must be at least 1, got {body['n']}", "n")
    for i, t in enumerate(body.get("tools") or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            _bad(f"{where} must be an object", where)
        if t.get("type") != "function":
            _bad(f"{where}.type must be \"function\", got {t.get('type')!r}", f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _bad(f"{where}.function.name must be a non-empty string", f"{where}.function")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            _bad(f"{where}.function.parameters must be an object", f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            _bad(f"{where}.function.description must be a string",
                 f"{where}.function.description")
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        fn = tc.get("function")
        if tc.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            _bad("tool_choice as an object must be {\"type\": \"function\", \"function\": "
                 "{\"name\": ...}}", "tool_choice")


# Content part type -> the key holding its payload and the payload's type.
_PARTS = {"text": ("text", str), "image_url": ("image_url", (dict, str)),
          "input_audio": ("input_audio", dict), "file": ("file", dict),
          "refusal": ("refusal", str)}


def _validate_message(i: int, m) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        _bad(f"{where} must be an object, got {type(m).__name__}", where)
    if not isinstance(m.get("role"), str):
        _bad(f"{where}.role must be a string", f"{where}.role")
    c = m.get("content")
    if c is not None and not isinstance(c, (str, list)):
        _bad(f"{where}.content must be a string, a list of parts or null, "
             f"got {type(c).__name__}", f"{where}.content")
    for j, part in enumerate(c if isinstance(c, list) else ()):
        pw = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            _bad(f"{pw} must be an object like {{\"type\": \"text\", \"text\": ...}}", pw)
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in _PARTS:
            _bad(f"{pw}.type must be one of {', '.join(_PARTS)}, got {kind!r}", f"{pw}.type")
        key, typ = _PARTS[kind]
        if not isinstance(part.get(key), typ):
            _bad(f"{pw} of type {kind!r} needs '{key}'", f"{pw}.{key}")
        if kind == "image_url" and isinstance(part[key], dict) and \
                not isinstance(part[key].get("url"), str):
            _bad(f"{pw}.image_url.url must be a string", f"{pw}.image_url.url")
    for k in ("name", "tool_call_id", "reasoning_content"):
        if m.get(k) is not None and not isinstance(m[k], str):
            _bad(f"{where}.{k} must be a string", f"{where}.{k}")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    for j, call in enumerate(calls):
        cw = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            _bad(f"{cw} must be an object", cw)
        if call.get("type") != "function":
            _bad(f"{cw}.type must be \"function\", got {call.get('type')!r}", f"{cw}.type")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            _bad(f"{cw}.function.name must be a string", f"{cw}.function")
        if not isinstance(fn.get("arguments"), str):
            _bad(f"{cw}.function.arguments must be a string (JSON text)",
                 f"{cw}.function.arguments")
        if call.get("id") is not None and not isinstance(call["id"], str):
            _bad(f"{cw}.id must be a string", f"{cw}.id")


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


def clamp_to_context(body: dict, most: int | None,
                     keys=("max_tokens", "max_completion_tokens")) -> bool:
    """Lower a limit above `most` (the model's context, where its backend refuses a
    larger one) to it, so the agent's generous default (OpenCode and Qwen Code send
    32000) is served instead of refused."""
    if not most:
        return False
    changed = False
    for key in keys:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > most:
            body[key] = most
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


def normalize_sse(chunks: Iterable) -> sse.Body:
    """A chat stream (bytes, or an earlier stage's events) with only the events that
    carry a reasoning field changed (both names served); every other event goes out
    as it came. The events a read completes go on together, at once."""
    return sse.Body(_mirrored(sse.events_of(chunks)))


def _mirrored(batches) -> Iterator[list[sse.Event]]:
    try:
        for evs in batches:
            if any(b'"reasoning' in ev.raw for ev in evs):
                evs = [_mirror(ev) for ev in evs]
            yield evs
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _mirror(ev: sse.Event) -> sse.Event:
    if b'"reasoning' not in ev.raw:
        return ev
    obj = ev.json
    if isinstance(obj, dict) and normalize_completion(obj):
        return sse.Event.of(obj)
    return ev
