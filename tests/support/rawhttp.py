"""Send a request exactly as written (path as is, chunked, huge lines), the way
`curl --path-as-is` or a hostile client does, and read the answer with the
standard library's HTTP parser."""
from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class RawAnswer:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def envelope(self) -> dict | None:
        """The OpenAI error envelope's inner object, None when the body is not one."""
        try:
            err = self.json()["error"]
        except (ValueError, KeyError, TypeError):
            return None
        if isinstance(err, dict) and isinstance(err.get("message"), str) \
                and isinstance(err.get("type"), str) and "code" in err:
            return err
        return None

    @property
    def anthropic_error(self) -> dict | None:
        """Anthropic's error object ({"type": "error", "error": {type, message}})."""
        try:
            body = self.json()
            err = body["error"]
        except (ValueError, KeyError, TypeError):
            return None
        if body.get("type") == "error" and isinstance(err, dict) \
                and isinstance(err.get("message"), str) and isinstance(err.get("type"), str):
            return err
        return None


def send(url: str, method: str, target: str, headers: dict | None = None,
         body: bytes | None = None, chunks: list[bytes] | None = None,
         timeout: float = 60) -> RawAnswer:
    """One request on a fresh connection. `target` goes on the request line untouched;
    `chunks` sends a chunked body."""
    u = urlsplit(url)
    head = [f"{method} {target} HTTP/1.1", "Connection: close"]
    if not any(k.lower() == "host" for k in (headers or {})):     # a Host of the caller's
        head.insert(1, f"Host: {u.hostname}:{u.port}")
    for k, v in (headers or {}).items():
        head.append(f"{k}: {v}")
    payload = b""
    if chunks is not None:
        head.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"
    elif body is not None:
        head.append(f"Content-Length: {len(body)}")
        payload = body
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass                        # the server answered and closed before reading all
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        data = resp.read()
        return RawAnswer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
