"""Anthropic Messages and OpenAI Responses for a backend that only speaks chat
completions.

`send()` posts a dialect request to the backend's own dialect path; when the backend
answers that it has no such path (404/405/501 that is not "unknown model"), it
remembers that for the model and from then on sends the request translated to
`/v1/chat/completions`, handing back a `Translated` response that looks like the
backend had answered in the dialect (same status, JSON or SSE bytes), so the
dialect's search loop and pass-through work on it unchanged. Both pinned backends
(llama.cpp's llama-server, vLLM >= 0.11) serve the dialects themselves; this is for
any other OpenAI-compatible server put in the registry.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Iterator

import requests

from common import guard, sse

from ..search.engine import new_id

log = logging.getLogger("proxy.dialects")

CHAT_PATH = "/v1/chat/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"


def message_start(msg_id: str, model) -> bytes:
    """An Anthropic stream's message_start: an empty assistant message, no usage yet."""
    return sse.event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}}})


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content or []:
        if isinstance(b, dict) and isinstance(b.get("text"), str):
            out.append(b["text"])
        elif isinstance(b, str):
            out.append(b)
    return "".join(out)


def _copy(src: dict, dst: dict, keys) -> None:
    for k in keys:
        if src.get(k) is not None:
            dst[k] = src[k]


# ================================================================= requests

def messages_to_chat(body: dict) -> dict:
    out: dict = {"model": body.get("model"), "stream": bool(body.get("stream"))}
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    _copy(body, out, ("max_tokens", "temperature", "top_p", "top_k", "metadata"))
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    msgs: list[dict] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": _text_of(body["system"])})
    for m in body.get("messages") or []:
        role, c = m.get("role"), m.get("content")
        if isinstance(c, str):
            msgs.append({"role": role, "content": c})
            continue
        if role == "assistant":
            a: dict = {"role": "assistant", "content": None}
            text = "".join(b.get("text") or "" for b in c if b.get("type") == "text")
            think = "".join(b.get("thinking") or "" for b in c if b.get("type") == "thinking")
            calls = [{"id": b.get("id"), "type": "function",
                      "function": {"name": b.get("name"),
                                   "arguments": json.dumps(b.get("input") or {})}}
                     for b in c if b.get("type") == "tool_use"]
            a["content"] = text or None
            if think:
                a["reasoning_content"] = think
            if calls:
                a["tool_calls"] = calls
            msgs.append(a)
            continue
        parts = []
        for b in c:
            t = b.get("type")
            if t == "tool_result":
                text = _text_of(b.get("content"))
                if b.get("is_error"):
                    text = "Error: " + text
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": text})
            elif t == "text":
                parts.append({"type": "text", "text": b.get("text") or ""})
            elif t == "image" and isinstance(b.get("source"), dict):
                src = b["source"]
                url = src.get("url") if src.get("type") == "url" else \
                    f"data:{src.get('media_type')};base64,{src.get('data')}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
        if parts:
            only_text = all(p["type"] == "text" for p in parts)
            msgs.append({"role": role, "content": "".join(p["text"] for p in parts)
                         if only_text else parts})
    out["messages"] = msgs
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description") or "",
        "parameters": t.get("input_schema") or {"type": "object"}}}
        for t in body.get("tools") or [] if isinstance(t, dict) and "input_schema" in t]
    if tools:
        out["tools"] = tools
        tc = body.get("tool_choice")
        if isinstance(tc, dict):
            kind = tc.get("type")
            if kind == "any":
                out["tool_choice"] = "required"
            elif kind == "tool":
                out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
            elif kind in ("auto", "none"):
                out["tool_choice"] = kind
            if tc.get("disable_parallel_tool_use"):
                out["parallel_tool_calls"] = False
    return out


def responses_to_chat(body: dict) -> dict:
    out: dict = {"model": body.get("model"), "stream": bool(body.get("stream"))}
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    _copy(body, out, ("temperature", "top_p", "parallel_tool_calls", "metadata"))
    if body.get("max_output_tokens"):
        out["max_tokens"] = body["max_output_tokens"]
    msgs: list[dict] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    items = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) \
        else inp or []
    for it in items:
        if not isinstance(it, dict):
            continue
        t = it.get("type") or ("message" if "role" in it else None)
        if t == "message":
            c = it.get("content")
            if isinstance(c, list):
                parts = []
                for p in c:
                    if not isinstance(p, dict):
                        continue
                    if p.get("type") in ("input_text", "output_text", "text"):
                        parts.append({"type": "text", "text": p.get("text") or ""})
                    elif p.get("type") == "input_image" and p.get("image_url"):
                        parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
                c = "".join(p["text"] for p in parts) \
                    if all(p["type"] == "text" for p in parts) else parts
            role = it.get("role") or "user"
            msgs.append({"role": "system" if role == "developer" else role, "content": c})
        elif t == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments") or ""}}
            last = msgs[-1] if msgs else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif t == "function_call_output":
            o = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": o if isinstance(o, str) else _text_of(o)})
    out["messages"] = msgs
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description") or "",
        "parameters": t.get("parameters") or {"type": "object"}}}
        for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        out["tools"] = tools
        tc = body.get("tool_choice")
        if tc in ("auto", "none", "required"):
            out["tool_choice"] = tc
        elif isinstance(tc, dict) and tc.get("type") == "function":
            out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    return out


# ================================================================= whole answers

def _chat_message(obj: dict) -> tuple[dict, str | None, dict]:
    ch = (obj.get("choices") or [{}])[0]
    return ch.get("message") or {}, ch.get("finish_reason"), obj.get("usage") or {}


def _reasoning(msg: dict) -> str:
    return msg.get("reasoning_content") or msg.get("reasoning") or ""


STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn",
                "content_filter": "refusal"}


def chat_to_message(obj: dict, model) -> dict:
    msg, finish, usage = _chat_message(obj)
    blocks = []
    if _reasoning(msg):
        blocks.append({"type": "thinking", "thinking": _reasoning(msg), "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": c.get("id") or new_id("toolu_"),
                       "name": fn.get("name"), "input": args if isinstance(args, dict) else {}})
    return {"id": "msg_" + str(obj.get("id") or new_id("")), "type": "message",
            "role": "assistant", "model": obj.get("model") or model, "content": blocks,
            "stop_reason": "tool_use" if msg.get("tool_calls")
            else STOP_REASONS.get(finish or "stop", "end_turn"),
            "stop_sequence": None,
            "usage": {"input_tokens": usage.get("prompt_tokens") or 0,
                      "output_tokens": usage.get("completion_tokens") or 0}}


def _resp_usage(usage: dict) -> dict:
    i, o = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": i + o}


def _response_obj(rid: str, model, status: str, output: list, usage: dict | None) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": model, "output": output, "usage": usage}


def chat_to_response(obj: dict, model) -> dict:
    msg, finish, usage = _chat_message(obj)
    rid = "resp_" + str(obj.get("id") or new_id(""))
    output = []
    if _reasoning(msg):
        output.append({"type": "reasoning", "id": new_id("rs_"), "summary": [],
                       "content": [{"type": "reasoning_text", "text": _reasoning(msg)}]})
    if msg.get("content"):
        output.append({"type": "message", "id": new_id("msg_"), "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": msg["content"],
                                    "annotations": []}]})
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        output.append({"type": "function_call", "id": new_id("fc_"),
                       "call_id": c.get("id") or new_id("call_"), "name": fn.get("name"),
                       "arguments": fn.get("arguments") or "", "status": "completed"})
    return _response_obj(rid, obj.get("model") or model,
                         "incomplete" if finish == "length" else "completed", output,
                         _resp_usage(usage))


# ================================================================= streams

def _chunks(resp: requests.Response) -> Iterator[dict]:
    for name, obj in sse.json_events(resp.iter_content(chunk_size=None)):
        if name != ":":
            yield obj


def stream_messages(resp: requests.Response, model) -> Iterator[bytes]:
    """A chat completions stream as Anthropic's Messages events."""
    index = -1
    open_kind = None              # "thinking" | "text" | ("tool", n)
    finish, usage, started, has_tools = None, {}, False, False

    def close():
        nonlocal open_kind
        if open_kind is not None:
            open_kind = None
            return [sse.event("content_block_stop", {"type": "content_block_stop", "index": index})]
        return []

    def start(kind, block):
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(sse.event("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": block}))
        return out

    for obj in _chunks(resp):
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
            yield sse.event("error", {"type": "error", "error": {
                "type": "api_error", "message": str(err.get("message"))}})
            return
        if not started:
            started = True
            yield message_start("msg_" + str(obj.get("id") or new_id("")),
                                obj.get("model") or model)
        if obj.get("usage"):
            usage = obj["usage"]
        for ch in obj.get("choices") or []:
            d = ch.get("delta") or {}
            r = d.get("reasoning_content") or d.get("reasoning")
            if r:
                if open_kind != "thinking":
                    yield from start("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
                yield sse.event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "thinking_delta",
                                                            "thinking": r}})
            if d.get("content"):
                if open_kind != "text":
                    yield from start("text", {"type": "text", "text": ""})
                yield sse.event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "text_delta",
                                                            "text": d["content"]}})
            for tc in d.get("tool_calls") or []:
                has_tools = True
                fn = tc.get("function") or {}
                kind = ("tool", tc.get("index", 0))
                if open_kind != kind:
                    yield from start(kind, {"type": "tool_use",
                                            "id": tc.get("id") or new_id("toolu_"),
                                            "name": fn.get("name") or "", "input": {}})
                if fn.get("arguments"):
                    yield sse.event("content_block_delta", {
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": fn["arguments"]}})
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    if not started:
        yield sse.event("error", {"type": "error", "error": {
            "type": "api_error", "message": "the upstream stream ended without an answer"}})
        return
    yield from close()
    yield sse.event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use" if has_tools
                  else STOP_REASONS.get(finish or "stop", "end_turn"), "stop_sequence": None},
        "usage": {"input_tokens": usage.get("prompt_tokens") or 0,
                  "output_tokens": usage.get("completion_tokens") or 0}})
    yield sse.event("message_stop", {"type": "message_stop"})


def stream_responses(resp: requests.Response, model) -> Iterator[bytes]:
    """A chat completions stream as OpenAI Responses events."""
    seq = 0
    rid = new_id("resp_")
    output: list[dict] = []
    cur: dict | None = None          # the open output item
    text = ""
    finish, usage = None, {}

    def ev(obj):
        nonlocal seq
        obj = {**obj, "sequence_number": seq}
        seq += 1
        return sse.event(obj["type"], obj)

    def close():
        nonlocal cur, text
        if cur is None:
            return []
        oi, out = len(output), []
        if cur["type"] == "reasoning":
            cur["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(ev({"type": "response.reasoning_text.done", "item_id": cur["id"],
                           "output_index": oi, "content_index": 0, "text": text}))
        elif cur["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            cur["content"] = [part]
            out += [ev({"type": "response.output_text.done", "item_id": cur["id"],
                        "output_index": oi, "content_index": 0, "text": text}),
                    ev({"type": "response.content_part.done", "item_id": cur["id"],
                        "output_index": oi, "content_index": 0, "part": part})]
        else:
            out.append(ev({"type": "response.function_call_arguments.done",
                           "item_id": cur["id"], "output_index": oi,
                           "arguments": cur["arguments"]}))
        cur["status"] = "completed"
        cur.pop("_index", None)
        out.append(ev({"type": "response.output_item.done", "output_index": oi, "item": cur}))
        output.append(cur)
        cur, text = None, ""
        return out

    head = _response_obj(rid, model, "in_progress", [], None)
    yield ev({"type": "response.created", "response": head})
    yield ev({"type": "response.in_progress", "response": head})
    for obj in _chunks(resp):
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
            yield ev({"type": "response.failed", "response": {
                **head, "status": "failed", "output": output,
                "error": {"code": "upstream_error", "message": str(err.get("message"))}}})
            return
        if obj.get("usage"):
            usage = obj["usage"]
        for ch in obj.get("choices") or []:
            d = ch.get("delta") or {}
            r = d.get("reasoning_content") or d.get("reasoning")
            if r:
                if cur is None or cur["type"] != "reasoning":
                    yield from close()
                    cur = {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                           "content": []}
                    yield ev({"type": "response.output_item.added",
                              "output_index": len(output), "item": dict(cur)})
                text += r
                yield ev({"type": "response.reasoning_text.delta", "item_id": cur["id"],
                          "output_index": len(output), "content_index": 0, "delta": r})
            if d.get("content"):
                if cur is None or cur["type"] != "message":
                    yield from close()
                    cur = {"type": "message", "id": new_id("msg_"), "status": "in_progress",
                           "role": "assistant", "content": []}
                    yield ev({"type": "response.output_item.added",
                              "output_index": len(output), "item": dict(cur)})
                    yield ev({"type": "response.content_part.added", "item_id": cur["id"],
                              "output_index": len(output), "content_index": 0,
                              "part": {"type": "output_text", "text": "", "annotations": []}})
                text += d["content"]
                yield ev({"type": "response.output_text.delta", "item_id": cur["id"],
                          "output_index": len(output), "content_index": 0,
                          "delta": d["content"]})
            for tc in d.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if cur is None or cur["type"] != "function_call" or \
                        cur["_index"] != tc.get("index", 0):
                    yield from close()
                    cur = {"type": "function_call", "id": new_id("fc_"),
                           "call_id": tc.get("id") or new_id("call_"),
                           "name": fn.get("name") or "", "arguments": "",
                           "status": "in_progress", "_index": tc.get("index", 0)}
                    item = {k: v for k, v in cur.items() if k != "_index"}
                    yield ev({"type": "response.output_item.added",
                              "output_index": len(output), "item": item})
                if fn.get("arguments"):
                    cur["arguments"] += fn["arguments"]
                    yield ev({"type": "response.function_call_arguments.delta",
                              "item_id": cur["id"], "output_index": len(output),
                              "delta": fn["arguments"]})
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    yield from close()
    status = "incomplete" if finish == "length" else "completed"
    final = _response_obj(rid, model, status, output, _resp_usage(usage))
    yield ev({"type": "response.incomplete" if status == "incomplete"
              else "response.completed", "response": final})


# ================================================================= the switch

class Translated:
    """A chat completions response dressed as the dialect's (what the loops and the
    pass-through read of a requests.Response)."""

    def __init__(self, chat: requests.Response, path: str, stream: bool, model):
        self.chat = chat
        self.status_code = chat.status_code
        self.path = path
        self.stream = stream
        self.model = model
        self.headers = {"Content-Type": "text/event-stream" if stream and self.ok
                        else "application/json"}
        self._content: bytes | None = None
        self._translated = False          # the chat stream was translated to its end

    @property
    def ok(self) -> bool:
        return self.chat.status_code == 200

    @property
    def body_arrived(self) -> bool:
        return self.chat.body_arrived

    @property
    def content(self) -> bytes:
        if self._content is None:
            if not self.ok:
                self._content = self.chat.content
            elif self.stream:
                self._content = b"".join(self.iter_content())
            else:
                obj = self.chat.json()
                out = chat_to_message(obj, self.model) if self.path == MESSAGES else \
                    chat_to_response(obj, self.model)
                self._content = json.dumps(out, ensure_ascii=False).encode()
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)

    def iter_content(self, chunk_size=None) -> Iterator[bytes]:
        if self._content is not None or not (self.ok and self.stream):
            yield self.content
            return
        gen = stream_messages if self.path == MESSAGES else stream_responses
        yield from gen(self.chat, self.model)
        self._translated = True

    def end(self) -> None:
        self.chat.end()

    def close(self) -> None:
        if self._translated:
            self.chat.end()         # read to its [DONE]: see common.http1.Answer.end
        else:
            self.chat.close()


def lacks_dialect(r) -> bool:
    """The backend has no such path (not: it does not know the model)."""
    if r.status_code not in (404, 405, 501):
        return False
    try:
        err = r.json().get("error")
        if isinstance(err, dict) and err.get("code") == "model_not_found":
            return False
    except (ValueError, AttributeError):
        pass
    return True


def send(upstream, path: str, body: dict, data: bytes, *, headers, stream: bool,
         chat_only: set, environ=None):
    """POST a dialect request: to the backend's own path, or translated to chat
    completions for a model whose backend lacks it (found out once, then remembered)."""
    key = (path, body.get("model"))
    if key not in chat_only:
        r = upstream.request("POST", path, headers=headers, data=data, stream=stream,
                             environ=environ, read_body=not stream)
        if not lacks_dialect(r):
            return r
        r.close()
        chat_only.add(key)
        log.info("model %r: the backend has no %s; translating to chat completions",
                 body.get("model"), path)
    conv = messages_to_chat(body) if path == MESSAGES else responses_to_chat(body)
    chat = upstream.request("POST", CHAT_PATH, headers=headers,
                            data=guard.dumps(conv),
                            stream=stream, environ=environ, read_body=not stream)
    return Translated(chat, path, stream, body.get("model"))
