"""What a request to the swapper's `/v1/...` and `/load` asks for, decided before
anything is queued, loaded or evicted.

- Only the OpenAI-style paths a backend serves are forwarded, with their methods
  (V1_ROUTES). Any other path is a 404, a wrong method a 405, both answered at
  once: a request that cannot succeed never starts or evicts a model.
- The model is read from a JSON body whatever its Content-Type (`curl -d` sends
  application/x-www-form-urlencoded). A body on a JSON path that is not a JSON
  object, or a `model` that is not a string, is a 400.
- A request that names no model goes to the model that is resident (or loading)
  when there is one, else to the default model: it never causes a swap.
- Image parts sent to a model whose registry entry lacks `vision: true` are a
  400 (a text-only llama-server answers them with a 500).
- `/upstream/<model>/<path>` forwards the backend's read-only paths only
  (UPSTREAM_ROUTES): slot actions (save, restore, erase), `POST /props` and any
  other admin path are the swapper's alone (403), refused before anything is
  admitted or loaded; an OPTIONS is answered here, a HEAD refused (405): neither
  ever loads a model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from common import guard
from common.dialects import WIRES
from common.errors import ApiError

# path under /v1/ (a regex) -> methods a backend answers on it: the dialects'
# (common/dialects.py) and the other OpenAI-style paths.
V1_ROUTES: dict[str, frozenset[str]] = {
    r"models": frozenset({"GET"}),             # answered by the swapper itself
    r"models/.+": frozenset({"GET"}),
    **{p: m for w in WIRES for p, m in w.backend.items()},
    r"completions": frozenset({"POST"}),
    r"embeddings": frozenset({"POST"}),
    r"rerank": frozenset({"POST"}),
    r"reranking": frozenset({"POST"}),
    r"score": frozenset({"POST"}),
    r"classify": frozenset({"POST"}),
    r"audio/transcriptions": frozenset({"POST"}),
    r"audio/translations": frozenset({"POST"}),
}
# route -> the body's key holding its conversation (where images are looked for)
_CONVERSATION = {r: key for w in WIRES for r, key in w.conversation.items()}
_COMPILED = [(re.compile(p + r"/?"), p, m) for p, m in V1_ROUTES.items()]
# Multipart uploads: the model is not read from them (it goes to the resident model).
_NOT_JSON = ("audio/transcriptions", "audio/translations")


# /upstream/<model>/<path>: the path exactly as sent (no percent-encoding, no
# trailing slash) -> methods forwarded. Read-only: the slot actions
# (`slots/<id>?action=save|restore|erase`) write, read back and erase files of the
# KV-cache folder and other sessions' prompt caches; they are the swapper's
# (swapper/kvcache.py) and never a client's.
UPSTREAM_ROUTES: dict[str, frozenset[str]] = {
    "health": frozenset({"GET"}),
    "v1/health": frozenset({"GET"}),
    "props": frozenset({"GET"}),
    "slots": frozenset({"GET"}),
    "metrics": frozenset({"GET"}),
    "models": frozenset({"GET"}),
    "v1/models": frozenset({"GET"}),
    "tokenize": frozenset({"POST"}),
    "detokenize": frozenset({"POST"}),
    "apply-template": frozenset({"POST"}),
}


def upstream_methods(raw_path: str) -> list[str] | None:
    """Methods /upstream/<model>/`raw_path` answers (OPTIONS: answered by the
    swapper), None when that path is not forwarded."""
    methods = UPSTREAM_ROUTES.get(raw_path)
    return sorted(methods | {"OPTIONS"}) if methods else None


def check_upstream(raw_path: str, method: str) -> None:
    """Refuse an /upstream request that is not a read-only path of the backend
    (403), or a method that path does not take (405), in the envelope."""
    methods = UPSTREAM_ROUTES.get(raw_path)
    if methods is None:
        served = "; ".join(f"{' '.join(sorted(m))} {p}" for p, m in UPSTREAM_ROUTES.items())
        raise ApiError(f"/upstream/<model>/{raw_path[:100]} is not forwarded: /upstream serves "
                       f"the backend's read-only paths only ({served}); slot actions and "
                       "other admin paths are the swapper's", 403, code="upstream_forbidden",
                       type_="permission_error")
    if method not in methods:
        allow = ", ".join(sorted(methods | {"OPTIONS"}))
        raise ApiError(f"method {method} is not allowed on /upstream/<model>/{raw_path}; use "
                       f"{' or '.join(sorted(methods))}", 405, code="method_not_allowed",
                       headers={"Allow": allow})


@dataclass
class V1Request:
    route: str                     # the V1_ROUTES key it matched
    payload: dict | None           # the JSON body, when the route takes one
    model: str | None              # the model it names, if any


def route_of(path: str, method: str) -> str:
    """The V1_ROUTES key `path` (under /v1/) matches; 404 or 405 in the envelope."""
    allowed: set[str] = set()
    for rx, key, methods in _COMPILED:
        if rx.fullmatch(path):
            if method in methods:
                return key
            allowed |= methods
    if allowed:
        raise ApiError(f"method {method} is not allowed on /v1/{path}; use "
                       f"{' or '.join(sorted(allowed))}", 405, code="method_not_allowed",
                       headers={"Allow": ", ".join(sorted(allowed | {"OPTIONS"}))})
    raise ApiError(f"no such endpoint: /v1/{path} (served: POST /v1/chat/completions, "
                   "/v1/completions, /v1/embeddings, /v1/responses, /v1/messages, "
                   "/v1/rerank; GET /v1/models)", 404, code="unknown_endpoint")


def allowed_methods(path: str) -> list[str] | None:
    """Methods served on `path` (for OPTIONS), None when the path is unknown."""
    allowed: set[str] = set()
    for rx, _key, methods in _COMPILED:
        if rx.fullmatch(path):
            allowed |= methods
    return sorted(allowed | {"OPTIONS"}) if allowed else None


def parse_v1(path: str, method: str, body: bytes) -> V1Request:
    route = route_of(path, method)
    if method != "POST" or route in _NOT_JSON:
        return V1Request(route, None, None)
    if not body or not body.strip():
        raise ApiError(f"POST /v1/{path} needs a JSON object body", 400, code="invalid_json")
    payload = guard.loads(body)
    if not isinstance(payload, dict):
        raise ApiError(f"request body must be a JSON object, got {_kind(payload)}", 400,
                       code="invalid_request")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {_kind(model)}", 400,
                       code="invalid_request", param="model")
    return V1Request(route, payload, model or None)


def target_model(req: V1Request, method: str, path: str, resident: str | None) -> str | None:
    """The model a /v1 request goes to: the one it names; else the resident one
    (no swap); else None, the default model. A lookup (GET/DELETE, e.g. a stored
    response) with nothing loaded is a 404: it lived in a backend, and none runs."""
    if req.model is not None:
        return req.model
    if resident is None and method in ("GET", "DELETE"):
        raise ApiError(f"/v1/{path}: no model is loaded, so there is nothing to look up", 404,
                       code="not_found")
    return resident


def load_target(name: str | None, body: bytes) -> str | None:
    """The model `/load` is asked for: from the path, else a JSON body
    `{"model": "..."}` (any Content-Type); None (the default model) when neither."""
    if name is not None or not body or not body.strip():
        return name
    payload = guard.loads(body)
    if not isinstance(payload, dict):
        raise ApiError(f"/load takes a JSON object like {{\"model\": \"<id>\"}}, got "
                       f"{_kind(payload)}", 400, code="invalid_request")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {_kind(model)}", 400,
                       code="invalid_request", param="model")
    return model or None


def require_vision(model_id: str, vision: bool, route: str, payload: dict | None) -> None:
    """400 when a text-only model is sent image parts."""
    if vision or payload is None or not _has_images(route, payload):
        return
    raise ApiError(f"model '{model_id}' takes no images (its registry entry has no "
                   "`vision: true`); send text only or use a vision model", 400,
                   code="model_not_multimodal")


_IMAGE_PARTS = {"image_url", "input_image", "image"}


def _has_images(route: str, payload: dict) -> bool:
    key = _CONVERSATION.get(route)
    if key is None:
        return False
    items = payload.get(key)
    if not isinstance(items, list):
        return False
    for item in items:
        if not isinstance(item, dict):
            continue
        if _is_image(item):
            return True
        content = item.get("content")
        if isinstance(content, list) and any(_is_image(p) for p in content):
            return True
    return False


def _is_image(part) -> bool:
    return isinstance(part, dict) and isinstance(part.get("type"), str) and \
        part["type"] in _IMAGE_PARTS


def _kind(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "a number", float: "a number"}.get(type(v), type(v).__name__)
