"""Read an SSE response the way a client does, keeping every event and every read."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from common import queuewait, sse


@dataclass
class Stream:
    events: list = field(default_factory=list)      # parsed JSON of data events
    comments: int = 0                                # keep-alive comments seen
    done: int = 0                                    # number of [DONE]
    reads: list = field(default_factory=list)        # raw bytes of each socket read
    after_done: list = field(default_factory=list)   # anything after [DONE]

    @property
    def chunks(self) -> list[dict]:
        return [e for e in self.events if "choices" in e]

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if "error" in e]

    def text(self, key: str = "content") -> str:
        return "".join((c["choices"][0].get("delta") or {}).get(key) or ""
                       for c in self.chunks if c["choices"])

    def tool_calls(self) -> dict[int, dict]:
        calls: dict[int, dict] = {}
        for c in self.chunks:
            for tc in ((c["choices"] or [{}])[0].get("delta") or {}).get("tool_calls") or []:
                cur = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.get("id") or cur["id"]
                fn = tc.get("function") or {}
                cur["name"] += fn.get("name") or ""
                cur["arguments"] += fn.get("arguments") or ""
        return calls

    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks
                if c["choices"] and c["choices"][0].get("finish_reason")]


def read_stream(resp) -> Stream:
    s = Stream()
    parser = sse.Parser()
    for chunk in resp.iter_content(chunk_size=None):
        s.reads.append(chunk)
        for ev in parser.feed(chunk):
            if s.done:
                s.after_done.append(ev.raw)
            if ev.data is None:
                s.comments += 1
            elif ev.is_done:
                s.done += 1
            else:
                s.events.append(json.loads(ev.data))
    return s


def named_events(resp) -> list[tuple[str | None, dict]]:
    """A streamed answer's data events as (event name or None, JSON), [DONE] left out."""
    out, name = [], None
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append((name, json.loads(line[5:])))
            name = None
    return out


def told_waits(body: bytes) -> tuple[float | None, float | None]:
    """The queue wait and the load seconds a streamed answer's comments tell
    (common/queuewait.py: the first of each; None: not told), read as the proxy
    reads them."""
    wait = load = None
    for evs in sse.read([body]):
        for ev in evs:
            w, ld = queuewait.from_event(ev)
            wait = w if wait is None else wait
            load = ld if load is None else load
    return wait, load
