"""Ask the proxy a chat question, streamed or not, and reduce the answer to one shape."""
from __future__ import annotations

import requests

from tests.support.sseclient import read_stream


def ask(base: str, body: dict, stream: bool, headers: dict | None = None) -> dict:
    body = {"model": "scripted-model", **body, "stream": stream}
    r = requests.post(base + "/v1/chat/completions", json=body, stream=stream,
                      headers=headers, timeout=60)
    out = {"status": r.status_code, "headers": r.headers}
    if r.status_code != 200 or not stream:
        out["json"] = r.json()
        if r.status_code == 200:
            ch = out["json"]["choices"][0]
            msg = ch["message"]
            out.update(content=msg.get("content") or "", finish=ch["finish_reason"],
                       reasoning=msg.get("reasoning_content"), message=msg,
                       tool_calls=[{"id": c["id"], "name": c["function"]["name"],
                                    "arguments": c["function"]["arguments"]}
                                   for c in msg.get("tool_calls") or []])
        return out
    s = read_stream(r)
    calls = s.tool_calls()
    out.update(stream=s, content=s.text("content"), reasoning=s.text("reasoning_content"),
               finish=(s.finish_reasons() or [None])[-1],
               tool_calls=[calls[i] for i in sorted(calls)], errors=s.errors)
    return out


def check_stream_shape(out: dict) -> None:
    """One well-formed stream: one [DONE] at the very end, one id, one finish."""
    s = out["stream"]
    assert s.done == 1, "exactly one [DONE]"
    assert not s.after_done, "nothing after [DONE]"
    ids = {c.get("id") for c in s.chunks}
    assert len(ids) == 1, f"one completion id across rounds, got {ids}"
    assert len(s.finish_reasons()) == 1, s.finish_reasons()
