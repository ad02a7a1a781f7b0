"""An upstream's streamed answer without a socket: what the proxy's relays take
from common.http1 (status, headers, the body's reads, close/end), its body the
pieces given, each one read."""
from __future__ import annotations


class StreamAnswer:
    status_code = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, pieces):
        self.pieces = pieces

    def iter_content(self, chunk_size=None):
        yield from self.pieces

    def close(self):
        pass

    end = close                     # common.http1.Answer.end: done at the stream's end
