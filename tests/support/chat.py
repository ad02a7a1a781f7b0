"""A scripted OpenAI-shaped chat server that replays a given sequence of replies.

POST /v1/chat/completions pops the next `Reply` and answers it, streamed as real SSE
chunks (the shapes llama.cpp's llama-server emits) or as one JSON object, and records
every request body. Other paths echo what arrived (method, path, query, headers, body)
so pass-through can be checked byte for byte.
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from flask import Flask, Response, jsonify, request

from .servers import ScriptedServer

_ids = itertools.count(1)


def call(name: str, args) -> dict:
    """A scripted tool call; args as dict (serialised) or raw string."""
    return {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}


def search(query: str) -> dict:
    return call("web_search", {"query": query})


@dataclass
class Reply:
    content: str | None = None
    reasoning: str | None = None
    reasoning_key: str = "reasoning_content"        # vLLM uses "reasoning"
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    status: int = 200                                # != 200: answer an error envelope
    error: str = "scripted failure"
    break_after: int | None = None                   # stream: drop the connection after n chunks
    hold: threading.Event | None = None              # stream: wait for it after the first chunk

    @property
    def finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")


def _pieces(text: str, n: int = 4) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)] or [""]


class ScriptedChat(ScriptedServer):
    def __init__(self, replies=(), model: str = "scripted-model", models: list | None = None):
        self.replies: list[Reply] = list(replies)
        self.model = model
        self.models = models            # /v1/models data entries (None: plain llama-server shape)
        self.requests: list[dict] = []  # chat bodies received
        self.other: list[dict] = []     # echo requests received
        self.models_hits = 0
        self._lock = threading.Lock()
        self.app = self._make_app()

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self.replies = list(replies)
            self.requests.clear()

    def _make_app(self) -> Flask:
        app = Flask("scripted-chat")

        @app.post("/v1/chat/completions")
        def chat():
            body = request.get_json(force=True)
            reply = self._chat_reply(body)
            if reply is None:
                return jsonify({"error": {"message": "script exhausted", "type": "server_error",
                                          "code": None}}), 500
            if reply.status != 200:
                return jsonify({"error": {"message": reply.error, "type": "server_error",
                                          "code": "scripted"}}), reply.status
            cid = f"chatcmpl-{next(_ids)}"
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return Response(self._stream(reply, cid, usage), mimetype="text/event-stream")
            return jsonify(self._full(reply, cid))

        @app.get("/v1/models")
        def models():
            self.models_hits += 1
            data = self.models if self.models is not None else [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "llamacpp"}]
            return jsonify({"object": "list", "data": data})

        @app.get("/healthz")
        def healthz():
            return jsonify({"status": "ok", "scripted": True})

        @app.route("/<path:rest>", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        def echo(rest):
            rec = {"method": request.method, "path": "/" + rest,
                   "query": request.query_string.decode(),
                   "headers": dict(request.headers),
                   "body": request.get_data().decode("utf-8", "replace")}
            with self._lock:
                self.other.append(rec)
            return jsonify(rec), 200, {"X-Echo": "1"}

        return app

    def _chat_reply(self, body: dict):
        with self._lock:
            self.requests.append(body)
            return self.replies.pop(0) if self.replies else None

    def _full(self, r: Reply, cid: str) -> dict:
        msg: dict = {"role": "assistant", "content": r.content}
        if r.reasoning is not None:
            msg[r.reasoning_key] = r.reasoning
        if r.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{cid}_{i}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(r.tool_calls)]
        return {"id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "system_fingerprint": "b0-scripted",
                "choices": [{"index": 0, "message": msg, "finish_reason": r.finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

    def _stream(self, r: Reply, cid: str, include_usage: bool):
        created = int(time.time())

        def chunk(delta, finish=None, **extra):
            obj = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                   "created": created, "id": cid, "model": self.model,
                   "system_fingerprint": "b0-scripted", "object": "chat.completion.chunk"}
            obj.update(extra)
            return ("data: " + json.dumps(obj, separators=(",", ":")) + "\n\n").encode()

        out = [chunk({"role": "assistant", "content": None})]
        if r.reasoning:
            out += [chunk({r.reasoning_key: p}) for p in _pieces(r.reasoning)]
        if r.content:
            out += [chunk({"content": p}) for p in _pieces(r.content)]
        for i, c in enumerate(r.tool_calls):
            out.append(chunk({"tool_calls": [{"index": i, "id": f"call_{cid}_{i}",
                                              "type": "function",
                                              "function": {"name": c["name"],
                                                           "arguments": ""}}]}))
            out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                    for p in _pieces(c["arguments"], 6)]
        out.append(chunk({}, r.finish))
        if include_usage:
            out.append(("data: " + json.dumps({
                "choices": [], "created": created, "id": cid, "model": self.model,
                "object": "chat.completion.chunk",
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
                + "\n\n").encode())
        out.append(b"data: [DONE]\n\n")
        for i, b in enumerate(out):
            if r.break_after is not None and i >= r.break_after:
                raise ConnectionAbortedError("scripted stream break")
            yield b
            if i == 0 and r.hold is not None:
                r.hold.wait(30)

