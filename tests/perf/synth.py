"""A synthetic OpenAI-compatible backend that streams as fast as a socket allows
(standard library only: it runs on the host and in the test bed's stand-in
Python image, started by the swapper like any backend).

    python3 synth.py --port 8080 [--ready-delay 0]

  GET  /health                503 until --ready-delay seconds after start, then 200
  GET  /v1/models             one model, "synth"
  POST /v1/chat/completions   OpenAI chat chunks; the number of chunks is the body's
                              max_tokens (default 16); `perf_interval_ms` paces them
                              (default 0: as fast as the socket takes them) and
                              `perf_first_ms` delays the first (a model's prompt and
                              first token: the headers go at once; non-streamed: the
                              answer). Every
                              chunk is its own HTTP/1.1 chunk and its own send(), as
                              llama-server writes a token. Non-streaming: one answer.
  POST /v1/messages           the same tokens as Anthropic Messages events (message_start
                              ... message_stop, stop_reason max_tokens; llama-server
                              serves this dialect itself, and so does this backend)
  POST /v1/responses          the same as OpenAI Responses events (response.created ...
                              response.incomplete: max_output_tokens reached)
  GET  /perf/stamps           wall-clock stamps: started, ready_at (when /health
                              turns 200), first_health_200 (first 200 served) and
                              first_request (first chat request received)

HTTP/1.1 with keep-alive, one thread per connection, TCP_NODELAY.
"""
from __future__ import annotations

import argparse
import json
import socket
import socketserver
import threading
import time

STAMPS: dict = {"started": time.time()}
_lock = threading.Lock()

# Eight different tokens in turn (LiteLLM ends a stream that repeats one chunk 100 times).
WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dogs")
CHUNKS = [('data: {"id":"chatcmpl-synth","object":"chat.completion.chunk","created":0,'
           '"model":"synth","choices":[{"index":0,"delta":{"content":"%s"},'
           '"finish_reason":null}]}\n\n' % w).encode() for w in WORDS]
LAST = ('data: {"id":"chatcmpl-synth","object":"chat.completion.chunk","created":0,'
        '"model":"synth","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
        ).encode()
DONE = b"data: [DONE]\n\n"


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


_MSG = {"id": "msg_synth", "type": "message", "role": "assistant", "model": "synth",
        "content": [], "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}
_RESP = {"id": "resp_synth", "object": "response", "created_at": 0, "model": "synth",
         "status": "in_progress", "output": []}
_ITEM = {"id": "msg_synth", "type": "message", "role": "assistant", "status": "in_progress",
         "content": []}
# dialect -> (events before the tokens, one event per token, events after them)
DIALECTS = {
    "chat": (b"", CHUNKS, LAST + DONE),
    "messages": (
        _event("message_start", {"type": "message_start", "message": _MSG})
        + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
        [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": w}})
         for w in WORDS],
        _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + _event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": 1}})
        + _event("message_stop", {"type": "message_stop"})),
    "responses": (
        _event("response.created", {"type": "response.created", "response": _RESP})
        + _event("response.output_item.added", {"type": "response.output_item.added",
                                                "output_index": 0, "item": _ITEM})
        + _event("response.content_part.added", {
            "type": "response.content_part.added", "item_id": "msg_synth", "output_index": 0,
            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        [_event("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": "msg_synth", "output_index": 0,
            "content_index": 0, "delta": w}) for w in WORDS],
        _event("response.output_item.done", {
            "type": "response.output_item.done", "output_index": 0,
            "item": {**_ITEM, "status": "incomplete", "content": [
                {"type": "output_text", "text": "".join(WORDS), "annotations": []}]}})
        + _event("response.incomplete", {"type": "response.incomplete", "response": {
            **_RESP, "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}})),
}
PATHS = {"/v1/chat/completions": "chat", "/v1/messages": "messages",
         "/v1/responses": "responses"}
FRAMED = {d: (_framed(first) if first else b"", [_framed(c) for c in each], _framed(last))
          for d, (first, each, last) in DIALECTS.items()}


def _stamp(key: str) -> None:
    with _lock:
        STAMPS.setdefault(key, time.time())


class Handler(socketserver.StreamRequestHandler):
    rbufsize = 65536

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self):
        while True:
            line = self.rfile.readline(65537)
            if not line:
                return
            if line in (b"\r\n", b"\n"):
                continue
            try:
                method, target, _ = line.decode("latin-1").split(" ", 2)
            except ValueError:
                return
            headers = {}
            while True:
                h = self.rfile.readline(65537)
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            body = b""
            n = int(headers.get("content-length") or 0)
            if n:
                body = self.rfile.read(n)
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                body = self._read_chunked()
            close = headers.get("connection", "").lower() == "close"
            if not self.route(method, target.split("?")[0], body, close) or close:
                return

    def _read_chunked(self) -> bytes:
        out = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return out
            out += self.rfile.read(size)
            self.rfile.readline()

    def send(self, status: str, ctype: str, data: bytes, close: bool) -> bool:
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode()
        self.wfile.write(head + data)
        return True

    def route(self, method: str, path: str, body: bytes, close: bool) -> bool:
        if path == "/health":
            now = time.time()
            if now >= STAMPS["ready_at"]:
                _stamp("first_health_200")
                return self.send("200 OK", "application/json", b'{"status":"ok"}', close)
            return self.send("503 Service Unavailable", "application/json",
                             b'{"error":{"code":503,"message":"Loading model",'
                             b'"type":"unavailable_error"}}', close)
        if path == "/perf/stamps":
            with _lock:
                data = json.dumps(STAMPS).encode()
            return self.send("200 OK", "application/json", data, close)
        if path == "/v1/models":
            return self.send("200 OK", "application/json",
                             b'{"object":"list","data":[{"id":"synth","object":"model"}]}', close)
        if path in PATHS and method == "POST":
            _stamp("first_request")
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                return self.send("400 Bad Request", "application/json",
                                 b'{"error":{"message":"bad json","type":"invalid_request_error",'
                                 b'"code":"bad_json"}}', close)
            # n_predict first, as llama-server takes it (the stack raises max_tokens
            # to its tool floor when it injects web_search)
            n = int(req.get("n_predict") or req.get("max_tokens")
                    or req.get("max_output_tokens") or 16)
            if req.get("stream"):
                self.stream(PATHS[path], n, float(req.get("perf_interval_ms") or 0) / 1000.0,
                            float(req.get("perf_first_ms") or 0) / 1000.0)
                return False           # like llama-server: close after a stream
            if req.get("perf_first_ms"):
                time.sleep(float(req["perf_first_ms"]) / 1000.0)    # the whole answer's time
            text = "".join(WORDS[i & 7] for i in range(n))
            if path == "/v1/messages":
                answer = {**_MSG, "content": [{"type": "text", "text": text}],
                          "stop_reason": "max_tokens",
                          "usage": {"input_tokens": 1, "output_tokens": n}}
                return self.send("200 OK", "application/json", json.dumps(answer).encode(),
                                 close)
            if path == "/v1/responses":
                answer = {**_RESP, "status": "incomplete",
                          "incomplete_details": {"reason": "max_output_tokens"},
                          "output": [{**_ITEM, "status": "incomplete", "content": [
                              {"type": "output_text", "text": text, "annotations": []}]}],
                          "usage": {"input_tokens": 1, "output_tokens": n,
                                    "total_tokens": n + 1}}
                return self.send("200 OK", "application/json", json.dumps(answer).encode(),
                                 close)
            answer = {"id": "chatcmpl-synth", "object": "chat.completion", "created": 0,
                      "model": "synth", "choices": [{"index": 0, "finish_reason": "length",
                      "message": {"role": "assistant", "content": "".join(WORDS[i & 7] for i in range(n))}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
            return self.send("200 OK", "application/json", json.dumps(answer).encode(), close)
        return self.send("404 Not Found", "application/json",
                         b'{"error":{"message":"not found","type":"invalid_request_error",'
                         b'"code":"not_found"}}', close)

    def stream(self, dialect: str, n: int, interval: float, first: float = 0.0) -> None:
        sock = self.connection
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        send, sleep = sock.sendall, time.sleep
        head, framed, last = FRAMED[dialect]
        try:
            if first > 0:
                sleep(first)
            if head:
                send(head)
            if interval > 0:
                t = time.monotonic()
                for i in range(n):
                    send(framed[i & 7])
                    t += interval
                    d = t - time.monotonic()
                    if d > 0:
                        sleep(d)
            else:
                for i in range(n):
                    send(framed[i & 7])
            send(last + b"0\r\n\r\n")
        except OSError:
            pass                       # the client went away: stop "generating"


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--ready-delay", type=float, default=0.0)
    a = ap.parse_args()
    STAMPS["ready_at"] = STAMPS["started"] + a.ready_delay
    with Server((a.host, a.port), Handler) as srv:
        print(f"synth listening on {a.host}:{a.port}", flush=True)
        srv.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
