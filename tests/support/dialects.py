"""A scripted model that also speaks Anthropic Messages and OpenAI Responses.

`ScriptedDialects` is the scripted chat server plus POST /v1/messages and
POST /v1/responses, answering the same `Reply` script in each dialect's exact wire
format: whole objects, or SSE with named events in the order Anthropic's API and
OpenAI's Responses API (and llama.cpp's llama-server) send them. Every request body
lands in `requests` (with its path in `paths`).
"""
from __future__ import annotations

import itertools
import json
import time

from flask import Response, jsonify, request

from .chat import Reply, ScriptedChat, _pieces

_ids = itertools.count(1)
MODEL_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
# The server search tool each non-chat dialect's client sends.
SEARCH_TOOL = {"messages": {"type": "web_search_20250305", "name": "web_search"},
               "responses": {"type": "web_search"}}


class LlamaError:
    """A scripted answer that is an error exactly as llama-server sends it (its
    status, its body's bytes, its content type), in every dialect."""

    def __init__(self, status: int, body: bytes | dict, mimetype: str = "application/json"):
        self.status = status
        self.body = json.dumps(body).encode() if isinstance(body, dict) else body
        self.mimetype = mimetype

    @property
    def error(self) -> str:
        """Its message (where an answer is made from a Reply's `error`)."""
        try:
            return json.loads(self.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return self.body.decode("utf-8", "replace")

    @classmethod
    def template(cls, reason: str = "System message must be at the beginning.") -> "LlamaError":
        """A chat template's raise_exception: tools/server answers 500 server_error."""
        return cls(500, {"error": {"code": 500, "message": f"Jinja Exception: {reason}",
                                   "type": "server_error"}})

    @classmethod
    def context(cls, n: int, ctx: int) -> "LlamaError":
        """A prompt longer than the slot's context (server-context.cpp send_error)."""
        return cls(400, {"error": {
            "code": 400, "message": f"request ({n} tokens) exceeds the available context "
                                    f"size ({ctx} tokens), try increasing it",
            "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": ctx}})


def _sse(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class ScriptedDialects(ScriptedChat):
    def __init__(self, *a, **kw):
        self.paths: list[str] = []
        self.raw: list[bytes] = []       # the bodies' bytes as they arrived
        # errors on /v1/messages: "anthropic" (a backend speaking Messages) or "openai"
        # (the swapper's envelope, e.g. an unknown model)
        self.error_shape = "anthropic"
        # responder(body, path) -> Reply: answers by looking at the request instead of
        # replaying the script (for agents, whose request sequence is theirs to choose)
        self.responder = None
        # Responses events as llama.cpp's llama-server sends them: no output_index,
        # content_index or sequence_number (items are named by id only)
        self.llama_style = False
        # end dialect streams cleanly after this many events (a truncated answer)
        self.truncate_after: int | None = None
        # leave message_start out of Messages streams, as llama-server now and then does
        self.omit_message_start = False
        # a model request waits this long before any answer (llama-server sends a
        # stream's head with its first token, after the prefill) ...
        self.head_delay = 0.0
        # ... or a stream's head goes at once and its first event after this long
        self.event_delay = 0.0
        # per model request, in order of arrival, its head delay (instead of head_delay
        # while entries are left): the first turn's long prefill, say
        self.head_delays: list[float] = []
        self.event_delays: list[float] = []     # likewise, per streamed answer, event_delay
        self.arrivals = 0               # model requests that arrived (before any delay)
        # per model request, in order: (prompt tokens, of which reused from the cache),
        # reported as llama-server does in each dialect (Messages: input_tokens are the
        # uncached ones plus cache_read_input_tokens; Responses: input_tokens_details.
        # cached_tokens; chat: prompt_tokens_details.cached_tokens)
        self.prompt_cache: list[tuple[int, int]] = []
        super().__init__(*a, **kw)

    def _cache(self) -> tuple[int, int] | None:
        with self._lock:
            return self.prompt_cache.pop(0) if self.prompt_cache else None

    def _full(self, r, cid):
        obj = super()._full(r, cid)
        pc = self._cache()
        if pc:
            obj["usage"] = {"completion_tokens": 5, "prompt_tokens": pc[0], "total_tokens":
                            pc[0] + 5, "prompt_tokens_details": {"cached_tokens": pc[1]}}
        return obj

    def _stream(self, r, cid, include_usage):
        pc = self._cache()
        old = b'"usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}'
        new = b'"usage": ' + json.dumps(
            {"completion_tokens": 5, "prompt_tokens": pc[0], "total_tokens": pc[0] + 5,
             "prompt_tokens_details": {"cached_tokens": pc[1]}}).encode() if pc else old
        for piece in super()._stream(r, cid, include_usage):
            yield piece.replace(old, new)

    def _next(self, body: dict):
        with self._lock:
            self.requests.append(body)
            self.paths.append(request.path)
            self.raw.append(request.get_data())
            if self.responder is not None:
                return self.responder(body, request.path)
            return self.replies.pop(0) if self.replies else None

    def _chat_reply(self, body: dict):
        """Chat completions answered like the other dialects (the responder, when set);
        a LlamaError answer is not scripted here."""
        return self._next(body)

    def _make_app(self):
        app = super()._make_app()

        @app.before_request
        def scripted_error_or_delay():
            if request.method != "POST" or request.path not in MODEL_PATHS:
                return None
            with self._lock:
                self.arrivals += 1
                delay = self.head_delays.pop(0) if self.head_delays else self.head_delay
            if delay:
                time.sleep(delay)
            with self._lock:
                nxt = self.replies[0] if self.replies and self.responder is None else None
                if isinstance(nxt, LlamaError):
                    self.replies.pop(0)
                    self.requests.append(request.get_json(force=True))
                    self.paths.append(request.path)
                    self.raw.append(request.get_data())
            if isinstance(nxt, LlamaError):
                return Response(nxt.body, status=nxt.status, mimetype=nxt.mimetype)
            return None

        @app.after_request
        def late_first_event(resp):
            if resp.mimetype != "text/event-stream":
                return resp
            with self._lock:
                delay = self.event_delays.pop(0) if self.event_delays else self.event_delay
            if delay:
                resp.response = self._delayed(resp.response, delay)
            return resp

        @app.post("/v1/messages")
        def messages():
            body = request.get_json(force=True)
            reply = self._next(body)
            if isinstance(reply, LlamaError):
                return Response(reply.body, status=reply.status, mimetype=reply.mimetype)
            if reply is None or reply.status != 200:
                status = 500 if reply is None else reply.status
                msg = "script exhausted" if reply is None else reply.error
                if self.error_shape == "openai":
                    return jsonify({"error": {"message": msg, "type": "not_found_error",
                                              "code": "model_not_found"}}), status
                return jsonify({"type": "error", "error": {"type": "api_error",
                                                           "message": msg}}), status
            mid = f"msg_{next(_ids)}"
            if body.get("stream"):
                return Response(self._messages_stream(reply, mid),
                                mimetype="text/event-stream")
            return jsonify(self._message(reply, mid))

        @app.post("/v1/responses")
        def responses():
            body = request.get_json(force=True)
            reply = self._next(body)
            if isinstance(reply, LlamaError):
                return Response(reply.body, status=reply.status, mimetype=reply.mimetype)
            if reply is None or reply.status != 200:
                status = 500 if reply is None else reply.status
                msg = "script exhausted" if reply is None else reply.error
                return jsonify({"error": {"message": msg, "type": "server_error",
                                          "code": "scripted"}}), status
            rid = f"resp_{next(_ids)}"
            if body.get("stream"):
                return Response(self._responses_stream(reply, rid),
                                mimetype="text/event-stream")
            return jsonify(self._response(reply, rid, "completed", self._items(reply, rid)))

        return app

    @staticmethod
    def _delayed(events, delay: float):
        yield b""                   # the head now (werkzeug sends it on an empty write)
        time.sleep(delay)
        yield from events

    # ------------------------------------------------------------ Anthropic Messages

    @staticmethod
    def _stop(r: Reply) -> str:
        return "tool_use" if r.tool_calls else {"length": "max_tokens"}.get(
            r.finish_reason or "", "end_turn")

    def _blocks(self, r: Reply, mid: str) -> list[dict]:
        blocks = []
        if r.reasoning:
            blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
        if r.content:
            blocks.append({"type": "text", "text": r.content})
        for i, c in enumerate(r.tool_calls):
            blocks.append({"type": "tool_use", "id": f"toolu_{mid}_{i}", "name": c["name"],
                           "input": json.loads(c["arguments"] or "{}")})
        return blocks

    def _message(self, r: Reply, mid: str) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": self.model,
                "content": self._blocks(r, mid), "stop_reason": self._stop(r),
                "stop_sequence": None, "usage": self._messages_usage(self._cache(), 5)}

    @staticmethod
    def _messages_usage(pc, out: int) -> dict:
        if pc is None:
            return {"input_tokens": 10, "output_tokens": out}
        return {"cache_read_input_tokens": pc[1], "input_tokens": pc[0] - pc[1],
                "output_tokens": out}

    def _messages_stream(self, r: Reply, mid: str):
        out = [_sse("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": self._messages_usage(self._cache(), 1)}})]
        if self.omit_message_start:
            out.pop()
        out.append(_sse("ping", {"type": "ping"}))
        for i, b in enumerate(self._blocks(r, mid)):
            if b["type"] == "thinking":
                out.append(_sse("content_block_start", {
                    "type": "content_block_start", "index": i,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
                out += [_sse("content_block_delta", {
                    "type": "content_block_delta", "index": i,
                    "delta": {"type": "thinking_delta", "thinking": p}})
                    for p in _pieces(b["thinking"])]
            elif b["type"] == "text":
                out.append(_sse("content_block_start", {
                    "type": "content_block_start", "index": i,
                    "content_block": {"type": "text", "text": ""}}))
                out += [_sse("content_block_delta", {
                    "type": "content_block_delta", "index": i,
                    "delta": {"type": "text_delta", "text": p}}) for p in _pieces(b["text"])]
            else:
                out.append(_sse("content_block_start", {
                    "type": "content_block_start", "index": i,
                    "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"],
                                      "input": {}}}))
                out += [_sse("content_block_delta", {
                    "type": "content_block_delta", "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": p}})
                    for p in _pieces(json.dumps(b["input"]), 6)]
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        out.append(_sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": self._stop(r),
                                               "stop_sequence": None},
            "usage": {"output_tokens": 5}}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        out = out[:self.truncate_after]
        for i, b in enumerate(out):
            if r.break_after is not None and i >= r.break_after:
                raise ConnectionAbortedError("scripted stream break")
            yield b

    # ------------------------------------------------------------ OpenAI Responses

    def _items(self, r: Reply, rid: str) -> list[dict]:
        items = []
        if r.reasoning:
            items.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": r.reasoning}]})
        if r.content:
            items.append({"type": "message", "id": f"msg_{rid}", "status": "completed",
                          "role": "assistant",
                          "content": [{"type": "output_text", "text": r.content,
                                       "annotations": [], "logprobs": []}]})
        for i, c in enumerate(r.tool_calls):
            items.append({"type": "function_call", "id": f"fc_{rid}_{i}",
                          "call_id": f"call_{rid}_{i}", "name": c["name"],
                          "arguments": c["arguments"], "status": "completed"})
        return items

    def _response(self, r: Reply, rid: str, status: str, output: list) -> dict:
        return {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": status, "error": None, "incomplete_details": None,
                "instructions": None, "max_output_tokens": None, "model": self.model,
                "output": output, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": 1.0, "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
                "metadata": {},
                "usage": None if status != "completed" else self._responses_usage()}

    def _responses_usage(self) -> dict:
        n, cached = self._cache() or (10, 0)
        return {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n + 5}

    def _responses_stream(self, r: Reply, rid: str):
        seq = itertools.count()
        out = []

        def ev(obj):
            obj = {**obj, "sequence_number": next(seq)}
            if self.llama_style:
                for k in ("output_index", "content_index", "sequence_number"):
                    obj.pop(k, None)
            out.append(_sse(obj["type"], obj))

        ev({"type": "response.created", "response": self._response(r, rid, "in_progress", [])})
        ev({"type": "response.in_progress",
            "response": self._response(r, rid, "in_progress", [])})
        items = self._items(r, rid)
        for oi, it in enumerate(items):
            if it["type"] == "message":
                text = it["content"][0]["text"]
                ev({"type": "response.output_item.added", "output_index": oi,
                    "item": {**it, "status": "in_progress", "content": []}})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                ev({"type": "response.content_part.added", "item_id": it["id"],
                    "output_index": oi, "content_index": 0, "part": part})
                for p in _pieces(text):
                    ev({"type": "response.output_text.delta", "item_id": it["id"],
                        "output_index": oi, "content_index": 0, "delta": p, "logprobs": []})
                ev({"type": "response.output_text.done", "item_id": it["id"],
                    "output_index": oi, "content_index": 0, "text": text, "logprobs": []})
                ev({"type": "response.content_part.done", "item_id": it["id"],
                    "output_index": oi, "content_index": 0, "part": it["content"][0]})
            elif it["type"] == "function_call":
                ev({"type": "response.output_item.added", "output_index": oi,
                    "item": {**it, "arguments": "", "status": "in_progress"}})
                for p in _pieces(it["arguments"], 6):
                    ev({"type": "response.function_call_arguments.delta", "item_id": it["id"],
                        "output_index": oi, "delta": p})
                ev({"type": "response.function_call_arguments.done", "item_id": it["id"],
                    "output_index": oi, "arguments": it["arguments"]})
            else:
                ev({"type": "response.output_item.added", "output_index": oi, "item": it})
            ev({"type": "response.output_item.done", "output_index": oi, "item": it})
        ev({"type": "response.completed", "response": self._response(r, rid, "completed", items)})
        out = out[:self.truncate_after]
        for i, b in enumerate(out):
            if r.break_after is not None and i >= r.break_after:
                raise ConnectionAbortedError("scripted stream break")
            yield b

