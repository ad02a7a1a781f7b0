"""Pure parts of the input guards: path rules, strict JSON, /v1 routing and the
model a request goes to (common/guard.py, swapper/intake.py)."""
from __future__ import annotations

import pytest

from common import guard
from common.errors import ApiError
from swapper import intake


@pytest.mark.parametrize("path", ["/upstream/m/../../unload", "/a/./b", "/a/%2e%2e/b",
                                  "/a/%2E./b", "/a%2fb", "/a%5Cb", "/a\\b", "/a%00", "/a/%252e",
                                  "/a/\x00", ".", "..", "./x", "/a/.", "/..", "../a"])
def test_unsafe_paths(path):
    assert guard.unsafe_path(path) is not None


@pytest.mark.parametrize("path", ["/", "/v1/chat/completions", "/upstream/qwen3.8-27b/props",
                                  "/a..b/c.d/...", "/logs/m", "/a%20b", "/upstream/m//x",
                                  "/.well-known/x", "a.b", ""])
def test_safe_paths(path):
    assert guard.unsafe_path(path) is None


def test_the_fast_path_agrees_with_the_segment_walk():
    """A path with no '%' and no segment starting with '.' skips the walk: every
    short path over the characters that matter gets the walk's answer."""
    import itertools
    from urllib.parse import unquote

    def walk(p):
        for seg in p.split("/"):
            dec = unquote(seg)
            if seg and dec in (".", ".."):
                return "dots"
            if seg and dec != seg and any(c in dec for c in "/\\\x00%"):
                return "encoded"
        return None

    for n in range(7):
        for chars in itertools.product("/.%2eEfa", repeat=n):
            p = "".join(chars)
            assert (guard.unsafe_path(p) is None) == (walk(p) is None), p


def test_raw_path_of_an_absolute_form_target():
    env = {"RAW_URI": "http://h/upstream/m/..%2funload?x=1", "PATH_INFO": "/upstream/m/../unload"}
    assert guard.raw_path(env) == "/upstream/m/..%2funload"


@pytest.mark.parametrize("raw, words", [
    (b"\xff", "UTF-8"), (b'"\\ud800"', "surrogate"), (b'["a\\udc00b"]', "surrogate"),
    (b"[" * 101 + b"]" * 101, "deeper"), (b"[" * 5000 + b"]" * 5000, "deeper"), (b"{", "JSON"),
])
def test_loads_refuses(raw, words):
    with pytest.raises(ApiError) as e:
        guard.loads(raw)
    assert e.value.status == 400 and words in e.value.message


def test_loads_accepts_pairs_and_depth_100():
    assert guard.loads(b'"\\ud83d\\ude00"') == "\U0001F600"
    assert guard.loads(b"[" * 100 + b"]" * 100) is not None


@pytest.mark.parametrize("path, method, status", [
    ("chat/completions", "GET", 405), ("chat/completions", "HEAD", 405), ("nope", "POST", 404),
    ("chat/completions/x", "POST", 404), ("models", "POST", 405), ("responses/r1", "POST", 405),
])
def test_route_of_refuses(path, method, status):
    with pytest.raises(ApiError) as e:
        intake.route_of(path, method)
    assert e.value.status == status


@pytest.mark.parametrize("path, method, route", [
    ("chat/completions", "POST", "chat/completions"), ("chat/completions/", "POST", "chat/completions"),
    ("responses/r1", "GET", "responses/[^/]+"), ("messages/count_tokens", "POST", "messages/count_tokens"),
])
def test_route_of_serves(path, method, route):
    assert intake.route_of(path, method) == route


def test_model_read_whatever_the_body_looks_like():
    req = intake.parse_v1("chat/completions", "POST", b' {"model": "b", "messages": []}')
    assert req.model == "b"
    for bad in (b"[1]", b'"s"', b'{"model": ["x"]}', b"", b"model=b"):
        with pytest.raises(ApiError) as e:
            intake.parse_v1("chat/completions", "POST", bad)
        assert e.value.status == 400


def test_target_model():
    named = intake.V1Request("chat/completions", {"model": "b"}, "b")
    nameless = intake.V1Request("chat/completions", {}, None)
    assert intake.target_model(named, "POST", "chat/completions", "a") == "b"
    assert intake.target_model(nameless, "POST", "chat/completions", "a") == "a"
    assert intake.target_model(nameless, "POST", "chat/completions", None) is None
    with pytest.raises(ApiError) as e:
        intake.target_model(intake.V1Request("responses/[^/]+", None, None), "GET", "responses/r",
                            None)
    assert e.value.status == 404


@pytest.mark.parametrize("body, target", [(b"", None), (b'{"model": "b"}', "b"), (b"{}", None)])
def test_load_target(body, target):
    assert intake.load_target(None, body) == target
    assert intake.load_target("a", b"[1]") == "a"      # the path wins; the body is not read


@pytest.mark.parametrize("route, payload, has", [
    ("chat/completions", {"messages": [{"content": [{"type": "image_url"}]}]}, True),
    ("chat/completions", {"messages": [{"content": [{"type": []}]}]}, False),
    ("messages", {"messages": [{"content": [{"type": "image"}]}]}, True),
    ("responses", {"input": [{"type": "input_image"}]}, True),
    ("responses", {"input": "text"}, False),
    ("embeddings", {"input": [{"type": "image_url"}]}, False),
])
def test_require_vision(route, payload, has):
    intake.require_vision("m", True, route, payload)           # a vision model takes anything
    if has:
        with pytest.raises(ApiError) as e:
            intake.require_vision("m", False, route, payload)
        assert e.value.status == 400
    else:
        intake.require_vision("m", False, route, payload)
