"""proxy/agents.py fix(): each change on its own, in each dialect, and the cases it must
leave alone (an ordinary request is not touched and costs microseconds)."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from proxy import agents
from proxy.agents import NOTE, backend_error
from proxy.dialects import BY_NAME
from proxy.dialects.base import no_agent_fix

# the declared dialects by name, and one that declares no agent fix
DIALECTS = {**BY_NAME, "none": replace(BY_NAME["chat"], agent_fix=no_agent_fix)}


def fix(dialect: str, body, info):
    """agents.fix on a request of the dialect of that name."""
    return agents.fix(DIALECTS[dialect], body, info)


def _same_after_fix(dialect, body, info=None):
    before = copy.deepcopy(body)
    changed = fix(dialect, body, info or {})
    return changed, body == before


# ------------------------------------------------------------------------- chat

def test_ordinary_chat_request_is_untouched():
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello"},
                                       {"role": "user", "content": "bye"}]}
    assert _same_after_fix("chat", body) == (False, True)


def test_chat_leading_system_and_developer_become_one():
    body = {"messages": [{"role": "system", "content": "A"},
                         {"role": "developer", "content": [{"type": "text", "text": "B"},
                                                           {"type": "text", "text": "C"}]},
                         {"role": "user", "content": "q"}]}
    assert fix("chat", body, {}) is True
    assert body["messages"] == [{"role": "system", "content": "A\n\nBC"},
                                {"role": "user", "content": "q"}]


def test_chat_late_system_becomes_a_noted_user_message_in_place():
    body = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"},
                         {"role": "developer", "content": "late"},
                         {"role": "user", "content": "q2"}]}
    assert fix("chat", body, {"late_system": "convert"}) is True
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "user"]
    assert body["messages"][0] == {"role": "system", "content": "S"}, "the prefix never moves"
    assert body["messages"][3]["content"] == NOTE + "late"


def test_chat_late_system_with_text_parts_keeps_the_note_in_the_first_part():
    body = {"messages": [{"role": "user", "content": "q"},
                         {"role": "system", "content": [{"type": "text", "text": "x"}]}]}
    fix("chat", body, {})
    assert body["messages"][1] == {"role": "user",
                                   "content": [{"type": "text", "text": NOTE + "x"}]}


def test_chat_keep_leaves_late_system_messages_but_still_merges_leading_ones():
    body = {"messages": [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                         {"role": "user", "content": "q"}, {"role": "system", "content": "late"}]}
    assert fix("chat", body, {"late_system": "keep"}) is True
    assert body["messages"] == [{"role": "system", "content": "A\n\nB"},
                                {"role": "user", "content": "q"},
                                {"role": "system", "content": "late"}]


def test_chat_merge_joins_the_note_to_the_user_message_before_it():
    body = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": "q"},
                         {"role": "system", "content": "late"},
                         {"role": "assistant", "content": "a"}]}
    assert fix("chat", body, {"late_system": "merge"}) is True
    assert body["messages"] == [{"role": "system", "content": "S"},
                                {"role": "user", "content": "q\n\n" + NOTE + "late"},
                                {"role": "assistant", "content": "a"}]


def test_chat_merge_without_a_user_message_before_stays_a_message_of_its_own():
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                         {"role": "system", "content": "late"}]}
    fix("chat", body, {"late_system": "merge"})
    assert body["messages"][2] == {"role": "user", "content": NOTE + "late"}


def test_chat_system_with_an_image_is_not_merged():
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = {"messages": [{"role": "system", "content": "A"},
                         {"role": "system", "content": [img]},
                         {"role": "user", "content": "q"}]}
    assert _same_after_fix("chat", body, {"late_system": "keep"}) == (False, True)


# ---------------------------------------------------------------- Anthropic Messages

HEADER = "x-anthropic-billing-header: cc_version=2.1.197.ae2; cc_entrypoint=sdk-cli;"


def test_billing_header_block_is_dropped():
    body = {"system": [{"type": "text", "text": HEADER},
                       {"type": "text", "text": "You are a Claude agent.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "q"}]}
    assert fix("messages", body, {}) is True
    assert body["system"] == [{"type": "text", "text": "You are a Claude agent.",
                               "cache_control": {"type": "ephemeral"}}]


@pytest.mark.parametrize("text, rest", [
    # older versions: cch= changes per request; header and prompt in one string
    ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
     "You are Claude Code.", "You are Claude Code."),
    (HEADER + "\nYou are Claude Code.", "You are Claude Code."),
])
def test_billing_header_is_stripped_from_a_string_system(text, rest):
    body = {"system": text, "messages": [{"role": "user", "content": "q"}]}
    fix("messages", body, {})
    assert body["system"] == rest


def test_billing_header_in_a_block_with_text_after_it_keeps_the_text():
    body = {"system": [{"type": "text", "text": HEADER + "Be brief."}], "messages": []}
    fix("messages", body, {})
    assert body["system"] == [{"type": "text", "text": "Be brief."}]


def test_two_sessions_headers_normalise_to_the_same_system():
    a = {"system": [{"type": "text", "text": HEADER}, {"type": "text", "text": "P"}],
         "messages": [{"role": "user", "content": "q"}]}
    b = copy.deepcopy(a)
    b["system"][0]["text"] = HEADER.replace("ae2", "4b6")
    fix("messages", a, {})
    fix("messages", b, {})
    assert a["system"] == b["system"]


def test_messages_late_system_string_and_blocks():
    body = {"system": "S",
            "messages": [{"role": "user", "content": "q"},
                         {"role": "system", "content": "Available agent types"},
                         {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
                         {"role": "system", "content": [{"type": "text", "text": "late"}]}]}
    assert fix("messages", body, {}) is True
    assert body["system"] == "S"
    m = body["messages"]
    assert [x["role"] for x in m] == ["user", "user", "assistant", "user"]
    assert m[1]["content"] == NOTE + "Available agent types"
    assert m[3]["content"] == [{"type": "text", "text": NOTE + "late"}]


def test_messages_leading_system_messages_join_the_top_level_system():
    body = {"system": [{"type": "text", "text": "S"}],
            "messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}]}
    fix("messages", body, {})
    assert body["system"] == [{"type": "text", "text": "S"}, {"type": "text", "text": "\n\nA"}]
    assert body["messages"] == [{"role": "user", "content": "q"}]
    body = {"messages": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}]}
    fix("messages", body, {})
    assert body == {"system": "A", "messages": [{"role": "user", "content": "q"}]}


def test_messages_merge_never_joins_a_tool_result_message():
    body = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": [
                             {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t", "content": "ok"}]},
                         {"role": "system", "content": "late"}]}
    fix("messages", body, {"late_system": "merge"})
    assert body["messages"][3] == {"role": "user", "content": NOTE + "late"}
    body["messages"][2:] = [{"role": "user", "content": [{"type": "text", "text": "q2"}]},
                            {"role": "system", "content": "late"}]
    fix("messages", body, {"late_system": "merge"})
    assert body["messages"][2] == {"role": "user", "content": "q2\n\n" + NOTE + "late"}
    assert len(body["messages"]) == 3


def test_ordinary_messages_request_is_untouched():
    body = {"system": [{"type": "text", "text": "You are helpful."}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}],
            "metadata": {"user_id": "x"}}
    assert _same_after_fix("messages", body) == (False, True)


# ----------------------------------------------------------------- OpenAI Responses

def _dev(text, role="developer"):
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def test_responses_codex_two_developer_items_become_one():
    body = {"input": [_dev("agent prompt"), _dev("skills"),
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "q"}]}]}
    assert fix("responses", body, {}) is True
    assert body["input"][0] == {"type": "message", "role": "developer",
                                "content": [{"type": "input_text",
                                             "text": "agent prompt\n\nskills"}]}
    assert len(body["input"]) == 2


def test_responses_instructions_absorb_the_leading_developer_items():
    body = {"instructions": "I", "input": [_dev("A"), _dev("B", "system"),
                                           {"role": "user", "content": "q"}]}
    fix("responses", body, {})
    assert body["instructions"] == "I\n\nA\n\nB"
    assert body["input"] == [{"role": "user", "content": "q"}]


def test_responses_late_developer_item_is_converted():
    body = {"instructions": "I",
            "input": [{"role": "user", "content": "q"},
                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "o"},
                      {"type": "message", "role": "developer", "content": "late"}]}
    assert fix("responses", body, {}) is True
    assert body["input"][3] == {"type": "message", "role": "user", "content": NOTE + "late"}
    assert body["instructions"] == "I"


def test_responses_string_input_and_ordinary_request_untouched():
    assert _same_after_fix("responses", {"input": "hi", "instructions": "x"}) == (False, True)
    body = {"input": [_dev("one"), {"role": "user", "content": "q"},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "a"}]}]}
    assert _same_after_fix("responses", body) == (False, True)


# ---------------------------------------------------------------- reasoning kept

@pytest.mark.parametrize("dialect, body", [
    ("chat", {"messages": [{"role": "user", "content": "q"}]}),
    ("messages", {"messages": [{"role": "user", "content": "q"}]}),
    ("responses", {"input": "q"}),
])
def test_preserve_reasoning_sets_the_template_kwarg(dialect, body):
    assert fix(dialect, body, {"preserve_reasoning": True}) is True
    assert body["chat_template_kwargs"] == {"preserve_thinking": True}
    assert fix(dialect, body, {"preserve_reasoning": True}) is False, "set once"


def test_preserve_reasoning_keeps_the_clients_own_kwargs():
    body = {"messages": [{"role": "user", "content": "q"}],
            "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": False}}
    assert fix("chat", body, {"preserve_reasoning": True}) is False
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "preserve_thinking": False}
    body = {"messages": [{"role": "user", "content": "q"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    assert fix("chat", body, {"preserve_reasoning": True}) is True
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "preserve_thinking": True}


def test_without_the_field_no_kwarg_is_added():
    body = {"messages": [{"role": "user", "content": "q"}]}
    fix("chat", body, {"preserve_reasoning": False, "late_system": "convert"})
    assert "chat_template_kwargs" not in body


# ---------------------------------------------------------------------- odd input

@pytest.mark.parametrize("dialect, body", [
    ("chat", {}), ("chat", {"messages": "x"}), ("chat", {"messages": [None, 3, "s"]}),
    ("messages", {"system": 5, "messages": None}), ("messages", {"system": [None, 1]}),
    ("responses", {"input": None}), ("responses", {"input": [None, "x", 1]}),
    ("none", {"messages": [{"role": "system"}, {"role": "system"}]}),
])
def test_malformed_bodies_are_left_for_the_backend_to_refuse(dialect, body):
    before = copy.deepcopy(body)
    assert fix(dialect, body, {}) is False
    assert body == before


def test_none_info_is_treated_as_empty():
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}
    assert fix("chat", body, None) is True


# ------------------------------------------------------------------- backend errors

def _err(status, obj):
    return status, json.dumps(obj).encode()


def test_llama_server_context_error_becomes_a_400_naming_both_numbers():
    status, body = _err(400, {"error": {
        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 19234,
        "n_ctx": 8192, "message": "request (19234 tokens) exceeds the available context "
                                  "size (8192 tokens), try increasing it"}})
    got = backend_error(status, body)
    assert got is not None
    code, out = got
    err = json.loads(out)["error"]
    assert code == 400 and err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded"
    assert "19234 tokens > 8192" in err["message"]
    # the form Claude Code parses (its cli: /prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)/i)
    import re
    m = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", err["message"], re.I)
    assert m and m.groups() == ("19234", "8192")


def test_context_error_numbers_from_the_message_when_fields_are_missing():
    status, body = _err(400, {"error": {
        "type": "exceed_context_size_error",
        "message": "input (9000 tokens) is larger than the max context size (4096 tokens). "
                   "skipping"}})
    err = json.loads(backend_error(status, body)[1])["error"]
    assert "9000 tokens > 4096" in err["message"]


@pytest.mark.parametrize("status, body", [
    _err(500, {"error": {"code": 500, "type": "server_error",
                         "message": "Jinja Exception: System message must be at the beginning."}}),
    (500, b"Jinja Exception: System message must be at the beginning."),   # text/plain
])
def test_template_exception_becomes_a_400_with_its_message(status, body):
    code, out = backend_error(status, body)
    err = json.loads(out)["error"]
    assert code == 400 and err["type"] == "invalid_request_error"
    assert err["code"] == "chat_template_error"
    assert err["message"].endswith(": System message must be at the beginning.")


@pytest.mark.parametrize("status, body", [
    (200, b'{"choices": []}'),
    _err(500, {"error": {"code": 500, "type": "server_error", "message": "out of memory"}}),
    _err(503, {"error": {"code": 503, "type": "unavailable_error", "message": "Loading model"}}),
    (500, b"\xff\xfe not json"),
    (400, b'["exceed_context_size_error"]'),
    (400, b'{"error": {"type": "exceed_context_size_error", "message": "no numbers"}}'),
])
def test_other_answers_are_relayed_as_they_are(status, body):
    assert backend_error(status, body) is None
