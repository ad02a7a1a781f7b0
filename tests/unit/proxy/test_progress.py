"""proxy/progress.py on byte streams: a stream that waited carries the dialect's
progress before the backend's first event, which follows seamlessly; one that did
not wait passes byte for byte; our Messages block comes out of the history."""
import copy
import json

from common import sse
from proxy import normalize, progress
from proxy.dialects import BY_NAME

WAIT = [b"", b": loading model m (3 s), ~10 s left\n\n", b": keep-alive\n\n",
        b": queue-wait 4.000\n\n"]
MESSAGES = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_b","type":'
    b'"message","role":"assistant","model":"m","content":[],"usage":{"input_tokens":'
    b'120,"cache_read_input_tokens":100,"output_tokens":1}}}\n\nevent: ping\ndata: '
    b'{"type":"ping"}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\nevent: content_block_delta\ndata: {"ty',
    b'pe":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
    b'"content_block":{"type":"tool_use","id":"t1","name":"Bash","input":{}}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
    b'"tool_use"},"usage":{"output_tokens":7}}\n\nevent: message_stop\ndata: '
    b'{"type":"message_stop"}\n\n']


def run(dialect, pieces, body=None):
    return b"".join(progress.kept_in_progress(BY_NAME[dialect].progress, body or {"model": "m"},
                                              iter(pieces)))


def objs(raw: bytes) -> list[dict]:
    return [json.loads(e.data) for e in sse.events(raw) if e.data and not e.is_done]


def test_a_stream_that_did_not_wait_passes_byte_for_byte():
    for dialect, pieces in (("messages", MESSAGES),
                            ("chat", [b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"])):
        assert run(dialect, pieces) == b"".join(pieces)


def test_an_event_an_earlier_stage_remade_is_no_wait():
    """The chat relay's reasoning mirror remakes the events carrying reasoning
    (proxy/normalize.py): a stream that did not wait and opens with one gets no
    progress (a remade event is data, not a comment)."""
    think = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n'
    rest = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
            b"data: [DONE]\n\n"]
    out = b"".join(progress.kept_in_progress(
        BY_NAME["chat"].progress, {"model": "m"}, normalize.normalize_sse(iter([think] + rest))))
    mirrored = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm",' \
        b'"reasoning":"hm"}}]}\n\n'
    assert out == mirrored + b"".join(rest)


def test_messages_progress_is_a_thinking_block_the_answer_shifted_after_it():
    out = run("messages", WAIT + MESSAGES)
    assert out.count(b": loading model m") == 1, "the comments stay"
    evs = objs(out)
    kinds = [e["type"] for e in evs]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds.count("message_start") == 1
    thinking = "".join(e["delta"].get("thinking", "") for e in evs
                       if e["type"] == "content_block_delta" and e["index"] == 0)
    assert thinking.startswith("loading model m (3 s), ~10 s left\n")
    assert "queue-wait" not in thinking and "keep-alive" not in thinking
    sig = [e for e in evs if e.get("delta", {}).get("type") == "signature_delta"]
    assert sig == [{"type": "content_block_delta", "index": 0,
                    "delta": {"type": "signature_delta", "signature": progress.MARKER}}]
    # block 0 closed before the backend's first block, which is now 1; the tool use 2
    stop0 = kinds.index("content_block_stop")
    assert evs[stop0]["index"] == 0 and evs[stop0 + 1]["type"] == "ping"
    starts = [(e["index"], e["content_block"]["type"]) for e in evs
              if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1, 2]
    delta = next(e for e in evs if e["type"] == "message_delta")
    assert delta["usage"] == {"input_tokens": 120, "cache_read_input_tokens": 100,
                              "output_tokens": 7}, "the backend's usage, kept"
    assert kinds[-1] == "message_stop"


def test_chat_progress_is_a_role_chunk_then_empty_deltas():
    backend = [b'data: {"id":"b","choices":[{"index":0,"delta":{"role":"assistant",'
               b'"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"]
    out = run("chat", WAIT + backend)
    evs = objs(out)
    deltas = [e["choices"][0]["delta"] for e in evs]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:3] == [{"content": ""}] * 2
    assert out.endswith(b"".join(backend)), "the backend's events as they came"


def test_responses_progress_the_backends_lifecycle_under_our_id():
    created = {"type": "response.created", "response": {"id": "resp_b", "status": "x"}}
    done = {"type": "response.completed", "response": {"id": "resp_b", "status": "completed"}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    backend = [sse.event(created["type"], created) + sse.event(delta["type"], delta),
               sse.event(done["type"], done)]
    evs = objs(run("responses", WAIT + backend))
    kinds = [e["type"] for e in evs]
    assert kinds == ["response.created"] + ["response.in_progress"] * 3 + [
        "response.output_text.delta", "response.completed"]
    assert len({e["response"]["id"] for e in evs if "response" in e}) == 1
    assert evs[-1]["response"]["status"] == "completed"


def test_strip_leaves_the_turn_as_it_would_have_been():
    turn = [{"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]
    mine = {"type": "thinking", "thinking": "real thought", "signature": ""}
    body = {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "loading model m\n", "signature": progress.MARKER},
            mine] + turn},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "hello"}]}]}
    want = copy.deepcopy(body)
    want["messages"][1]["content"] = [mine] + turn
    assert BY_NAME["messages"].progress.strip(body) is True
    assert body == want
    assert BY_NAME["messages"].progress.strip(body) is False
    assert BY_NAME["chat"].progress.strip({"messages": []}) is False
