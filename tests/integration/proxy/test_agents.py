"""The real agent CLIs, headless, against the real proxy (`python -m proxy`): Claude Code
(`claude -p`, Anthropic Messages, its WebSearch tool sends `web_search_20250305`) and
Codex (`codex exec`, OpenAI Responses, `web_search` tool). A scripted model makes them
search; the stack runs the search against a SearXNG-shaped server; the CLI must finish
and print the answer built on the search result (the first result's URL).

The CLIs come from npm (tests/testbed/setup.sh step_agents, cached); missing CLIs are
a failure of the test bed, not a skip."""
import json
import os
import subprocess

import pytest

from tests.support.agents import QUERY, Rendering, agents_bin, searching_model, tool
from tests.support.agents import _last_tool_output, _text
from tests.support.chat import Reply, call
from tests.support.metrics import scrape
from tests.support.servers import ServerThread
from tests.support.dialects import ScriptedDialects
from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng

URL = "https://example.com/flask-3-1-changelog/0"
PROMPT = "Search the web: what changed in Flask 3.1?"


@pytest.fixture
def stack():
    with FakeSearxng() as searx, ScriptedDialects() as model, \
            ProxyProcess(BACKEND_URL=model.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
                         KEEPALIVE_INTERVAL=0.5) as proxy:
        model.responder = searching_model
        yield proxy, model, searx


@pytest.fixture
def qwen_stack():
    """The real proxy in front of a model that renders every request through the
    official Qwen3.5 template as llama-server does (a template exception: its 500)."""
    rendering = Rendering()
    with FakeSearxng() as searx, ScriptedDialects() as model, \
            ProxyProcess(BACKEND_URL=model.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
                         KEEPALIVE_INTERVAL=0.5) as proxy:
        model.responder = rendering
        yield proxy, model, rendering


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


def test_claude_code_web_search(stack, tmp_path):
    proxy, model, searx = stack
    p = run([cli("claude"), "-p", PROMPT, "--max-turns", "4", "--allowedTools", "WebSearch"],
            tmp_path, {"ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_AUTH_TOKEN": "x",
                       "ANTHROPIC_MODEL": "scripted-model",
                       "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted-model",
                       "ANTHROPIC_SMALL_FAST_MODEL": "scripted-model",
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                       "DISABLE_AUTOUPDATER": "1"})
    assert f"ANSWER: the changelog is at {URL}" in p.stdout
    assert searx.queries == [QUERY]
    assert set(model.paths) == {"/v1/messages"}
    assert all(b.get("stream") for b in model.requests), "Claude Code streams"
    # Claude Code's WebSearch call: the backend got our plain tool, never the server tool
    sub = [b for b in model.requests if [t.get("name") for t in b.get("tools") or []]
           == ["web_search"]]
    assert sub and all("type" not in b["tools"][0] for b in sub)
    assert not any(t.get("type", "").startswith("web_search_2")
                   for b in model.requests for t in b.get("tools") or [])
    # and Claude Code read our web_search_tool_result blocks: its tool result lists them
    main = [b for b in model.requests if "WebSearch" in
            [t.get("name") for t in b.get("tools") or []]]
    last = json.dumps(main[-1]["messages"][-1])
    assert "Links:" in last and URL in last


CLAUDE_ENV = {"ANTHROPIC_AUTH_TOKEN": "x", "ANTHROPIC_MODEL": "scripted-model",
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
SHELL_PROMPT = "Run `echo hello` in the shell and tell me what it printed."


def tool_results(model) -> list[dict]:
    """The requests that carried a tool's result last (the CLI ran the call)."""
    out = []
    for b, path in zip(model.requests, model.paths):
        last = (b.get("messages") or b.get("input") or [{}])[-1]
        c = last.get("content") if isinstance(last, dict) else None
        if last.get("type") == "function_call_output" or isinstance(c, list) and any(
                isinstance(x, dict) and x.get("type") == "tool_result" for x in c):
            out.append(b)
    return out


def test_claude_code_bash_call_through_the_qwen_template(qwen_stack, tmp_path):
    """Claude Code 2.1.197 sends a system message inside `messages`, which the Qwen
    3.5 template refuses: through the proxy every request renders, the model's one
    Bash call runs, and the CLI prints the answer built on its output."""
    proxy, model, rendering = qwen_stack
    p = run([cli("claude"), "-p", SHELL_PROMPT, "--max-turns", "3", "--allowedTools", "Bash"],
            tmp_path, {"ANTHROPIC_BASE_URL": proxy.url,
                       "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted-model",
                       "ANTHROPIC_SMALL_FAST_MODEL": "scripted-model", **CLAUDE_ENV})
    assert "DONE: hello" in p.stdout
    assert rendering.refused == [], "every request rendered through the Qwen3.5 template"
    assert len(rendering.prompts) == len(model.requests)
    assert tool_results(model), "the Bash call ran and its result came back"
    assert set(model.paths) == {"/v1/messages"}


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


def test_codex_shell_call_through_the_qwen_template(qwen_stack, tmp_path):
    """Codex 0.171.0 opens `input` with two developer messages (two system messages
    to the template, the second refused): through the proxy every request renders,
    the model's one exec_command call runs, and `codex exec` completes."""
    proxy, model, rendering = qwen_stack
    p = run([cli("codex"), "exec", "--skip-git-repo-check", SHELL_PROMPT], tmp_path,
            {"CODEX_HOME": codex_home(tmp_path, proxy.url), "LOCAL_KEY": "x"})
    assert "DONE: hello" in p.stdout
    assert rendering.refused == []
    assert tool_results(model), "the shell call ran and its output came back"
    assert set(model.paths) == {"/v1/responses"}


def mcp_model(body: dict, path: str) -> Reply:
    """Calls the MCP server's `lookup` tool (whatever the backend calls it) once, then
    answers with its output."""
    out = _last_tool_output(body, path)
    if out is not None:
        return Reply(content="DONE: " + out[:300])
    names = [t.get("name") for t in body.get("tools") or []]
    found = [n for n in names if isinstance(n, str) and n.endswith("lookup")]
    if found:
        return Reply(tool_calls=[call(found[0], {"word": "hello"})])
    return Reply(content="no lookup tool reached me")


def test_codex_mcp_tool_call_through_the_qwen_template(qwen_stack, tmp_path):
    """Codex with an MCP server configured sends its tools grouped in `namespace`
    tools (`mcp__docs__` and its own `multi_agent_v1`), which llama-server would skip:
    the backend gets plain function tools (`mcp__docs__lookup`), the model's call of
    one comes back in Codex's shape (name + namespace): Codex runs the MCP tool and
    sends its output, its history call goes back under the backend's name."""
    import sys
    proxy, model, rendering = qwen_stack
    rendering.responder = mcp_model
    model.llama_style = True
    server = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          "support", "mcp_server.py")
    home = codex_home(tmp_path, proxy.url, extra=f"""
[mcp_servers.docs]
command = "{sys.executable}"
args = ["{server}"]
""")
    p = run([cli("codex"), "exec", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox",
             "Look up the word hello with the docs tool."], tmp_path,
            {"CODEX_HOME": home, "LOCAL_KEY": "x"})
    assert "mcp: docs/lookup (completed)" in p.stderr, p.stderr[-2000:]
    assert "DEFINITION of hello: a greeting" in p.stdout
    assert rendering.refused == []
    first, *rest = model.requests
    assert "mcp__docs__lookup" in [t.get("name") for t in first["tools"]]
    assert not [t for t in first["tools"] if t.get("type") == "namespace"]
    assert rest, "Codex sent the tool's output back"
    calls = [i for i in rest[-1]["input"] if i.get("type") == "function_call"]
    assert calls and calls[-1]["name"] == "mcp__docs__lookup" and "namespace" not in calls[-1]


def test_codex_web_search(stack, tmp_path):
    proxy, model, searx = stack
    home = tmp_path / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(f"""model = "scripted-model"
model_provider = "local"
web_search = "live"

[model_providers.local]
name = "coding-stack"
base_url = "{proxy.url}/v1"
wire_api = "responses"
env_key = "LOCAL_KEY"
""")
    p = run([cli("codex"), "exec", "--skip-git-repo-check", PROMPT], tmp_path,
            {"CODEX_HOME": str(home), "LOCAL_KEY": "x"})
    assert f"ANSWER: the changelog is at {URL}" in p.stdout
    assert f"web search: {QUERY}" in p.stderr, "Codex showed our web_search_call"
    assert searx.queries == [QUERY]
    assert set(model.paths) == {"/v1/responses"}
    assert all(b.get("stream") for b in model.requests)
    first = model.requests[0]
    assert {"type": "function", "name": "web_search"}.items() <= \
        [t for t in first["tools"] if t.get("name") == "web_search"][0].items()
    assert not any(t.get("type") in ("web_search", "web_search_preview")
                   for b in model.requests for t in b.get("tools") or [])


# ----------------------------------------------- Claude Code with only ANTHROPIC_MODEL set

HELPER = "Reply with hi"


def delegating_model(body: dict, path: str) -> Reply:
    """The main agent delegates to a sub-agent on the haiku tier (Claude Code's Agent
    tool, `model: "haiku"`: with no ANTHROPIC_DEFAULT_HAIKU_MODEL its requests name
    claude-haiku-*), then answers with what the helper said."""
    msgs = body.get("messages") or []
    if msgs and HELPER in _text(msgs[0].get("content")):
        return Reply(content="hi from the helper")
    out = _last_tool_output(body, path)
    if out is not None:
        return Reply(content="DONE: " + (out.strip().splitlines() or [""])[0])
    if "Agent" in [t.get("name") for t in body.get("tools") or []]:
        return Reply(tool_calls=[call("Agent", {
            "description": "Say hi", "prompt": HELPER, "subagent_type": "general-purpose",
            "model": "haiku"})])
    return Reply(content="ok")


@pytest.fixture
def swapper_stack():
    """The real swapper (in-process, its Docker runtime replaced by the fake one:
    tests/support/fake_runtime.py, the fixture registry), whose tiny-a "container" is
    a scripted model behind the Qwen3.5 template; the real proxy in front of it."""
    from swapper.app import create_app
    from swapper.settings import Settings as SwapperSettings
    from tests.support.fake_runtime import FakeRuntime
    from tests.support.swapperproc import FIXTURE_BACKENDS
    env = {"TESTBED_BASE_IMAGE": "base", "TESTBED_LLAMACPP_IMAGE": "llama",
           "TESTBED_MODELS_DIR": "/models", "TESTBED_MODEL_FILE": "m.gguf",
           "TESTBED_VLLM_IMAGE": "vllm", "TESTBED_VLLM_MODEL_NAME": "m"}
    rendering = Rendering(delegating_model)
    with FakeSearxng() as searx, ScriptedDialects() as model:
        model.responder = rendering
        runtime = FakeRuntime({"tiny-a": model.url})
        app = create_app(SwapperSettings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=env,
                                         WATCH_INTERVAL=5), runtime=runtime)
        with ServerThread(app) as swapper, ProxyProcess(
                BACKEND_URL=swapper.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
                KEEPALIVE_INTERVAL=0.5) as proxy:
            yield proxy, swapper, runtime, model, rendering


def test_claude_code_with_only_anthropic_model_never_swaps_nor_404s(swapper_stack, tmp_path):
    """A user who sets only ANTHROPIC_MODEL: Claude Code's haiku-tier work (here a
    sub-agent) names claude-haiku-*; the swapper answers it with the resident model
    (model_patterns), so the session starts one model, swaps none, and nothing
    answers 404 (Claude Code's HEAD of the base URL included)."""
    proxy, swapper, runtime, model, rendering = swapper_stack
    p = run([cli("claude"), "-p", "Ask a helper agent to say hi.", "--max-turns", "3",
             "--allowedTools", "Agent"], tmp_path, {"ANTHROPIC_BASE_URL": proxy.url, **CLAUDE_ENV,
                                                   "ANTHROPIC_MODEL": "tiny-a"})
    assert "DONE: hi from the helper" in p.stdout
    assert rendering.refused == []
    assert [c for c in runtime.calls if c[0] in ("start", "stop")] == [("start", "tiny-a")], \
        "one model start over the session, no swap"
    px, sw = scrape(proxy.url), scrape(swapper.url)
    haiku = {m for m in px.labels("proxy_prompt_tokens_total", "model")
             if m.startswith("claude-haiku-")}
    assert haiku, "the haiku tier was asked for by its own name"
    assert sw.value("swapper_models_mapped_total", model="tiny-a", pattern="claude-*") >= 1
    assert "404" not in px.labels("proxy_requests_total", "status")
    assert "404" not in sw.labels("swapper_requests_total", "status")
    assert len(model.requests) >= 3
