"""What the proxy's streamed answer path costs per event, in process: a chat
stream of plain text chunks (llama-server's shape) through `dialects.handle` and
the metrics' record (`Metrics.observe`), as the proxy serves it, without the
HTTP hops: with web search (the search round loop relays it) and without (the
straight path). The backend's stream comes one event per read (a client that
keeps up) or 16 per read (a burst); the median and the best round's µs per
event (the best is the steadier figure on a shared machine). A figure, never an
assertion.

    .venv/bin/python -m tests.perf.relaycost [--rounds 15 --events 2000]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time

from proxy import dialects
from proxy.metrics import Metrics
from proxy.record import Record
from proxy.settings import Settings
from tests.support.answers import StreamAnswer

HEAD = {"id": "chatcmpl-x1", "object": "chat.completion.chunk", "created": 1765000000,
        "model": "smollm2", "system_fingerprint": "b1-abc"}


def frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stream(n: int) -> list[bytes]:
    """The backend's events: a role chunk, n text chunks, the finish, [DONE]."""
    def chunk(delta, finish=None):
        return frame({"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                      **HEAD})
    return [chunk({"role": "assistant", "content": None})] + \
        [chunk({"content": f" word{i}"}) for i in range(n)] + \
        [chunk({}, "stop"), b"data: [DONE]\n\n"]


class Upstream:
    def __init__(self, pieces):
        self.pieces = pieces

    def request(self, method, path, **_):
        return StreamAnswer(self.pieces)


class Catalog:
    def lookup(self, model):
        return {}


class Request:
    def __init__(self, raw: bytes):
        self.raw = raw
        self.environ = {}
        self.headers = {}

    def get_data(self):
        return self.raw


def once(settings, pool, pieces, n_events: int) -> float:
    raw = json.dumps({"model": "smollm2", "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
    parts = dict(settings=settings, upstream=Upstream(pieces), catalog=Catalog(), searx=None,
                 metrics=Metrics(), executor=pool)
    rec = Record("/v1/chat/completions", "chat", "POST")
    t = time.perf_counter()
    resp = dialects.handle(dialects.BY_NAME["chat"], parts, Request(raw), rec)
    resp = parts["metrics"].observe(resp, rec)
    for _ in resp.response:
        pass
    resp.response.close()
    return (time.perf_counter() - t) / n_events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--events", type=int, default=2000)
    args = ap.parse_args()
    events = stream(args.events)
    reads = {"1 per read": events,
             "16 per read": [b"".join(events[i:i + 16]) for i in range(0, len(events), 16)]}
    with cf.ThreadPoolExecutor(2) as pool:
        for search in (True, False):
            settings = Settings.from_env({}, WEB_SEARCH=search, WAIT_PROGRESS=True)
            for label, pieces in reads.items():
                per = [once(settings, pool, pieces, len(events)) for _ in range(args.rounds)]
                print(f"{'search' if search else 'straight'}, {label}: median "
                      f"{statistics.median(per) * 1e6:.2f} µs per event, best "
                      f"{min(per) * 1e6:.2f} ({args.rounds} rounds of {len(events)} events)")


if __name__ == "__main__":
    main()
