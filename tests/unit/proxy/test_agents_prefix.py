"""The prefix property through the official Qwen 3.5 chat template, on real captured
Claude Code 2.1.197 and Codex 0.171.0 sessions (tests/fixtures/templates/README.md):
each request is converted to chat messages the way llama-server does
(tests.support.agents: anthropic_to_chat / responses_to_chat / template_inputs) and
rendered with jinja2 the way the backend does.

(a) without fix() both agents' first request raises "System message must be at the
    beginning." (the issue's 500 on every request);
(b) with fix() every captured request renders;
(c) within a prompt's tool loop, turn N's rendered prompt (with its generation prompt)
    is a prefix of turn N+1's; at a new user prompt the Qwen 3.5 template drops the
    earlier answers' <think> (the only divergence, at the first assistant turn), and a
    template with Qwen 3.6's preserve_thinking plus `preserve_reasoning` keeps even that;
(d) two sessions whose billing headers differ render the same system+tools prefix.
"""
from __future__ import annotations

import copy

import jinja2
import jinja2.meta
import pytest

from proxy.agents import NOTE, fix
from proxy.dialects import BY_NAME
from tests.support.agents import anthropic_to_chat, captured, qwen35, render, responses_to_chat

AGENTS = {"claude": (BY_NAME["messages"], anthropic_to_chat),
          "codex": (BY_NAME["responses"], responses_to_chat)}
# Qwen 3.6's templates differ from 3.5's in this one condition: earlier turns keep their
# <think> when the caller passes preserve_thinking.
KEEP_35 = "{%- if loop.index0 > ns.last_query_index %}"
KEEP_36 = ("{%- if (preserve_thinking is defined and preserve_thinking is true) "
           "or (loop.index0 > ns.last_query_index) %}")


def _fixed(agent: str, body: dict, info: dict | None = None) -> dict:
    dialect, convert = AGENTS[agent]
    body = copy.deepcopy(body)
    assert fix(dialect, body, info or {}) is True
    return convert(body)


def _prompts(agent: str, info=None, template=None) -> list[list[str]]:
    t = template or qwen35()
    return [[render(t, _fixed(agent, b, info)) for b in session] for session in captured(agent)]


def _new_prompt(agent: str, body: dict) -> bool:
    """The request carries a new user prompt (not a tool result) last."""
    last = body["messages" if agent == "claude" else "input"][-1]
    c = last.get("content")
    return last.get("role") == "user" and not (
        isinstance(c, list) and any(b.get("type") == "tool_result" for b in c))


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_fixture_is_the_official_template():
    t = qwen35()
    assert "System message must be at the beginning." in t and KEEP_35 in t
    assert "preserve_thinking" not in t


@pytest.mark.parametrize("agent", AGENTS)
def test_a_without_fix_the_template_refuses_the_agents_first_request(agent):
    _, convert = AGENTS[agent]
    with pytest.raises(jinja2.TemplateError, match="System message must be at the beginning."):
        render(qwen35(), convert(captured(agent)[0][0]))


@pytest.mark.parametrize("agent", AGENTS)
def test_b_with_fix_every_captured_request_renders(agent):
    for session in _prompts(agent):
        for p in session:
            assert p.startswith("<|im_start|>system\n# Tools") and p.endswith(
                "<|im_start|>assistant\n<think>\n")


def test_b_claude_codes_late_system_message_is_a_noted_user_turn_where_it_was():
    body = captured("claude")[0][0]
    prompt = render(qwen35(), _fixed("claude", body))
    first_user = prompt.index("<|im_start|>user\n")
    note = prompt.index("<|im_start|>user\n" + NOTE + "Available agent types")
    assert first_user < note, "after the first user turn, as Claude Code sent it"
    assert "x-anthropic-billing-header" not in prompt


def test_b_codexs_developer_items_are_one_system_message():
    prompt = render(qwen35(), _fixed("codex", captured("codex")[0][0]))
    assert prompt.count("<|im_start|>system\n") == 1
    system = prompt[:prompt.index("<|im_end|>")]
    assert "You are Codex" in system and "<skills_instructions>" in system


@pytest.mark.parametrize("agent", AGENTS)
def test_c_each_turn_of_a_tool_loop_extends_the_last_prompt(agent):
    sessions, prompts = captured(agent), _prompts(agent)
    loops = 0
    for bodies, rendered in zip(sessions, prompts):
        for i in range(1, len(bodies)):
            if _new_prompt(agent, bodies[i]):
                continue
            loops += 1
            assert rendered[i].startswith(rendered[i - 1]), \
                f"{agent} session turn {i}: diverges at {_common(rendered[i - 1], rendered[i])}"
    assert loops == 6, "two tool results per prompt, three prompts"


@pytest.mark.parametrize("agent", AGENTS)
def test_c_a_new_prompt_diverges_only_where_qwen35_drops_earlier_reasoning(agent):
    bodies, rendered = captured(agent)[0], _prompts(agent)[0]
    i = next(i for i in range(1, len(bodies)) if _new_prompt(agent, bodies[i]))
    a, b = rendered[i - 1], rendered[i]
    n = _common(a, b)
    first_answer = a.index("<|im_start|>assistant\n<think>\n") + len("<|im_start|>assistant\n")
    # (a few characters more when the stripped answer starts like "<think>": "<tool_call>")
    assert first_answer <= n < first_answer + len("<think>"), \
        "everything before the first answer's <think> is reused"
    assert not b.startswith(a)


@pytest.mark.parametrize("agent", AGENTS)
def test_c_with_preserve_reasoning_a_36_style_template_keeps_the_whole_prefix(agent):
    t36 = qwen35().replace(KEEP_35, KEEP_36)
    assert t36 != qwen35()
    for rendered in _prompts(agent, {"preserve_reasoning": True}, t36):
        for a, b in zip(rendered, rendered[1:]):
            assert b.startswith(a), f"{agent}: diverges at {_common(a, b)}"


@pytest.mark.parametrize("agent", AGENTS)
def test_d_two_sessions_share_the_whole_system_and_tools_prefix(agent):
    s1, s2 = captured(agent)
    p1, p2 = (render(qwen35(), _fixed(agent, s[0])) for s in (s1, s2))
    head = p1.index("<|im_start|>user\n")
    assert p1[:head] == p2[:head], "system + tools identical"
    assert _common(p1, p2) > head, "and the first user turn's shared opening too"


def test_d_the_billing_header_was_what_differed():
    s1, s2 = captured("claude")
    h1, h2 = s1[0]["system"][0]["text"], s2[0]["system"][0]["text"]
    assert h1.startswith("x-anthropic-billing-header: cc_version=2.1.197.") and h1 != h2
    # fixed but with the header put back, as llama.cpp alone would leave it (no cch= here)
    p = []
    for s, h in ((s1, h1), (s2, h2)):
        body = copy.deepcopy(s[0])
        fix(BY_NAME["messages"], body, {})
        body["system"].insert(0, {"type": "text", "text": h})
        p.append(render(qwen35(), anthropic_to_chat(body)))
    n = _common(*p)
    assert p[0][:n].endswith("cc_version=2.1.197."), "they part inside the header"
    assert n < p[0].index("<|im_start|>user\n")


def test_fields_that_vary_per_request_never_reach_the_prompt():
    """metadata (session id), cache_control (moves each turn), Codex's prompt_cache_key,
    client_metadata and item ids: the template reads none of them."""
    env = jinja2.Environment()
    used = jinja2.meta.find_undeclared_variables(env.parse(qwen35()))
    # (content / reasoning_content are the template's own loop variables, which
    # jinja2.meta reports because they are set inside blocks)
    assert used - {"content", "reasoning_content"} == {
        "messages", "tools", "add_generation_prompt", "enable_thinking", "add_vision_id",
        "raise_exception"}
    body = captured("claude")[0][1]
    other = copy.deepcopy(body)
    other["metadata"] = {"user_id": '{"session_id":"another"}'}
    for m in other["messages"]:
        for b in m["content"] if isinstance(m["content"], list) else []:
            b.pop("cache_control", None)
    assert render(qwen35(), _fixed("claude", body)) == render(qwen35(), _fixed("claude", other))
    body = captured("codex")[0][1]
    other = copy.deepcopy(body)
    other.update(prompt_cache_key="k", client_metadata={"turn_id": "t"})
    for it in other["input"]:
        it.pop("id", None)
    assert render(qwen35(), _fixed("codex", body)) == render(qwen35(), _fixed("codex", other))


def test_chat_dialect_the_same_conversation_as_chat_completions():
    """An agent speaking chat completions (the converted Codex session): fix("chat")
    makes it render, turn after turn, with the same prefix property."""
    rendered = []
    for body in captured("codex")[0][:3]:
        chat = responses_to_chat(copy.deepcopy(body))
        with pytest.raises(jinja2.TemplateError):
            render(qwen35(), chat)
        assert fix(BY_NAME["chat"], chat, {}) is True
        rendered.append(render(qwen35(), chat))
    assert rendered[1].startswith(rendered[0]) and rendered[2].startswith(rendered[1])
