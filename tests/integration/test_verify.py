"""./verify.sh, the live gate, on the real stack: the real swapper with the product's
registry (backends/) on the real Docker engine, the CPU models on the test bed's real
llama-server and CPU vLLM images, the real proxy in front, and a scripted SearXNG (no
real one can run here) for the web_search round trip.

The CPU models pass every probe; a GPU model fails (this host has none) with the reason
in the table and exit 1; a registry model without a gate entry, or an unknown name, is
refused with exit 2 before anything loads.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import requests

from tests.support.chat import Reply, ScriptedChat, call, search
from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng
from tests.support.swapperproc import SwapperProcess

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "verify.sh"
CPU_MODELS = ("smollm2", "smollm2-vllm")


@pytest.fixture(scope="module")
def stack():
    models_dir = os.environ["TESTBED_MODELS_DIR"]
    with FakeSearxng() as searx, SwapperProcess(
            backends_dir=REPO / "backends",
            LLAMACPP_CPU_IMAGE=os.environ["TESTBED_LLAMACPP_IMAGE"],
            LLAMACPP_CUDA_IMAGE=os.environ["TESTBED_LLAMACPP_IMAGE"],
            VLLM_CPU_IMAGE=os.environ["TESTBED_VLLM_IMAGE"],
            SMOLLM2_HF_DIR=os.environ["TESTBED_VLLM_MODEL_NAME"],
            MODELS_DIR=models_dir, HF_HOME=models_dir, PULL_IMAGES="0",
            CRASH_BACKOFF="0.01", CRASH_BACKOFF_MAX="0.05") as sw, ProxyProcess(
            BACKEND_URL=sw.url, SEARXNG_URL=searx.url, MAX_SEARCH_ITER="2",
            # SmolLM2 rambles: a small floor keeps each probe short on 2 cores
            TOOL_MAX_TOKENS_FLOOR="48") as proxy:
        yield proxy, sw, searx
        requests.post(sw.url + "/unload", timeout=120)


def verify(*args, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items()
         if k not in ("SEARXNG_URL", "WEB_SEARCH", "API_KEY", "PROXY_PORT")}
    e.update(env)
    return subprocess.run([str(VERIFY), *args], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=1500)


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows: model -> [load s, TTFT ms, tok/s, chat, stream, tools, n=2, search]."""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["model", "load", "s", "TTFT"], out
    got = {}
    for line in lines[2:]:
        if not line.strip():
            break
        cells = line.split()
        got[cells[0]] = cells[1:]
    return got


def test_the_cpu_models_pass_their_gate(stack):
    proxy, _, searx = stack
    r = verify("--url", proxy.url, "--search", *CPU_MODELS)
    assert r.returncode == 0, r.stdout + r.stderr
    table = rows(r.stdout)
    assert list(table) == list(CPU_MODELS)
    for model, cells in table.items():
        load_s, ttft, tok_s = (float(c) for c in cells[:3])
        assert load_s > 0 and ttft > 0 and tok_s > 0, (model, cells)
        # chat, stream, n=2 pass; SmolLM2 cannot call tools: its gate entry says so and why
        assert cells[3:] == ["pass", "pass", "skip", "pass", "skip"], (model, cells)
        for probe in ("load", "chat", "stream", "n=2"):
            assert f"  {model:<18} {probe:<7} pass " in r.stdout, (model, probe, r.stdout)
        for probe in ("tools", "search"):
            assert (f"  {model:<18} {probe:<7} skip  skipped by the gate entry: SmolLM2-135M "
                    "cannot call tools") in r.stdout, (model, probe, r.stdout)
    assert "verify: all probes passed (2 model(s))" in r.stdout


def test_search_is_skipped_when_searxng_is_not_configured(stack):
    proxy, _, _ = stack
    r = verify("--url", proxy.url, "--json", "smol")          # an alias
    assert r.returncode == 0, r.stdout + r.stderr
    (res,) = json.loads(r.stdout)
    assert res["model"] == "smollm2"
    assert res["probes"]["search"]["result"] == "skip"
    assert "SEARXNG_URL unset" in res["probes"]["search"]["reason"]
    for probe in ("load", "chat", "stream", "n=2"):
        assert res["probes"][probe]["result"] == "pass", res


def test_a_model_that_cannot_load_fails_with_the_reason(stack):
    proxy, _, _ = stack
    r = verify("--url", proxy.url, "--no-search", "qwen36")   # a seed alias of the 27B
    assert r.returncode == 1, r.stdout + r.stderr
    cells = rows(r.stdout)["qwen-38-27b"]
    assert cells[0] == "FAIL" and cells[3:] == ["skip"] * 5
    assert "qwen-38-27b        load    FAIL  HTTP 502" in r.stdout
    assert "GPU" in r.stdout and "not run: the model did not load" in r.stdout
    assert "verify: FAILED: qwen-38-27b load" in r.stdout


def test_a_registry_model_without_a_gate_entry_is_refused(stack, tmp_path):
    proxy, sw, _ = stack
    requests.post(sw.url + "/unload", timeout=120)
    gate = tmp_path / "gate.toml"
    gate.write_text('[smollm2]\ntool_choice = "named"\n')
    r = verify("--url", proxy.url, "--gate", str(gate))          # every model: most lack one
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("refused: no gate entry for qwen-38-27b, qwen-35b, qwen-122b, foundation, "
            "smollm2-vllm in ") in r.stderr
    assert requests.get(sw.url + "/running", timeout=30).json()["model"] is None, \
        "refused before loading anything"
    # the shipped gate file covers the shipped registry
    r = verify("--url", proxy.url, "--gate", str(REPO / "scripts" / "verify.toml"), "nope")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def test_no_stack_is_refused():
    r = verify("--url", "http://127.0.0.1:9", "smollm2")
    assert r.returncode == 2
    assert "no stack at http://127.0.0.1:9" in r.stderr


# ------------------------------------------- the probes' verdicts, with a scripted backend
# SmolLM2 cannot call tools, so the tool and web_search probes' passes (and the failures
# a capable model can have) are checked against a scripted backend speaking the chat
# wire format, behind the real proxy and its real search loop.

@pytest.fixture
def scripted(tmp_path):
    gate = tmp_path / "gate.toml"
    gate.write_text('[scripted]\ntool_choice = "auto"\nmax_tokens = 16\n')
    models = [{"id": "scripted", "object": "model", "aliases": ["s"], "kind": "llamacpp"}]
    with ScriptedChat(model="scripted", models=models) as chat, FakeSearxng() as searx, \
            ProxyProcess(BACKEND_URL=chat.url, SEARXNG_URL=searx.url) as proxy:
        yield chat, searx, proxy, gate


def test_tool_and_search_probes_against_a_scripted_backend(scripted):
    chat, searx, proxy, gate = scripted
    chat.script(Reply(content="Hello"),                                  # chat
                Reply(content="one two three four"),                     # stream
                Reply(tool_calls=[call("add", {"a": 17, "b": 25})]),     # tools
                Reply(content="red"),                                    # n=2: one choice only
                Reply(tool_calls=[search("latest python release")]),     # search, round 1
                Reply(content="Python 3.14 is out [1]."))                # search, round 2
    r = verify("--url", proxy.url, "--gate", str(gate), "--search", "s")
    assert r.returncode == 1, r.stdout + r.stderr
    assert rows(r.stdout)["scripted"][3:] == ["pass", "pass", "pass", "FAIL", "pass"], r.stdout
    assert "scripted           tools   pass  add(a=17, b=25) [tool_choice auto]" in r.stdout
    assert "scripted           n=2     FAIL  1 choice(s), indexes [0], not [0, 1]" in r.stdout
    assert "scripted           search  pass  1 search(es)" in r.stdout
    assert searx.queries == ["latest python release"]
    assert "verify: FAILED: scripted n=2" in r.stdout
    tools_req = chat.requests[2]
    assert tools_req["tool_choice"] == "auto"
    assert {t["function"]["name"] for t in tools_req["tools"]} == {"add", "web_search"}


@pytest.mark.parametrize("reply, reason", [
    (Reply(content="17 + 25 = 42"), "no tool call (auto); it answered '17 + 25 = 42'"),
    (Reply(tool_calls=[call("sub", {"a": 1, "b": 2})]), "it called 'sub', not 'add'"),
    (Reply(tool_calls=[call("add", '{"a": 17, "b"')]), """arguments are not JSON: '{"a": 17, "b"'"""),
    (Reply(tool_calls=[call("add", [17, 25])]), "arguments do not match the schema: [17, 25]"),
    (Reply(status=500, error="llama.cpp: failed to parse tool call"),
     "HTTP 500: llama.cpp: failed to parse tool call"),
])
def test_tool_probe_failures_say_why(scripted, reply, reason):
    chat, _, proxy, gate = scripted
    chat.script(Reply(content="Hello"), Reply(content="one two"), reply, Reply(content="red"))
    r = verify("--url", proxy.url, "--gate", str(gate), "--no-search", "--json", "scripted")
    assert r.returncode == 1
    (res,) = json.loads(r.stdout)
    assert res["probes"]["tools"]["result"] == "FAIL"
    assert res["probes"]["tools"]["reason"].startswith(reason), res["probes"]["tools"]


def test_a_failing_searxng_fails_the_search_probe_with_its_kind(scripted):
    chat, searx, proxy, gate = scripted
    searx.mode = "403"
    chat.script(Reply(content="Hello"), Reply(content="one two"),
                Reply(tool_calls=[call("add", {"a": 1, "b": 2})]), Reply(content="red"),
                Reply(tool_calls=[search("python")]), Reply(content="I could not search."))
    r = verify("--url", proxy.url, "--gate", str(gate), "--json", "scripted",
               SEARXNG_URL="http://configured-in-env")
    assert r.returncode == 1
    (res,) = json.loads(r.stdout)
    assert res["probes"]["search"]["result"] == "FAIL"
    assert "SearXNG failed (json_disabled x1)" in res["probes"]["search"]["reason"]
