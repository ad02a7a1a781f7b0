"""The fleet's routing choice (deploy/fleet/routing.py) and config generator
(scripts/fleet.py), without LiteLLM: a pure function, a poller against scripted
stacks, the deployments narrowing, the config's shape."""
import importlib.util
import json

import pytest
from flask import Flask, jsonify

from scripts import fleet
from tests.support.process import REPO
from tests.support.servers import ServerThread

_spec = importlib.util.spec_from_file_location("fleet_routing", REPO / "deploy" / "fleet" / "routing.py")
routing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(routing)
S = routing.StackStatus


def st(resident=None, state="ready", busy=0, up=True, **models):
    return S(up=up, resident=resident, state=state if resident else "idle", busy=busy,
             models=models)


# ------------------------------------------------------------------ choose

def test_loaded_beats_idle_beats_swap():
    status = {"A": st("alpha", alpha="loaded", beta="unloaded"),
              "B": st(None, beta="unloaded"), "C": st("beta", beta="loaded")}
    assert routing.choose("beta", ["A", "B", "C"], status) == "C"
    assert routing.choose("beta", ["A", "B"], status) == "B"        # a load, not a swap
    assert routing.choose("alpha", ["A", "B"], status) == "A"


def test_never_a_swapping_stack_when_another_has_it_resident():
    status = {"A": st("beta", state="loading", beta="loading"),       # swapping to beta
              "B": st("beta", beta="loaded")}
    assert routing.choose("beta", ["A", "B"], status) == "B"
    # ... and a stack loading it is still better than one that would swap again
    status["B"] = st("gamma", gamma="loaded", beta="unloaded")
    assert routing.choose("beta", ["A", "B"], status) == "A"


def test_ties_go_to_the_least_busy_then_the_first_named():
    status = {"A": st("beta", busy=3, beta="loaded"), "B": st("beta", busy=1, beta="loaded")}
    assert routing.choose("beta", ["A", "B"], status) == "B"
    status["B"].busy = 3
    assert routing.choose("beta", ["A", "B"], status) == "A"


def test_session_stays_unless_its_stack_is_down():
    status = {"A": st("alpha", alpha="loaded"), "B": st("beta", beta="loaded")}
    assert routing.choose("beta", ["A", "B"], status, session_stack="A") == "A"
    status["A"].up = False
    assert routing.choose("beta", ["A", "B"], status, session_stack="A") == "B"


def test_down_stacks_are_skipped_and_none_up_is_none():
    status = {"A": st("beta", beta="loaded", up=False), "B": st(None)}
    assert routing.choose("beta", ["A", "B"], status) == "B"
    status["B"].up = False
    assert routing.choose("beta", ["A", "B"], status) is None
    assert routing.choose("beta", ["A", "B"], {}) is None


# ------------------------------------------------------------------ request reading

@pytest.mark.parametrize("kw,sid", [
    ({"proxy_server_request": {"headers": {"X-Claude-Code-Session-Id": "s1"}}}, "h:s1"),
    ({"metadata": {"headers": {"x-session-id": "s2"}}}, "h:s2"),
    ({"litellm_metadata": {"headers": {"session_id": "codex-1"}}}, "h:codex-1"),
    ({"proxy_server_request": {"headers": {}, "body": {"metadata": {
        "user_id": json.dumps({"device_id": "d", "session_id": "cc-7"})}}}}, "s:cc-7"),
    ({"metadata": {"user_id": "user_abc"}}, "u:user_abc"),
    ({"metadata": {"litellm_session_id": "l9"}}, "l:l9"),
    ({"proxy_server_request": {"body": {"client_metadata": {"session_id": "cx1"}}}}, "c:cx1"),
    ({"prompt_cache_key": "cx2"}, "c:cx2"),
    ({}, None), (None, None),
])
def test_session_id(kw, sid):
    assert routing.session_id(kw) == sid


def test_wanted_api_by_route():
    assert routing.wanted_api({"proxy_server_request": {"url": "http://r/v1/messages"}}) == "anthropic"
    assert routing.wanted_api({"proxy_server_request": {"url": "http://r/v1/responses"}}) == "openai"
    assert routing.wanted_api({"proxy_server_request": {
        "url": "http://r/v1/chat/completions?x=1"}}) == "openai"
    assert routing.wanted_api(None) == "openai"


# ------------------------------------------------------------------ the poller

def scripted_stack(health: dict, models: list[dict], wrap=True) -> ServerThread:
    app = Flask("stack")

    @app.get("/healthz")
    def healthz():
        if wrap:     # the proxy's shape: the swapper's answer under upstream.body
            return jsonify({"status": "ok", "service": "proxy", "upstream": {
                "status": "ok" if health.get("status") == "ok" else "unreachable",
                "body": health}})
        return jsonify(health)

    @app.get("/v1/models")
    def v1_models():
        return jsonify({"object": "list", "data": models})

    @app.post("/v1/chat/completions")
    def never():                                   # the poller must never get here
        raise AssertionError("a completion was sent")

    return ServerThread(app)


def test_poller_reads_health_and_models_never_a_completion():
    health = {"status": "ok", "model": "beta", "state": "ready", "in_flight": 2, "queued": 1}
    models = [{"id": "alpha", "status": {"value": "unloaded"}},
              {"id": "beta", "status": {"value": "loaded"}}]
    with scripted_stack(health, models) as a, scripted_stack(health, models, wrap=False) as b:
        p = routing.StatusPoller({"A": a.url, "B": b.url, "C": "http://127.0.0.1:9"}, timeout=1)
        p.poll()
        for name in ("A", "B"):
            s = p.status[name]
            assert s.up and s.resident == "beta" and s.state == "ready" and s.busy == 3
            assert s.models == {"alpha": "unloaded", "beta": "loaded"}
        assert not p.status["C"].up                  # nothing listens there
        health["status"] = "degraded"                # the swapper lost Docker
        p.poll()
        assert not p.status["A"].up and not p.status["B"].up


# ------------------------------------------------------------------ the LiteLLM hook

def deployments(*specs):
    return [{"model_name": m, "litellm_params": {"model": f"{api}/{m}"},
             "model_info": {"id": f"{s}:{api}:{m}", "fleet_stack": s, "fleet_api": api,
                            "fleet_model": m, "fleet_url": f"http://{s}"}}
            for s, api, m in specs]


class FakePoller:
    def __init__(self, status):
        self.status = status


def test_filter_narrows_to_one_deployment_of_the_right_dialect():
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st("alpha", alpha="loaded"), "B": st("beta", beta="loaded")})
    ds = deployments(("A", "openai", "beta"), ("A", "anthropic", "beta"),
                     ("B", "openai", "beta"), ("B", "anthropic", "beta"))
    chat = {"proxy_server_request": {"url": "http://r/v1/chat/completions",
                                     "headers": {"x-session-id": "s"}}}
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, chat)] == ["B:openai:beta"]
    msgs = {"proxy_server_request": {"url": "http://r/v1/messages", "headers": {"x-session-id": "s"}}}
    r.poller.status["A"] = st("beta", beta="loaded")      # now both: the session keeps B
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, msgs)] == ["B:anthropic:beta"]
    r.poller.status = {}                                   # none known up: LiteLLM decides
    assert len(r.pick("beta", ds, chat)) == 2
    other = [{"model_name": "x", "litellm_params": {"model": "openai/x"}, "model_info": {}}]
    assert r.pick("x", other, chat) == other               # not ours: untouched


def test_a_retry_goes_to_another_stack_than_the_one_that_failed():
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st(None), "B": st("beta", beta="loaded")})
    ds = deployments(("A", "openai", "beta"), ("B", "openai", "beta"))
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions"}}
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, kw)] == ["B:openai:beta"]
    kw["metadata"] = {"previous_models": [{"deployment_id": "B:openai:beta",
                                           "exception_type": "ServiceUnavailableError"}]}
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, kw)] == ["A:openai:beta"]
    kw["metadata"]["previous_models"].append({"deployment_id": "A:openai:beta"})
    assert len(r.pick("beta", ds, kw)) == 1                 # all tried: still a choice


def test_sessions_are_bounded():
    r = routing.FleetRouter(sessions=3, models_per_session=2)
    for i in range(5):
        r.remember(f"s{i}", "beta", "A")
    assert list(r.sessions) == ["s2", "s3", "s4"]
    for m in ("alpha", "beta", "gamma"):
        r.remember("s4", m, "A")
    assert list(r.sessions["s4"]["models"]) == ["beta", "gamma"]


def test_a_session_keeps_a_stack_per_model():
    """Issue 30: a session on B for beta asks once for alpha (only A declares it); its
    next beta turn goes back to B (beta resident there, its cache), not to A where
    the session last went (a swap of alpha there)."""
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st(None), "B": st(None)})
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions",
                                   "headers": {"x-session-id": "s"}}}
    beta = deployments(("A", "openai", "beta"), ("B", "openai", "beta"))
    alpha = deployments(("A", "openai", "alpha"))
    r.poller.status = {"A": st("alpha", alpha="loaded"), "B": st(None)}
    assert [d["model_info"]["id"] for d in r.pick("beta", beta, kw)] == ["B:openai:beta"]
    r.poller.status["B"] = st("beta", beta="loaded")
    assert [d["model_info"]["id"] for d in r.pick("alpha", alpha, kw)] == ["A:openai:alpha"]
    for _ in range(3):
        assert [d["model_info"]["id"] for d in r.pick("beta", beta, kw)] == ["B:openai:beta"]
    assert r.sessions["h:s"]["models"] == {"alpha": "A", "beta": "B"}
    # the stickiness is the session's: beta now resident on A as well, B still chosen
    r.poller.status["A"] = st("beta", beta="loaded")
    assert [d["model_info"]["id"] for d in r.pick("beta", beta, kw)] == ["B:openai:beta"]
    # and an agent's own name follows the session's latest turn (B)
    ds = wild(("A", "openai", "claude-*", "@resident"), ("B", "openai", "claude-*", "@resident"))
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["B:openai:claude-*"]


# ------------------------------------------------------------------ scripts/fleet.py

def test_config_groups_aliases_and_keys():
    stacks = {"gpu1": [{"id": "alpha", "aliases": ["al"]}, {"id": "beta", "aliases": ["be"]}],
              "gpu2": [{"id": "beta", "aliases": ["be", "b2"]}, {"id": "gamma"}]}
    urls = {"gpu1": "http://gpu1:11433/", "gpu2": "http://gpu2:11433"}
    cfg = fleet.build(stacks, urls, keyed={"gpu2"})
    by = {}
    for d in cfg["model_list"]:
        by.setdefault(d["model_name"], []).append(d)
    assert sorted(by) == ["alpha", "beta", "claude-*", "codex-*", "gamma", "gpt-5*"]
    assert {(d["model_info"]["fleet_stack"], d["litellm_params"]["model"], d["litellm_params"]["api_base"])
            for d in by["beta"]} == {
        ("gpu1", "openai/beta", "http://gpu1:11433/v1"), ("gpu1", "anthropic/beta", "http://gpu1:11433"),
        ("gpu2", "openai/beta", "http://gpu2:11433/v1"), ("gpu2", "anthropic/beta", "http://gpu2:11433")}
    assert {d["litellm_params"]["api_key"] for d in by["gamma"]} == {"os.environ/FLEET_KEY_GPU2"}
    assert {d["litellm_params"]["api_key"] for d in by["alpha"]} == {"none"}
    assert cfg["router_settings"]["model_group_alias"] == {"al": "alpha", "be": "beta", "b2": "beta"}
    assert cfg["litellm_settings"]["callbacks"] == ["routing.fleet_router"]
    assert cfg["general_settings"]["background_health_checks"] is False
    assert cfg["general_settings"]["custom_auth"] == "routing.fleet_auth"
    assert cfg["environment_variables"]["FLEET_STACKS"] == "gpu1=http://gpu1:11433,gpu2=http://gpu2:11433"
    ids = [d["model_info"]["id"] for d in cfg["model_list"]]
    assert len(ids) == len(set(ids))


def test_default_strategy_config_has_no_plugin():
    cfg = fleet.build({"a": [{"id": "m"}]}, {"a": "http://a"}, strategy="simple-shuffle")
    assert "callbacks" not in cfg["litellm_settings"]
    assert "custom_auth" not in cfg["general_settings"]
    assert cfg["router_settings"]["routing_strategy"] == "simple-shuffle"


@pytest.mark.parametrize("given, ok", [
    ("sk-master", True), ("Bearer sk-master", True), ("bearer  sk-master ", True),
    ("sk-wrong", False), ("Bearer sk-maste", False), ("", False), (None, False),
    ("Bearer ", False)])
def test_the_routers_key_check(given, ok):
    assert routing.check_key(given, "sk-master") is ok
    assert routing.check_key(given, "") is False            # no master key: nothing passes


def test_cli_writes_the_config_from_the_stacks(tmp_path):
    health = {"status": "ok", "model": None, "state": "idle"}
    with scripted_stack(health, [{"id": "alpha", "aliases": ["al"], "status": {"value": "unloaded"}}]) as a:
        out = tmp_path / "config.yaml"
        assert fleet.main(["--stack", f"A={a.url}", "-o", str(out)]) == 0
        import yaml
        cfg = yaml.safe_load(out.read_text())
        assert {d["model_name"] for d in cfg["model_list"]} == {"alpha", "claude-*", "gpt-5*",
                                                                "codex-*"}
        assert fleet.main(["--stack", f"A={a.url}", "-o", str(out), "--patterns",
                           "A=claude-haiku-*:al,gpt-5*"]) == 0
        pats = {d["model_name"]: d["model_info"]["fleet_use"]
                for d in yaml.safe_load(out.read_text())["model_list"] if "fleet_pattern" in d["model_info"]}
        assert pats == {"claude-haiku-*": "alpha", "gpt-5*": "@resident"}   # the alias: its id
        assert fleet.main(["--stack", f"A={a.url}", "-o", str(out), "--patterns", "A="]) == 0
        assert {d["model_name"] for d in yaml.safe_load(out.read_text())["model_list"]} == {"alpha"}
    assert fleet.main(["--stack", "A=http://127.0.0.1:9"]) == 1          # unreachable: said, 1


# ------------------------------------------------------------------ agents' own model names

def test_agents_names_are_wildcard_groups_on_the_stacks_that_map_them():
    """claude-* / gpt-5* / codex-*: a wildcard model group with an openai/ and an
    anthropic/ deployment on each stack mapping the pattern, the client's name passed
    through (LiteLLM puts it in place of the *); a stack with no patterns has none."""
    stacks = {"A": [{"id": "alpha"}], "B": [{"id": "beta", "aliases": ["be"]}], "C": [{"id": "c"}]}
    urls = {"A": "http://a:11433", "B": "http://b:11433", "C": "http://c:11433"}
    cfg = fleet.build(stacks, urls, keyed={"B"},
                      patterns={"B": [("claude-*", "be"), ("gpt-5*", "@resident")], "C": []})
    wild = {}
    for d in cfg["model_list"]:
        if "fleet_pattern" in d["model_info"]:
            wild.setdefault(d["model_name"], set()).add(
                (d["model_info"]["fleet_stack"], d["litellm_params"]["model"],
                 d["litellm_params"]["api_base"], d["litellm_params"]["api_key"],
                 d["model_info"]["fleet_use"], d["model_info"]["id"]))
    assert wild == {
        "claude-*": {("A", "openai/claude-*", "http://a:11433/v1", "none", "@resident", "A:openai:claude-*"),
                     ("A", "anthropic/claude-*", "http://a:11433", "none", "@resident", "A:anthropic:claude-*"),
                     ("B", "openai/claude-*", "http://b:11433/v1", "os.environ/FLEET_KEY_B", "beta",
                      "B:openai:claude-*"),
                     ("B", "anthropic/claude-*", "http://b:11433", "os.environ/FLEET_KEY_B", "beta",
                      "B:anthropic:claude-*")},
        "gpt-5*": {("A", "openai/gpt-5*", "http://a:11433/v1", "none", "@resident", "A:openai:gpt-5*"),
                   ("A", "anthropic/gpt-5*", "http://a:11433", "none", "@resident", "A:anthropic:gpt-5*"),
                   ("B", "openai/gpt-5*", "http://b:11433/v1", "os.environ/FLEET_KEY_B", "@resident",
                    "B:openai:gpt-5*"),
                   ("B", "anthropic/gpt-5*", "http://b:11433", "os.environ/FLEET_KEY_B", "@resident",
                    "B:anthropic:gpt-5*")},
        "codex-*": {("A", "openai/codex-*", "http://a:11433/v1", "none", "@resident", "A:openai:codex-*"),
                    ("A", "anthropic/codex-*", "http://a:11433", "none", "@resident",
                     "A:anthropic:codex-*")},
    }


def test_pattern_globs_litellm_cannot_match_and_unknown_models_are_skipped(capsys):
    cfg = fleet.build({"A": [{"id": "alpha"}]}, {"A": "http://a"},
                      patterns={"A": [("claude-?", "@resident"), ("gpt-5*", "nope"),
                                      ("codex-*", "@default")]})
    wild = {d["model_name"]: d["model_info"]["fleet_use"] for d in cfg["model_list"]
            if "fleet_pattern" in d["model_info"]}
    assert wild == {"codex-*": "alpha"}                 # @default: the stack's first model
    err = capsys.readouterr().err
    assert "'claude-?'" in err and "'nope'" in err


def test_a_model_id_shadows_a_pattern_group_of_the_same_name():
    cfg = fleet.build({"A": [{"id": "claude-*"}]}, {"A": "http://a"})
    assert [d["model_info"].get("fleet_pattern") for d in cfg["model_list"]
            if d["model_name"] == "claude-*"] == [None, None]


def wild(*specs):
    """Pattern deployments (stack, api, glob, use)."""
    return [{"model_name": "claude-haiku-4-5", "litellm_params": {"model": f"{api}/claude-haiku-4-5"},
             "model_info": {"id": f"{s}:{api}:{glob}", "fleet_stack": s, "fleet_api": api,
                            "fleet_pattern": glob, "fleet_use": use, "fleet_url": f"http://{s}"}}
            for s, api, glob, use in specs]


def test_rank_of_any_resident_model_never_a_swap():
    assert routing.rank(None, st("alpha", alpha="loaded")) == (0, 0)
    assert routing.rank(None, st("alpha", state="loading", alpha="loading")) == (1, 0)
    assert routing.rank(None, st(None)) == (2, 0)


def test_an_agents_name_goes_to_its_sessions_stack_first():
    """claude-haiku-* in a session whose main model's turns went to B: B (no swap, its
    cache), though A also has a model loaded and is named first."""
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st("alpha", alpha="loaded"), "B": st("beta", beta="loaded")})
    main = deployments(("A", "openai", "beta"), ("B", "openai", "beta"))
    chat = {"proxy_server_request": {"url": "http://r/v1/chat/completions",
                                     "headers": {"x-session-id": "s"}}}
    r.remember("h:s", "beta", "B")
    assert [d["model_info"]["id"] for d in r.pick("beta", main, chat)] == ["B:openai:beta"]
    ds = wild(("A", "openai", "claude-*", "@resident"), ("A", "anthropic", "claude-*", "@resident"),
              ("B", "openai", "claude-*", "@resident"), ("B", "anthropic", "claude-*", "@resident"))
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, chat)] == ["B:openai:claude-*"]
    msgs = {"proxy_server_request": {"url": "http://r/v1/messages", "headers": {}, "body": {
        "metadata": {"user_id": json.dumps({"session_id": "cc"})}}}}
    r.remember("s:cc", "beta", "B")
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, msgs)] == ["B:anthropic:claude-*"]
    # the session's stack down: where something is loaded
    r.poller.status["B"].up = False
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, chat)] == ["A:openai:claude-*"]


def test_an_agents_name_without_a_session_goes_where_something_is_loaded():
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st(None), "B": st("gamma", gamma="loaded"), "C": st(None)})
    ds = wild(("A", "openai", "claude-*", "@resident"), ("B", "openai", "claude-*", "@resident"),
              ("C", "openai", "claude-*", "@resident"))
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions"}}
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["B:openai:claude-*"]
    r.poller.status["B"] = st("gamma", state="loading", gamma="loading")
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["B:openai:claude-*"]
    r.poller.status["B"] = st(None)                        # nothing anywhere: as usual (first)
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["A:openai:claude-*"]


def test_an_agents_name_mapped_to_a_fixed_model_ranks_by_that_model():
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st("alpha", alpha="loaded"), "B": st("beta", beta="loaded")})
    ds = wild(("A", "openai", "claude-*", "beta"), ("B", "openai", "claude-*", "beta"))
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions"}}
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["B:openai:claude-*"]


def test_an_agents_name_never_sets_the_sessions_stack():
    """Claude Code's first background call can come before the main model's first turn:
    it follows a session but does not start one (else it could pull the session onto
    a stack where the main model would be a swap)."""
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st("alpha", alpha="loaded"), "B": st("beta", beta="loaded")})
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions",
                                   "headers": {"x-session-id": "new"}}}
    ds = wild(("A", "openai", "claude-*", "@resident"), ("B", "openai", "claude-*", "@resident"))
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["A:openai:claude-*"]
    assert "h:new" not in r.sessions
    main = deployments(("A", "openai", "beta"), ("B", "openai", "beta"))
    assert [d["model_info"]["id"] for d in r.pick("beta", main, kw)] == ["B:openai:beta"]
    assert r.sessions["h:new"] == {"models": {"beta": "B"}, "last": "B"}
    assert [d["model_info"]["id"] for d in r.pick("claude-haiku-4-5", ds, kw)] == ["B:openai:claude-*"]


# ------------------------------------------------------------------ a person's key (issue 35)

PERSON = "cs-" + "k" * 43                                   # the stacks' store's form


@pytest.mark.parametrize("given, key", [
    (PERSON, PERSON), (f"Bearer {PERSON}", PERSON), (f" bearer {PERSON} ", PERSON),
    (PERSON[:-1], None), (PERSON + "x", None), ("cs-" + "k" * 42 + "!", None),
    ("sk-master", None), ("", None), (None, None)])
def test_a_persons_key_by_its_form(given, key):
    assert routing.person_key(given) == key


class Auth:                                       # what fleet_auth hands LiteLLM back
    def __init__(self, api_key):
        self.api_key = api_key


def run(coro):
    import asyncio
    return asyncio.run(coro)


def test_the_pre_call_hook_passes_the_key_that_fleet_auth_recorded():
    """The request's api_key becomes the key whose digest fleet_auth recorded, read
    from the raw headers LiteLLM keeps aside (the Authorization or x-api-key it came
    in); a master-key request is left as it is."""
    r = routing.FleetRouter()
    other = "cs-" + "o" * 43
    passed = Auth(routing.PASSED + routing.key_digest(PERSON))
    for headers in ({"authorization": f"Bearer {PERSON}"},
                    {"authorization": f"Bearer {other}", "x-api-key": PERSON}):
        data = {"model": "beta", "secret_fields": {"raw_headers": headers}}
        assert run(r.async_pre_call_hook(passed, None, data, "acompletion"))["api_key"] == PERSON
    data = {"model": "beta", "secret_fields": {"raw_headers": {"authorization": "Bearer sk-m"}}}
    assert "api_key" not in run(r.async_pre_call_hook(Auth("hashed-master"), None, data, "x"))
    with pytest.raises(Exception):              # the recorded key is not in the headers
        run(r.async_pre_call_hook(passed, None, {"secret_fields": {"raw_headers": {
            "authorization": f"Bearer {other}"}}}, "acompletion"))


class Refused(Exception):
    def __init__(self, status, retry_after=None):
        super().__init__(f"{status}")
        self.status_code = status
        self.headers = {"retry-after": retry_after} if retry_after else {}


def attempt(stack: str, call: str = "c1", key: str = PERSON) -> dict:
    """A failed attempt's kwargs as LiteLLM hands them to the deployment hooks."""
    return {"litellm_call_id": call, "api_key": key, "metadata": {"model_info": {
        "id": "a-per-request-id", "original_model_id": f"{stack}:openai:beta",
        "fleet_stack": stack}}}


def test_a_stacks_refusal_of_a_persons_key_is_the_answer_on_no_other_stack():
    """A 401, 403 or 429 from the stack that got a person's key ends the request with
    that answer at LiteLLM's retry (pick raises it: no other stack is asked); any other
    failure sends the retry to another stack, though LiteLLM names the attempt by a
    per-request id. The record ends with the answer (the headers hook), which keeps
    a 429's Retry-After."""
    r = routing.FleetRouter()
    r.poller = FakePoller({"A": st("beta", beta="loaded"), "B": st(None)})
    ds = deployments(("A", "openai", "beta"), ("B", "openai", "beta"))
    kw = {"proxy_server_request": {"url": "http://r/v1/chat/completions"},
          "litellm_call_id": "c1", "api_key": PERSON}
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, kw)] == ["A:openai:beta"]
    run(r.async_post_call_failure_deployment_hook(attempt("A"), Refused(503), None))
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, kw)] == ["B:openai:beta"]
    refusal = Refused(429, retry_after="1")
    run(r.async_post_call_failure_deployment_hook(attempt("B"), refusal, None))
    with pytest.raises(Refused) as e:
        r.pick("beta", ds, kw)
    assert e.value is refusal
    assert run(r.async_post_call_response_headers_hook(kw, None, None)) == {"retry-after": "1"}
    assert r.failed == {}                                  # ended with its answer
    assert [d["model_info"]["id"] for d in r.pick("beta", ds, kw)] == ["A:openai:beta"]
    # the master key's requests keep LiteLLM's own ways (no record)
    master = {**kw, "api_key": "sk-master", "litellm_call_id": "c2"}
    run(r.async_post_call_failure_deployment_hook(attempt("A", "c2", "sk-master"),
                                                  Refused(401), None))
    assert r.failed == {} and len(r.pick("beta", ds, master)) == 1
    # a Messages request's record ends with its failure (no headers hook there)
    msgs = {**kw, "proxy_server_request": {"url": "http://r/v1/messages"}, "litellm_call_id": "c3"}
    run(r.async_post_call_failure_deployment_hook(attempt("A", "c3"), Refused(403), None))
    assert list(r.failed) == ["c3"]
    run(r.async_post_call_failure_hook(msgs, Refused(403), None))
    assert r.failed == {}


def test_the_records_of_failed_attempts_are_bounded():
    r = routing.FleetRouter()
    r.max_failed = 3
    for i in range(5):
        run(r.async_post_call_failure_deployment_hook(attempt("A", f"c{i}"), Refused(503), None))
    assert list(r.failed) == ["c2", "c3", "c4"]
