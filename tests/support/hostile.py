"""Hypothesis strategies for hostile HTTP input, and the property every answer
must have: never a 5xx from our code, every error in the OpenAI envelope."""
from __future__ import annotations

import json

from hypothesis import strategies as st

from tests.support.rawhttp import RawAnswer

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]

CONTENT_TYPES = [None, "application/json", "application/x-www-form-urlencoded", "text/plain",
                 "multipart/form-data; boundary=xyz", "application/json; charset=latin-1",
                 "application/octet-stream"]

# Strings that break naive code: lone surrogates, NUL, RTL marks, huge numbers as text.
NASTY_TEXT = ["\ud800", "\udfff", "a\ud83d", "\x00", "\u202e", "\ufeff", "%2e%2e",
              "../../unload", "9" * 400, "", " "]

text = st.one_of(st.text(max_size=20), st.sampled_from(NASTY_TEXT))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), text)
json_values = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(text, kids, max_size=4)), max_leaves=12)


def deep(depth: int, inner: str = "[]") -> str:
    return "[" * depth + inner + "]" * depth


def dumps(value) -> bytes:
    """JSON text of a value; lone surrogates become \\udXXX escapes, as a client sends them."""
    return json.dumps(value, ensure_ascii=True).encode()


parts = st.fixed_dictionaries({}, optional={"type": st.one_of(
    st.sampled_from(["text", "image_url", "input_audio", "file", "refusal", "tool"]),
    json_values), "text": json_values, "image_url": json_values})


messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                      json_values),
    "content": st.one_of(text, st.lists(parts, max_size=3), json_values),
    "tool_calls": st.one_of(st.lists(st.fixed_dictionaries({}, optional={
        "id": json_values, "type": st.one_of(st.just("function"), json_values),
        "function": st.one_of(st.fixed_dictionaries({}, optional={
            "name": json_values, "arguments": json_values}), json_values)}), max_size=2),
        json_values),
    "tool_call_id": json_values, "name": json_values}), max_size=3)

tools = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.just("function"), json_values),
    "function": st.one_of(st.fixed_dictionaries({}, optional={
        "name": json_values, "parameters": json_values, "description": json_values}),
        json_values)}), max_size=2)


def chat_bodies(model):
    """Chat bodies with every field present or not, of the right type or not."""
    return st.fixed_dictionaries({}, optional={
        "model": model, "messages": st.one_of(messages, json_values),
        "stream": json_values, "n": st.one_of(st.integers(-2, 12), json_values),
        "max_tokens": st.one_of(st.integers(-5, 5), json_values),
        "temperature": json_values, "top_p": json_values, "stop": json_values,
        "tools": st.one_of(tools, json_values), "tool_choice": json_values,
        "stream_options": json_values, "response_format": json_values, "seed": json_values,
        "logit_bias": json_values,
    })


def raw_bodies(json_body):
    """Bytes a hostile client may send as a body: JSON (right or wrong), deep
    nesting, invalid UTF-8, not JSON at all, nothing."""
    return st.one_of(
        json_body.map(dumps),
        json_values.map(dumps),
        st.integers(90, 3000).map(lambda d: deep(d).encode()),
        st.integers(90, 3000).map(
            lambda d: ('{"model": "x", "messages": ' + deep(d, '{"role": "user"}') + "}").encode()),
        st.binary(max_size=64),
        st.sampled_from([b"", b" ", b"{", b"null", b"\xff\xfe{}", b'{"messages": "\xc3"}',
                         b"model=x&messages=y", b'{"model": NaN}', b"[1]", b'"str"']),
    )


def check(ans: RawAnswer, what: str, dialects: bool = False) -> None:
    """The property: no 5xx, and every error answer is the envelope (with
    `dialects`, the public door: Anthropic's error shape on Messages routes)."""
    assert ans.status < 500, f"{what}: {ans.status} {ans.body[:500]!r}"
    if ans.status >= 400 and what.split()[0] != "HEAD":
        path = what.split()[1].split("?")[0] if len(what.split()) > 1 else ""
        if dialects and "/messages" in path:
            assert ans.anthropic_error is not None, \
                f"{what}: {ans.status} not Anthropic's error shape: {ans.body[:300]!r}"
        else:
            assert ans.envelope is not None, \
                f"{what}: {ans.status} not the envelope: {ans.body[:300]!r}"
