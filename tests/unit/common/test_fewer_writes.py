"""A non-streaming answer costs one send() per hop, head and body together.

On loopback every send() runs the receiver's TCP path and wakes it, so each
extra write on the hot path is a wake-up more in the next process
(docs/performance.md). Streamed answers keep sending their headers at once.
"""
from __future__ import annotations

import socket
import threading

from gunicorn.config import Config
from gunicorn.http import wsgi as gunicorn_wsgi

from common import serve
from common.http1 import Client, Connection


class RecordingSocket:
    def __init__(self, real=None):
        self.real = real
        self.sends: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sends.append(bytes(data))
        if self.real is not None:
            self.real.sendall(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


class Req:
    version = (1, 1)
    headers: list = []

    def __init__(self, method: str = "POST"):
        self.method = method

    def should_close(self) -> bool:
        return False


def respond(headers, pieces, method="POST"):
    sock = RecordingSocket()
    resp = serve.HeadWithBody(Req(method), sock, Config())
    resp.start_response("200 OK", headers)
    for piece in pieces:
        resp.write(piece)
    resp.close()
    return resp, sock.sends


def test_gunicorn_builds_its_responses_from_ours():
    assert gunicorn_wsgi.Response is serve.HeadWithBody


def test_a_known_length_answer_leaves_in_one_send():
    _, sends = respond([("Content-Type", "application/json"), ("Content-Length", "11")],
                       [b'{"ok": true'])
    assert len(sends) == 1
    head, _, body = sends[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: 11" in head
    assert body == b'{"ok": true'


def test_a_streamed_answer_sends_its_headers_with_the_first_chunk():
    resp = serve.HeadWithBody(Req(), sock := RecordingSocket(), Config())
    resp.start_response("200 OK", [("Content-Type", "text/event-stream")])
    resp.write(b"data: 1\n\n")
    resp.write(b"data: 2\n\n")
    resp.close()
    head, _, first = sock.sends[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Transfer-Encoding: chunked" in head
    assert first == b"9\r\ndata: 1\n\n\r\n"
    assert sock.sends[1:] == [b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]


def test_an_empty_write_sends_a_streams_headers_at_once():
    """How an app gets its headers out before it has a body (a model load)."""
    resp = serve.HeadWithBody(Req(), sock := RecordingSocket(), Config())
    resp.start_response("200 OK", [("Content-Type", "text/event-stream")])
    resp.write(b"")
    assert len(sock.sends) == 1 and sock.sends[0].endswith(b"\r\n\r\n")
    resp.write(b"data: 1\n\n")
    resp.close()
    assert sock.sends[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]


def test_a_stream_with_no_body_sends_its_headers_then_its_end():
    resp = serve.HeadWithBody(Req(), sock := RecordingSocket(), Config())
    resp.start_response("200 OK", [("Content-Type", "text/event-stream")])
    resp.close()
    assert len(sock.sends) == 2 and sock.sends[0].endswith(b"\r\n\r\n")
    assert sock.sends[1] == b"0\r\n\r\n"


def test_head_and_an_empty_body_still_send_the_header_block():
    for method, pieces in (("HEAD", [b"ignored"]), ("POST", [])):
        _, sends = respond([("Content-Length", "7")], pieces, method)
        assert len(sends) == 1 and sends[0].endswith(b"\r\n\r\n"), (method, sends)


def test_a_body_short_of_its_length_closes_the_connection():
    """A relayed body that broke off: only the connection's end tells the client."""
    resp, _ = respond([("Content-Length", "100")], [b"partial"])
    assert resp.should_close()
    resp, _ = respond([("Content-Length", "7")], [b"partial"])
    assert not resp.should_close()


def test_a_request_with_a_body_leaves_in_one_send():
    got = []
    srv = socket.create_server(("127.0.0.1", 0))

    def serve_one():
        conn, _ = srv.accept()
        data = b""
        while not data.endswith(b"}"):
            data += conn.recv(65536)
        got.append(data)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: "
                     b"application/json\r\n\r\n{}")
        conn.close()

    t = threading.Thread(target=serve_one, daemon=True)
    t.start()
    client = Client(1)
    port = srv.getsockname()[1]
    sock = socket.create_connection(("127.0.0.1", port))
    client.release(Connection(recorder := RecordingSocket(sock), ("127.0.0.1", port)))
    body = b'{"model": "m", "messages": []}'
    r = client.request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", body=body,
                       headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.content == b"{}"
    t.join(5)
    srv.close()
    assert len(recorder.sends) == 1, recorder.sends
    assert recorder.sends[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert recorder.sends[0].endswith(b"\r\n\r\n" + body)
    assert got == recorder.sends
