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

from tests.support.agents import QUERY, agents_bin, searching_model, tool
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
