"""The real agent CLIs (Claude Code, Codex) and a scripted model that makes them search.

`searching_model` answers by looking at each request, as a model would: when it is
offered web search it searches, when it has the results it answers with the first
result's URL (so an answer that names it was built on the search result), anything
else (titles, summaries) gets a short "ok".

`captured()` gives real Claude Code / Codex sessions (tests/fixtures/templates), and
`anthropic_to_chat` / `responses_to_chat` / `render` turn a request into the prompt
llama-server's template makes of it (for the prefix tests of proxy/agents.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from .chat import Reply, call

QUERY = "flask 3.1 changelog"
URL_RE = re.compile(r"https://example\.com/[\w./-]+")


def agents_bin() -> str | None:
    d = os.environ.get("TESTBED_AGENTS_BIN")
    if d and os.path.isdir(d):
        return d
    cache = os.environ.get("CODING_STACK_CACHE", "/var/cache/coding-stack")
    for name in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        if name.startswith("agents-"):
            return os.path.join(cache, name, "node_modules", ".bin")
    return None


def tool(bin_dir: str | None, name: str) -> str | None:
    p = os.path.join(bin_dir, name) if bin_dir else None
    if p and os.access(p, os.X_OK) and shutil.which("node"):
        return p
    return None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content or []:
        if isinstance(b, dict):
            out.append(_text(b.get("content")) if b.get("type") == "tool_result"
                       else str(b.get("text") or b.get("output") or ""))
    return "\n".join(out)


def answer(found: str) -> Reply:
    urls = URL_RE.findall(found)
    return Reply(content=f"ANSWER: the changelog is at {urls[0]} [1]" if urls
                 else "ANSWER: no search result reached me")


def searching_model(body: dict, path: str) -> Reply:
    if path == "/v1/messages":
        names = [t.get("name") for t in body.get("tools") or []]
        msgs = body.get("messages") or []
        last = msgs[-1] if msgs else {}
        results = [b for b in last.get("content") or [] if isinstance(b, dict)
                   and b.get("type") == "tool_result"] if isinstance(last.get("content"),
                                                                    list) else []
        if results:
            return answer(_text(results))
        if "web_search" in names:
            return Reply(tool_calls=[call("web_search", {"query": QUERY})])
        if "WebSearch" in names:
            return Reply(tool_calls=[call("WebSearch", {"query": QUERY})])
        return Reply(content="ok")
    if path == "/v1/responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        outs = [i for i in items if isinstance(i, dict)
                and i.get("type") == "function_call_output"]
        if outs:
            return answer(json.dumps(outs[-1].get("output")))
        if any(t.get("name") == "web_search" for t in body.get("tools") or []):
            return Reply(tool_calls=[call("web_search", {"query": QUERY})])
        return Reply(content="ok")
    return Reply(content="ok")


# ------------------------------------------------- captured traffic, rendered as llama-server does

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "templates")


def captured(agent: str) -> list[list[dict]]:
    """The captured sessions of "claude" (Claude Code 2.1.197, Anthropic Messages) or
    "codex" (Codex 0.171.0, Responses): a list of sessions, each the request bodies in
    the order the CLI sent them (tests/fixtures/templates/README.md)."""
    import copy
    name = {"claude": "claude-code-2.1.197.json", "codex": "codex-0.171.0.json"}[agent]
    with open(os.path.join(TEMPLATES, name)) as f:
        doc = json.load(f)
    key, prev, out = doc["list_key"], {}, []
    for turns in doc["sessions"]:
        bodies = []
        for d in turns:
            cur = copy.deepcopy(prev)
            for k in d.get("del", []):
                cur.pop(k)
            cur.update(copy.deepcopy(d.get("set", {})))
            cur[key] = copy.deepcopy(prev.get(key, [])[:d["keep"]]) + copy.deepcopy(d["tail"])
            bodies.append(cur)
            prev = cur
        out.append(bodies)
    return out


def _mask_cch(text: str) -> str:
    """llama.cpp's own normalize_anthropic_billing_header: a 5-character `cch=` value
    followed by ';' becomes 'fffff' (nothing else of the header is touched)."""
    if not text.startswith("x-anthropic-billing-header:"):
        return text
    i = text.find("cch=", len("x-anthropic-billing-header:"))
    if i >= 0 and i + 9 < len(text) and text[i + 9] == ";":
        text = text[:i + 4] + "fffff" + text[i + 9:]
    return text


def anthropic_to_chat(body: dict) -> dict:
    """tools/server/server-chat.cpp server_chat_convert_anthropic_to_oai (llama.cpp of
    the test bed), the parts that reach the template: `system` (blocks' texts joined
    with nothing, cch masked) first; text blocks kept, thinking -> reasoning_content,
    tool_use -> tool_calls, tool_result -> tool messages after the message; tools ->
    function tools; chat_template_kwargs passed through; metadata kept aside."""
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            text = _mask_cch(system)
        else:
            text = "".join(_mask_cch(b.get("text", "")) for b in system
                           if isinstance(b, dict) and b.get("type") == "text")
        msgs.append({"role": "system", "content": text})
    for m in body["messages"]:
        c = m.get("content")
        if not isinstance(c, list):
            msgs.append(m)
            continue
        parts, calls, results, reasoning = [], [], [], ""
        for b in c:
            t = b.get("type")
            if t == "text":
                parts.append(b)
            elif t == "thinking":
                reasoning += b.get("thinking", "")
            elif t == "tool_use":
                calls.append({"id": b.get("id", ""), "type": "function",
                              "function": {"name": b.get("name", ""),
                                           "arguments": json.dumps(b.get("input", {}))}})
            elif t == "tool_result":
                rc = b.get("content")
                text = rc if isinstance(rc, str) else "".join(
                    x.get("text", "") for x in rc or [] if x.get("type") == "text")
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                                "content": text})
        if parts or calls or reasoning:
            new = {"role": m["role"], "content": parts if parts else ""}
            if calls:
                new["tool_calls"] = calls
            if reasoning:
                new["reasoning_content"] = reasoning
            msgs.append(new)
        msgs.extend(results)
    out = {"messages": msgs,
           "tools": [{"type": "function", "function": {
               "name": t.get("name", ""), "description": t.get("description", ""),
               "parameters": t.get("input_schema", {})}} for t in body.get("tools") or []]}
    if "chat_template_kwargs" in body:
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    return out


def responses_to_chat(body: dict) -> dict:
    """server_chat_convert_responses_to_chatcmpl: `instructions` a system message first;
    message items kept (input_text -> text); function_call / reasoning items join the
    assistant message before them (or start one); function_call_output -> tool messages;
    only `function` tools (custom, tool_search, web_search are skipped)."""
    msgs: list[dict] = []
    if "instructions" in body:
        msgs.append({"role": "system", "content": body.get("instructions") or ""})
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for it in items:
        it = dict(it)
        merge = bool(msgs) and msgs[-1].get("role") == "assistant"
        if isinstance(it.get("content"), str):
            it["content"] = [{"type": "input_text", "text": it["content"]}]
        role, typ = it.get("role"), it.get("type")
        if role in ("user", "system", "developer") and isinstance(it.get("content"), list):
            it["content"] = [{"type": "text", "text": p["text"]} for p in it["content"]]
            it.pop("type", None)
            it.pop("status", None)
            msgs.append(it)
        elif role == "assistant" and typ == "message":
            parts = [{"type": "text", "text": p["text"]} for p in it.get("content") or []]
            if merge:
                msgs[-1].setdefault("content", [])
                msgs[-1]["content"] = (msgs[-1]["content"] or []) + parts
            else:
                msgs.append({"role": "assistant", "content": parts})
        elif typ == "function_call":
            call_ = {"function": {"arguments": it["arguments"], "name": it["name"]},
                     "id": it["call_id"], "type": "function"}
            if merge:
                msgs[-1].setdefault("tool_calls", []).append(call_)
            else:
                msgs.append({"role": "assistant", "tool_calls": [call_]})
        elif typ == "function_call_output":
            msgs.append({"content": it["output"], "role": "tool", "tool_call_id": it["call_id"]})
        elif typ == "reasoning":
            text = it["content"][0]["text"]
            if merge:
                msgs[-1]["reasoning_content"] = text
            else:
                msgs.append({"role": "assistant", "content": [], "reasoning_content": text})
        else:
            raise ValueError(f"Cannot determine type of 'item': {it}")
    tools = []
    for t in body.get("tools") or []:
        if t.get("type") != "function":
            continue
        f = {k: v for k, v in t.items() if k != "type"}
        f.setdefault("strict", True)
        tools.append({"type": "function", "function": f})
    out = {"messages": msgs, "tools": tools}
    if "chat_template_kwargs" in body:
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    return out


def template_inputs(chat: dict) -> dict:
    """common/chat.cpp's last steps before the template: developer -> system, tool-call
    arguments parsed to objects (templates iterating `arguments|items`), content and
    reasoning trimmed, chat_template_kwargs as template variables."""
    msgs = []
    for m in chat["messages"]:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        c = m.get("content")
        if isinstance(c, str):
            m["content"] = c.strip()
        elif isinstance(c, list):
            m["content"] = [{**p, "text": p["text"].strip()} if "text" in p else p for p in c]
        if isinstance(m.get("reasoning_content"), str):
            m["reasoning_content"] = m["reasoning_content"].strip()
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments":
                                json.loads(tc["function"]["arguments"])}}
                               if isinstance(tc["function"].get("arguments"), str) else tc
                               for tc in m["tool_calls"]]
        msgs.append(m)
    kw = {"messages": msgs, "tools": chat.get("tools") or None}
    kw.update(chat.get("chat_template_kwargs") or {})
    return kw


def render(template: str, chat: dict, add_generation_prompt: bool = True) -> str:
    """The prompt a chat template makes of a chat body, rendered as Hugging Face (and
    vLLM) do, which llama.cpp's jinja engine follows: sandboxed, trim/lstrip blocks,
    `raise_exception`, `tojson` without ASCII escaping."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                   sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(add_generation_prompt=add_generation_prompt,
                                            **template_inputs(chat))


def qwen35() -> str:
    with open(os.path.join(TEMPLATES, "Qwen3.5-4B.jinja")) as f:
        return f.read()


# ------------------------------------------------- a model behind the official Qwen3.5 template

def _last_tool_output(body: dict, path: str) -> str | None:
    """The output of the tool call answered last in the conversation, or None when the
    conversation's last turn is not a tool result."""
    if path == "/v1/messages":
        msgs = body.get("messages") or []
        last = msgs[-1] if msgs else {}
        c = last.get("content")
        results = [b for b in c if isinstance(b, dict) and b.get("type") == "tool_result"] \
            if isinstance(c, list) else []
        return _text(results) if results else None
    if path == "/v1/chat/completions":
        msgs = body.get("messages") or []
        last = msgs[-1] if msgs else {}
        if last.get("role") != "tool":
            return None
        return _text(last.get("content"))
    items = body.get("input") if isinstance(body.get("input"), list) else []
    last = items[-1] if items else {}
    if isinstance(last, dict) and last.get("type") == "function_call_output":
        out = last.get("output")
        return out if isinstance(out, str) else json.dumps(out)
    return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


SHELL_TOOLS = {"Bash": {"command": "echo hello", "description": "Print hello"},
               "exec_command": {"cmd": "echo hello"},
               "shell": {"command": ["echo", "hello"]},
               "run_shell_command": {"command": "echo hello"},                 # Qwen Code
               "bash": {"command": "echo hello", "description": "Print hello"}}  # OpenCode


def tool_model(body: dict, path: str) -> Reply:
    """An agent's model making one shell call (Claude Code's Bash, Codex's
    exec_command) `echo hello`, then answering `DONE: <the tool's last output line>`;
    any other request (titles, summaries) gets "ok"."""
    out = _last_tool_output(body, path)
    if out is not None:
        return Reply(content=f"DONE: {_last_line(out)}")
    names = [t.get("name") or (t.get("function") or {}).get("name")
             for t in body.get("tools") or [] if isinstance(t, dict)]
    for name, args in SHELL_TOOLS.items():
        if name in names:
            return Reply(content="Running it.", tool_calls=[call(name, args)])
    return Reply(content="ok")


class Rendering:
    """A responder for tests.support.dialects.ScriptedDialects that renders every
    request through a chat template the way llama-server does (Messages and Responses
    converted to chat first: anthropic_to_chat / responses_to_chat, then the template
    with jinja2) before `responder` answers it. A template exception is answered as
    llama-server answers it: 500 `{"error": {"code": 500, "message": "Jinja
    Exception: ...", "type": "server_error"}}`; an input item llama-server cannot
    convert, 400 invalid_request_error. Every rendered prompt lands in `prompts`,
    every refusal in `refused`."""

    def __init__(self, responder=tool_model, template: str | None = None):
        self.responder = responder
        self.template = template or qwen35()
        self.prompts: list[str] = []
        self.refused: list[str] = []

    def __call__(self, body: dict, path: str):
        import jinja2

        from .dialects import LlamaError
        try:
            chat = anthropic_to_chat(body) if path == "/v1/messages" else \
                responses_to_chat(body) if path == "/v1/responses" else body
        except (ValueError, KeyError, TypeError) as e:
            self.refused.append(str(e))
            return LlamaError(400, {"error": {"code": 400, "message": str(e),
                                              "type": "invalid_request_error"}})
        try:
            self.prompts.append(render(self.template, chat))
        except jinja2.TemplateError as e:
            self.refused.append(str(e))
            return LlamaError(500, {"error": {"code": 500,
                                              "message": f"Jinja Exception: {e}",
                                              "type": "server_error"}})
        return self.responder(body, path)


def cli(name: str) -> str:
    path = tool(agents_bin(), name)
    if path is None:
        pytest.fail(f"the {name} CLI is not installed (node + tests/testbed/setup.sh "
                    f"step_agents; TESTBED_AGENTS_BIN={os.environ.get('TESTBED_AGENTS_BIN')})")
    return path


def run(cmd: list[str], home, env: dict) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "NO_COLOR": "1", **env}
    p = subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{cmd[0]} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def codex_home(tmp_path, url: str, extra: str = "") -> str:
    home = tmp_path / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(f"""model = "scripted-model"
model_provider = "local"
{extra}
[model_providers.local]
name = "coding-stack"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "LOCAL_KEY"
""")
    return str(home)
