"""The real agent CLIs, headless, against the real proxy (`python -m proxy`): Claude Code
(`claude -p`, Anthropic Messages, its WebSearch tool sends `web_search_20250305`) and
Codex (`codex exec`, OpenAI Responses, `web_search` tool). A scripted model makes them
search; the stack runs the search against a SearXNG-shaped server; the CLI must finish
and print the answer built on the search result (the first result's URL).

The CLIs come from npm (tests/testbed/setup.sh step_agents, cached); missing CLIs are
a failure of the test bed, not a skip."""
import glob
import json
import os
import subprocess
import time

import pytest

from tests.support.agents import QUERY, Rendering, cli, codex_home, run, searching_model
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
        if last.get("type") == "function_call_output" or last.get("role") == "tool" or \
                isinstance(c, list) and any(
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
    from tests.support.swapperproc import ENV, FIXTURE_BACKENDS
    rendering = Rendering(delegating_model)
    with FakeSearxng() as searx, ScriptedDialects() as model:
        model.responder = rendering
        runtime = FakeRuntime({"tiny-a": model.url})
        app = create_app(SwapperSettings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV,
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


# ----------------------------------------------- waits longer than the agent's idle timer

# Claude Code's stream watchdog (2.1.197, read in its cli.js): every event but `ping`
# resets it; CLAUDE_STREAM_IDLE_TIMEOUT_MS can only raise it above 300 s. The suite
# runs the CLI on a clock SPEED times as fast (libfaketime, Debian's `faketime`), so a
# wait of 40 s is 400 s to it.
FAKETIME = next(iter(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")), "libfaketimeMT")
SPEED = 20
CLAUDE_WAIT = 20.0              # s of our clock: 400 s of Claude Code's, > its 300 s
CODEX_IDLE_MS = 2000            # Codex's stream_idle_timeout_ms, its own setting
CODEX_WAIT = 5.0


@pytest.fixture
def waits(monkeypatch):
    """The real proxy app (in-process, so what it strips can be seen) in front of a
    scripted model behind the Qwen3.5 template, its first request waiting before
    any answer (a long prefill: llama-server sends nothing until its first token).
    make(progress) -> the proxy's URL; the model; the Rendering; the strips made."""
    from proxy.dialects import anthropic
    from proxy.settings import Settings
    from tests.support.proxyproc import inprocess
    stripped = []
    real = anthropic.Progress.strip

    def strip(body):
        changed = real(body)
        stripped.append(changed)
        return changed
    monkeypatch.setattr(anthropic.Progress, "strip", staticmethod(strip))
    rendering = Rendering()
    with FakeSearxng() as searx, ScriptedDialects() as model:
        model.responder = rendering
        servers = []

        def make(progress: bool) -> str:
            srv = inprocess(Settings.from_env({}, BACKEND_URL=model.url, SEARXNG_URL=searx.url,
                                              MODELS_TTL=0, KEEPALIVE_INTERVAL=0.5,
                                              WAIT_PROGRESS=progress)).__enter__()
            servers.append(srv)
            return srv.url
        yield make, model, rendering, stripped
        for s in servers:
            s.__exit__(None, None, None)


def wait_arrivals(model, n: int, timeout: float = 60.0) -> None:
    """Requests still held in their scripted wait have arrived but not been answered."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(model.requests) < n:
        time.sleep(0.1)


@pytest.mark.parametrize("progress", [True, False], ids=["progress", "comments-only"])
def test_claude_code_through_a_prefill_longer_than_its_idle_timer(waits, tmp_path, progress):
    """A first turn whose prefill outlasts Claude Code's 300 s stream watchdog: with the
    stack's progress (a thinking block: Claude Code counts every event but ping) the one
    request is answered and the session completes with one request per turn; with
    comments only (the control: the wait is really longer than its timer) Claude Code
    abandons the stream and sends it again. The progress block Claude Code sends back
    in turn 2 is taken out before the model sees it."""
    if not os.path.exists(FAKETIME):
        pytest.fail(f"{FAKETIME} missing: the test bed installs Debian's faketime")
    make, model, rendering, stripped = waits
    url = make(progress)
    model.head_delays = [CLAUDE_WAIT]
    p = run([cli("claude"), "-p", SHELL_PROMPT, "--max-turns", "3", "--allowedTools", "Bash"],
            tmp_path, {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted-model",
                       "ANTHROPIC_SMALL_FAST_MODEL": "scripted-model", **CLAUDE_ENV,
                       "LD_PRELOAD": FAKETIME, "FAKETIME": f"+0 x{SPEED}"})
    assert "DONE: hello" in p.stdout
    if not progress:
        assert model.arrivals == 3, "the control: turn 1 abandoned and sent again, turn 2"
        return
    assert model.arrivals == 2, "one request per turn, no retry"
    assert rendering.refused == []
    assert True in stripped, "Claude Code sent our progress block back; it was taken out"
    raw = b"".join(model.raw)
    assert b"coding-stack-wait" not in raw and b"waiting for the model" not in raw
    assert not any("waiting for the model" in pr for pr in rendering.prompts)


@pytest.mark.parametrize("progress", [True, False], ids=["progress", "comments-only"])
def test_codex_through_a_prefill_longer_than_its_idle_timer(waits, tmp_path, progress):
    """Codex's stream_idle_timeout_ms (its own setting, 2 s here; no stream retry):
    comments do not count (the control fails with "idle timeout waiting for SSE");
    response.created and response.in_progress do."""
    make, model, rendering, _ = waits
    url = make(progress)
    model.head_delays = [CODEX_WAIT]
    home = codex_home(tmp_path, url, extra="")
    with open(os.path.join(home, "config.toml"), "a") as f:
        f.write(f"stream_idle_timeout_ms = {CODEX_IDLE_MS}\nstream_max_retries = 0\n"
                "request_max_retries = 0\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NO_COLOR": "1",
           "CODEX_HOME": home, "LOCAL_KEY": "x"}
    p = subprocess.run([cli("codex"), "exec", "--skip-git-repo-check", SHELL_PROMPT],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    if not progress:
        assert p.returncode != 0 and "idle timeout waiting for SSE" in p.stderr, p.stderr
        wait_arrivals(model, 1)
        assert model.arrivals == 1
        return
    assert p.returncode == 0, p.stderr[-2000:]
    assert "DONE: hello" in p.stdout
    assert model.arrivals == 2, "one request per turn, no retry"
    assert rendering.refused == []


class _SlowStart:
    """A FakeRuntime whose start takes CODEX_WAIT seconds (a cold start)."""

    def start(self, spec, on_progress=None, prepared=None):
        import time
        time.sleep(CODEX_WAIT)
        return super().start(spec, on_progress, prepared)


def _codex_behind_the_swapper(tmp_path, model_id: str, slow_start: bool, before=None):
    """Codex (idle timer 2 s, no retry) asking `model_id` through the real proxy and
    the in-process swapper (its runtime the fake one, the model's "container" a
    scripted model behind the Qwen3.5 template); `before(swapper_url, model)` runs
    first. (the process's result, the scripted model, the runtime)"""
    from swapper.app import create_app
    from swapper.settings import Settings as SwapperSettings
    from tests.support.fake_runtime import FakeRuntime
    from tests.support.swapperproc import ENV, FIXTURE_BACKENDS

    rendering = Rendering()
    runtime_cls = type("Runtime", (_SlowStart, FakeRuntime), {}) if slow_start else FakeRuntime
    with FakeSearxng() as searx, ScriptedDialects() as model:
        model.responder = rendering
        runtime = runtime_cls({model_id: model.url})
        app = create_app(SwapperSettings(BACKENDS_DIR=str(FIXTURE_BACKENDS), env=ENV,
                                         WATCH_INTERVAL=5, KEEPALIVE_INTERVAL=0.5),
                         runtime=runtime)
        with ServerThread(app) as swapper, ProxyProcess(
                BACKEND_URL=swapper.url, SEARXNG_URL=searx.url, MODELS_TTL=0,
                KEEPALIVE_INTERVAL=0.5) as proxy:
            if before is not None:
                before(swapper.url, model)
            home = codex_home(tmp_path, proxy.url)
            with open(os.path.join(home, "config.toml"), "r+") as f:
                text = f.read().replace('model = "scripted-model"', f'model = "{model_id}"')
                f.seek(0)
                f.write(text + f"stream_idle_timeout_ms = {CODEX_IDLE_MS}\n"
                        "stream_max_retries = 0\nrequest_max_retries = 0\n")
            p = run([cli("codex"), "exec", "--skip-git-repo-check", SHELL_PROMPT], tmp_path,
                    {"CODEX_HOME": home, "LOCAL_KEY": "x"})
    assert rendering.refused == []
    return p, model, runtime


def test_codex_through_a_load_longer_than_its_idle_timer(tmp_path):
    """The wait is the swapper's (a cold start: the model's "container" takes 5 s to
    start; a hold or a download wait the same way: its waiting stream's comments):
    Codex gets the stack's progress and completes, one request per turn, one start."""
    p, model, runtime = _codex_behind_the_swapper(tmp_path, "tiny-a", slow_start=True)
    assert "DONE: hello" in p.stdout
    assert model.arrivals == 2, "one request per turn, no retry"
    assert [c for c in runtime.calls if c[0] == "start"] == [("start", "tiny-a")]


def test_codex_through_a_queue_longer_than_its_idle_timer(tmp_path):
    """The wait is the swapper's queue: tiny-b's one slot is taken by another
    request for 5 s when Codex's first turn comes; it queues, gets the stack's
    progress, and is served when the slot frees: one request per turn."""
    import threading
    import requests as http
    from tests.support.servers import wait_until

    def occupy(swapper_url, model):
        model.head_delays = [CODEX_WAIT]
        threading.Thread(target=lambda: http.post(
            swapper_url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny-b", "messages": [{"role": "user", "content": "hi"}]}),
            daemon=True).start()
        wait_until(lambda: model.arrivals == 1, "the other request at the model", 10)
    p, model, _ = _codex_behind_the_swapper(tmp_path, "tiny-b", slow_start=False,
                                            before=occupy)
    assert "DONE: hello" in p.stdout
    assert model.arrivals == 3, "the other request, then one per turn, no retry"


QWEN_IDLE_MS = 2000             # QWEN_STREAM_IDLE_TIMEOUT_MS, Qwen Code's own setting
QWEN_WAIT = 5.0


def qwen_code() -> tuple[str, str]:
    """Qwen Code's CLI and the folder of its node 22 (tests/testbed/setup.sh
    step_qwen_code)."""
    cache = os.environ.get("CODING_STACK_CACHE", "/var/cache/coding-stack")
    for d in sorted(glob.glob(os.path.join(cache, "agents-qwen-*", "node_modules", ".bin"))):
        if os.access(os.path.join(d, "qwen"), os.X_OK) and \
                os.access(os.path.join(d, "node"), os.X_OK):
            return os.path.join(d, "qwen"), d
    pytest.fail("Qwen Code is not installed (tests/testbed/setup.sh step_qwen_code)")


@pytest.mark.parametrize("progress", [True, False], ids=["progress", "comments-only"])
def test_qwen_code_through_a_prefill_longer_than_its_idle_timer(waits, tmp_path, progress):
    """Qwen Code 0.24.4 (chat completions; the stack injects web_search beside its tools)
    with its stream idle timer at 2 s (QWEN_STREAM_IDLE_TIMEOUT_MS): a first turn that
    waits 5 s for its first token. With the stack's progress (a role chunk, then empty
    content deltas) the one request is answered and its shell call runs: one request
    per turn, every prompt rendered by the Qwen3.5 template; with comments only (the
    control) Qwen Code drops the stream and sends it again."""
    qwen, node_bin = qwen_code()
    make, model, rendering, _ = waits
    url = make(progress)
    model.head_delays = [QWEN_WAIT]
    p = run([qwen, "-p", SHELL_PROMPT, "--yolo"], tmp_path, {
        "PATH": node_bin + os.pathsep + os.environ["PATH"],
        "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": "x", "OPENAI_MODEL": "scripted-model",
        "QWEN_STREAM_IDLE_TIMEOUT_MS": str(QWEN_IDLE_MS),
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})
    assert "DONE:" in p.stdout, p.stdout + p.stderr[-2000:]
    if not progress:
        assert model.arrivals == 3, "the control: turn 1 dropped and sent again, turn 2"
        return
    assert model.arrivals == 2, "one request per turn, no retry"
    assert tool_results(model), "the shell call ran and its output came back"
    assert rendering.refused == []
    first = model.requests[0]
    names = [t["function"]["name"] for t in first["tools"]]
    assert "run_shell_command" in names and names[-1] == "web_search"


def chat_agent(name: str) -> str:
    """OpenCode's or the Continue CLI's binary (tests/testbed/setup.sh step_chat_agents)."""
    cache = os.environ.get("CODING_STACK_CACHE", "/var/cache/coding-stack")
    for d in sorted(glob.glob(os.path.join(cache, "agents-chat-*", "node_modules", ".bin"))):
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    pytest.fail(f"{name} is not installed (tests/testbed/setup.sh step_chat_agents)")


def test_opencode_with_the_readme_setup(waits, tmp_path):
    """OpenCode 1.18.33 with docs/agents.md's opencode.json (the model pinned, its limit):
    its shell call runs through the Qwen3.5 template, every request streamed, one per
    turn, the first through a 2 s wait (the stack's progress chunks)."""
    make, model, rendering, _ = waits
    url = make(True)
    model.head_delays = [2.0]
    (tmp_path / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"coding-stack": {
            "npm": "@ai-sdk/openai-compatible", "name": "coding-stack",
            "options": {"baseURL": url + "/v1", "apiKey": "none"},
            "models": {"scripted-model": {"name": "scripted-model",
                                          "limit": {"context": 32768, "output": 4096}}}}},
        "model": "coding-stack/scripted-model", "small_model": "coding-stack/scripted-model"}))
    p = run([chat_agent("opencode"), "run", SHELL_PROMPT], tmp_path, {})
    assert "DONE: hello" in p.stdout, p.stdout + p.stderr[-2000:]
    assert rendering.refused == []
    assert tool_results(model), "the shell call ran and its output came back"
    # OpenCode's own side call (its title) may still sit in the scripted 2 s wait when
    # the run ends: let every arrival be recorded before counting.
    deadline = time.monotonic() + 10
    while model.arrivals != len(model.requests) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert model.arrivals == len(model.requests)
    sent = [json.dumps(b["messages"], sort_keys=True) for b in model.requests]
    assert len(set(sent)) == len(sent), "no request sent twice"
    assert all(b.get("stream") for b in model.requests)
    assert {b.get("max_tokens") for b in model.requests} == {4096}, "limit.output, as sent"


def test_continue_cli_with_the_readme_setup(waits, tmp_path):
    """The Continue CLI 1.5.47 with docs/agents.md's config (name, version: it refuses one
    without): its shell call runs through the Qwen3.5 template, one request per turn,
    the first through a 2 s wait."""
    make, model, rendering, _ = waits
    url = make(True)
    model.head_delays = [2.0]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""name: coding-stack
version: 1.0.0
schema: v1
models:
  - name: local
    provider: openai
    model: scripted-model
    apiBase: {url}/v1
    apiKey: none
    roles: [chat, edit, apply]
""")
    p = run([chat_agent("cn"), "-p", SHELL_PROMPT, "--config", str(cfg), "--auto"],
            tmp_path, {})
    assert "DONE: hello" in p.stdout, p.stdout + p.stderr[-2000:]
    assert rendering.refused == []
    assert tool_results(model), "the shell call ran and its output came back"
    assert model.arrivals == len(model.requests) == 2, "one request per turn"
    assert all(b.get("stream") for b in model.requests)
