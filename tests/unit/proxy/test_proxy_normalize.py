import json

import pytest

from common import sse
from common.errors import ApiError
from proxy import normalize
from proxy.dialects import chat
from proxy.settings import Settings


def test_system_prompt_injected_only_without_leading_system():
    b = {"messages": [{"role": "user", "content": "x"}]}
    assert normalize.inject_system_prompt(b, "S")
    assert b["messages"][0] == {"role": "system", "content": "S"}
    assert not normalize.inject_system_prompt(b, "T")
    d = {"messages": [{"role": "developer", "content": "d"}]}
    assert not normalize.inject_system_prompt(d, "S")
    assert not normalize.inject_system_prompt({"messages": [{"role": "user"}]}, "")


@pytest.mark.parametrize("body,floor,expect", [
    ({"tools": [1], "max_tokens": 100}, 1024, {"max_tokens": 1024}),
    ({"tools": [1], "max_tokens": 5000}, 1024, {"max_tokens": 5000}),
    ({"tools": [1]}, 1024, {}),
    ({"max_tokens": 100}, 1024, {"max_tokens": 100}),
    ({"tools": [1], "max_completion_tokens": 8}, 64, {"max_completion_tokens": 64}),
    ({"tools": [1], "max_tokens": 100}, 0, {"max_tokens": 100}),
])
def test_token_floor(body, floor, expect):
    normalize.apply_token_floor(body, floor)
    body.pop("tools", None)
    assert body == expect


@pytest.mark.parametrize("body,most,expect", [
    ({"max_tokens": 32000}, 2048, {"max_tokens": 2048}),
    ({"max_tokens": 2048, "max_completion_tokens": 32768}, 2048,
     {"max_tokens": 2048, "max_completion_tokens": 2048}),
    ({"max_tokens": 100}, 2048, {"max_tokens": 100}),
    ({"max_tokens": 32000}, None, {"max_tokens": 32000}),
    ({}, 2048, {}),
])
def test_clamp_to_context(body, most, expect):
    changed = body != expect
    assert normalize.clamp_to_context(body, most) is changed
    assert body == expect


def test_reasoning_mirrored_both_ways_full_response():
    for key, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
        raw = json.dumps({"choices": [{"message": {"content": "a", key: "r"}}]}).encode()
        msg = json.loads(normalize.normalize_completion_bytes(raw))["choices"][0]["message"]
        assert msg[other] == "r" and msg[key] == "r"
    plain = b'{"choices": [{"message": {"content": "a"}}]}'
    assert normalize.normalize_completion_bytes(plain) is plain


def test_reasoning_mirrored_in_split_sse_stream():
    ev1 = sse.emit({"choices": [{"delta": {"reasoning": "th"}}]})
    ev2 = sse.emit({"choices": [{"delta": {"content": "x"}}]})
    data = ev1 + ev2 + sse.DONE
    pieces = [data[i:i + 7] for i in range(0, len(data), 7)]
    out = b"".join(normalize.normalize_sse(pieces))
    events = list(sse.iter_events([out]))
    first = json.loads(events[0].data)["choices"][0]["delta"]
    assert first == {"reasoning": "th", "reasoning_content": "th"}
    assert events[1].raw == ev2 and events[2].is_done


def test_sse_passthrough_fast_path_is_identity():
    chunks = [sse.emit({"choices": [{"delta": {"content": str(i)}}]}) for i in range(3)]
    assert list(normalize.normalize_sse(chunks)) == chunks


def test_sse_parser_crlf_comments_and_multiline():
    p = sse.Parser()
    evs = p.feed(b": keep-alive\r\n\r\ndata: a\r\ndata: b\r\n\r\ndata: [DO")
    assert [e.data for e in evs] == [None, "a\nb"]
    evs = p.feed(b"NE]\n\n")
    assert evs[0].is_done


@pytest.mark.parametrize("body,msg", [
    ([], "must be a JSON object"),
    ({}, "'messages' is required"),
    ({"messages": {}}, "must be a list"),
    ({"messages": [{"role": 1}]}, "role must be a string"),
    ({"messages": [{"role": "user"}], "model": 3}, "'model' must be str"),
    ({"messages": [{"role": "user"}], "n": True}, "'n' must be an integer"),
    ({"messages": [{"role": "user"}], "tools": [{"type": "function"}]}, "tools[0].function.name"),
])
def test_validation_messages(body, msg):
    with pytest.raises(ApiError) as e:
        normalize.validate_chat(body)
    assert e.value.status == 400 and msg in e.value.message


def test_not_json():
    with pytest.raises(ApiError) as e:
        normalize.parse_chat_body(b"{")
    assert "not valid JSON" in e.value.message


@pytest.mark.parametrize("body,settings,expect", [
    ({}, {}, True),
    ({}, {"WEB_SEARCH": False}, False),
    ({}, {"MAX_SEARCH_ITER": 0}, False),
    ({"tool_choice": "none"}, {}, False),
    ({"tool_choice": "auto"}, {}, True),
    ({"tool_choice": "required"}, {}, True),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, {}, False),
    ({"tool_choice": {"type": "function", "function": {"name": "web_search"}}}, {}, True),
    ({"tools": [{"type": "function", "function": {"name": "web_search"}}]}, {}, False),
    ({"n": 2}, {}, False),
])
def test_should_inject(body, settings, expect):
    assert chat.should_inject(body, Settings.from_env({}, **settings)) is expect
