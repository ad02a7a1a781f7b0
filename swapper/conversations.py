"""Which conversation a request belongs to, and the last request of each
conversation a model served in its stint: what the prompt caches across swaps
are kept by (swapper/kvcache.py; why this key, and where it can be wrong:
docs/kv-cache.md).

A conversation's key is a hash of what its prompt starts with, in the
dialect's own terms (common/dialects.py): the body's head (Anthropic's
`system`, Responses' `instructions`, the tools) and the messages its
conversation starts with, up to the first answer: the system, developer and
user messages of its first turn (at least its first item). An agent's next
turn appends to its conversation and keeps that start, so it keeps the key;
a side call (a title, a summary, a check) has a system prompt or a first
message of its own, so it has its own key although it shares the session;
two sessions of one agent in one folder (the same instructions and
environment message) differ by their first prompt.
Anthropic's `cache_control` marks, which move turn to turn, are not part of it.

The key only names a saved file and says which request to replay before a
save; which saved prompt serves a request is decided by llama-server itself
(the longest common prefix of tokens, from its RAM prompt cache).
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import orjson

from common.dialects import WIRES

KEY_HEX = 16                     # hex digits of a key (64 bits)
BODY_MAX = 4 << 20               # a body kept for a replay (bytes); larger: none is kept
PROMPT_HEAD = 2048               # characters of a bare completion's prompt that key it
_CLEAN_DEPTH = 4                 # levels where cache_control marks are looked for

# generation route (swapper/intake.py's V1_ROUTES key) -> its dialect
_GENERATION = {next(iter(w.backend)): w for w in WIRES}


@dataclass(frozen=True)
class Conversation:
    key: str                     # KEY_HEX hex digits
    route: str                   # the intake route it came by (chat/completions, ...)
    path: str                    # where it was sent on the backend (v1/chat/completions)
    body: bytes | None           # the body as forwarded; None: too large to keep


def conversation_of(route: str, path: str, payload: dict | None,
                    body: bytes | None) -> Conversation | None:
    """The conversation of a generation request (None: not one, or no
    conversation in it: a bare completion, an empty message list)."""
    if route == "completions" and isinstance(payload, dict):
        return _completion(payload, path, body)
    wire = _GENERATION.get(route)
    if wire is None or not isinstance(payload, dict):
        return None
    items = payload.get(wire.conversation[route])
    if isinstance(items, str):                 # Responses: `input` may be a text
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        return None
    head = [_clean(payload.get(k), 0) for k in wire.head]
    end = 1
    while end < len(items) and _asked(items[end]):
        end += 1
    first = [_clean(item, 0) for item in items[:end]]
    raw = orjson.dumps([wire.name, head, first], option=orjson.OPT_SORT_KEYS)
    key = hashlib.sha256(raw).hexdigest()[:KEY_HEX]
    kept = body if body is not None and len(body) <= BODY_MAX else None
    return Conversation(key, route, path, kept)


def _asked(item) -> bool:
    """Whether a conversation item is the client's (a system, developer or user
    message, text or blocks), not an answer (an assistant message, a tool call,
    reasoning) or a tool's result."""
    return isinstance(item, dict) and item.get("role") in ("system", "developer", "user") \
        and item.get("type", "message") == "message"


def _completion(payload: dict, path: str, body: bytes | None) -> Conversation | None:
    """A bare completion's conversation: its prompt's first PROMPT_HEAD characters
    (a continued text keeps them)."""
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return None
    raw = orjson.dumps(["completions", prompt[:PROMPT_HEAD]])
    kept = body if body is not None and len(body) <= BODY_MAX else None
    return Conversation(hashlib.sha256(raw).hexdigest()[:KEY_HEX], "completions", path, kept)


def _clean(value, depth: int):
    """`value` without Anthropic's `cache_control` marks (where they go: a block
    of a message's content, of `system`, a tool), at the first levels only."""
    if depth >= _CLEAN_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: _clean(v, depth + 1) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_clean(v, depth + 1) for v in value]
    return value


def replay_body(conv: Conversation) -> bytes | None:
    """The conversation's last request asking for one token, not streamed: sent
    before a save, it brings that conversation's prompt back into the slot from
    llama-server's RAM prompt cache (a few tokens processed). None: nothing to
    replay."""
    if conv.body is None:
        return None
    try:
        payload = orjson.loads(conv.body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    for k in ("stream", "stream_options", "return_progress", "max_tokens",
              "max_completion_tokens", "max_output_tokens", "n_predict", "n"):
        payload.pop(k, None)
    wire = _GENERATION.get(conv.route)
    payload[wire.answer_cap if wire is not None else "max_tokens"] = 1
    return orjson.dumps(payload)


@dataclass
class Stint:
    """What one model served since it was loaded."""
    conversations: list[tuple[Conversation, float]]   # each one's last request, newest last
    last: Conversation | None        # the last request's (None: one of no conversation)
    last_at: float                   # when it was admitted (wall clock)


class Book:
    """The conversations each model served since it was loaded, their last
    request each, newest last; at most `limit` per model (the least recently
    served go first: a client inventing a conversation per request pushes out
    only conversations, never more memory)."""

    def __init__(self, limit: int, wall=time.time):
        self.limit = limit
        self._wall = wall
        self._lock = threading.Lock()
        self._stints: dict[str, tuple[OrderedDict[str, tuple[Conversation, float]],
                                      list]] = {}

    def served(self, model: str, conv: Conversation | None) -> None:
        """A request of `model` (of `conv`; None: of none) was admitted."""
        now = self._wall()
        with self._lock:
            book, last = self._stints.setdefault(model, (OrderedDict(), [None, now]))
            last[:] = [conv, now]
            if conv is None:
                return
            book.pop(conv.key, None)
            book[conv.key] = (conv, now)
            while len(book) > max(self.limit, 1):
                book.popitem(last=False)

    def take(self, model: str) -> Stint | None:
        """What `model` served since it was loaded (None: nothing), forgotten
        here: its stint is over."""
        with self._lock:
            found = self._stints.pop(model, None)
        if found is None:
            return None
        book, (last, at) = found
        return Stint(list(book.values()), last, at)

    def forget(self, model: str) -> None:
        with self._lock:
            self._stints.pop(model, None)
