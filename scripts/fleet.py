#!/usr/bin/env python3
"""Write LiteLLM's proxy config for several stacks from their `/v1/models`.

    python scripts/fleet.py --stack gpu1=http://gpu1:11433 --stack gpu2=http://gpu2:11433 \\
        -o deploy/fleet/config.yaml

Every model id a stack declares becomes a LiteLLM model group with one deployment per
stack that declares it -- two in fact: `openai/<id>` at `<stack>/v1` (chat completions,
Responses, completions) and `anthropic/<id>` at `<stack>` (Anthropic Messages, passed
through natively so server tools and their result blocks stay intact); the routing
plugin (deploy/fleet/routing.py) picks the one that fits the request's dialect. The
stacks' aliases become model-group aliases. A stack's API key is passed on as
`os.environ/FLEET_KEY_<NAME>` (never written into the file); the router's own key is
`os.environ/LITELLM_MASTER_KEY`. A person's key of the stacks' shared key store
(`cs-...`) is no part of the config: the plugin passes it on per request in place of
FLEET_KEY (docs/fleet.md, Keys).

The agents' own model names (Claude Code's `claude-*` tiers -- haiku for background
calls -- and Codex's `gpt-5*` / `codex-*` defaults), which a stack answers with a
registry model through its `model_patterns` (backends/models/agents.yaml), become
LiteLLM wildcard model groups: `model_name: "claude-*"` with deployments
`openai/claude-*` and `anthropic/claude-*` on every stack that maps the pattern (LiteLLM
puts the client's name in place of the `*`, so the name reaches the stack unchanged and
the stack's own mapping answers it). A stack's /v1/models does not list its patterns:
each stack is taken to map the registry's shipped ones (claude-*, gpt-5*, codex-* ->
@resident) unless `--patterns NAME=GLOB[:USE],...` says otherwise (`--patterns NAME=`:
none). Only `*` wildcards (LiteLLM's); LiteLLM matches a name against the most specific
(longest) glob only, so give the stacks the same globs.

`--strategy simple-shuffle` writes the same deployments without the plugin (LiteLLM's
default routing), for comparison.
"""
from __future__ import annotations

import argparse
import sys

import requests
import yaml


# The registry's shipped model_patterns (swapper/registry.py DEFAULT_PATTERNS,
# backends/models/agents.yaml): what a stack maps unless told otherwise.
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("claude-*", "@resident"), ("gpt-5*", "@resident"), ("codex-*", "@resident"))


def parse_patterns(text: str) -> list[tuple[str, str]]:
    """"claude-*,gpt-5*:qwen" -> [("claude-*", "@resident"), ("gpt-5*", "qwen")]"""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part:
            glob, _, use = part.partition(":")
            out.append((glob.strip(), use.strip() or "@resident"))
    return out


def env_name(stack: str) -> str:
    return "FLEET_KEY_" + stack.upper().replace("-", "_")


def fetch_models(url: str, key: str | None = None, timeout: float = 10.0) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    r.raise_for_status()
    return [d for d in r.json().get("data", []) if isinstance(d, dict) and d.get("id")]


def pattern_deployments(stack: str, base: str, key: str, models: list[dict],
                        patterns) -> list[dict]:
    """The wildcard deployments of one stack's model_patterns (see the module doc)."""
    names = {}
    for m in models:
        for n in (m["id"], *(m.get("aliases") or [])):
            names[n] = m["id"]
    out = []
    for glob, use in patterns:
        if any(c in glob for c in "?[]"):
            print(f"fleet: {stack}: pattern {glob!r}: LiteLLM matches '*' only; skipped",
                  file=sys.stderr)
            continue
        if use == "@default":           # the stack's DEFAULT_MODEL, else its first model
            use = models[0]["id"] if models else "@resident"
        elif use != "@resident":
            if use not in names:
                print(f"fleet: {stack}: pattern {glob!r} uses {use!r}, not a model there; "
                      f"skipped", file=sys.stderr)
                continue
            use = names[use]
        info = {"fleet_stack": stack, "fleet_url": base, "fleet_pattern": glob,
                "fleet_use": use, "supports_web_search": True, "mode": "chat"}
        for api, api_base in (("openai", base + "/v1"), ("anthropic", base)):
            out.append({
                "model_name": glob,
                "litellm_params": {"model": f"{api}/{glob}", "api_base": api_base,
                                   "api_key": key},
                "model_info": {**info, "id": f"{stack}:{api}:{glob}", "fleet_api": api},
            })
    return out


def build(stacks: dict[str, list[dict]], urls: dict[str, str], strategy: str = "fleet",
          keyed: set[str] | None = None, cooldown: float = 10.0, poll: float = 1.0,
          patterns: dict[str, list[tuple[str, str]]] | None = None) -> dict:
    """The config (a dict) for stacks {name: their /v1/models data} at urls {name: base};
    `patterns` {name: [(glob, use)]}: each stack's model_patterns (a stack not named:
    DEFAULT_PATTERNS)."""
    keyed = keyed or set()
    patterns = patterns or {}
    model_list, aliases, wild = [], {}, []
    for stack, models in stacks.items():
        base = urls[stack].rstrip("/")
        key = f"os.environ/{env_name(stack)}" if stack in keyed else "none"
        wild += pattern_deployments(stack, base, key, models,
                                    patterns.get(stack, DEFAULT_PATTERNS))
        for m in models:
            mid = m["id"]
            info = {"fleet_stack": stack, "fleet_url": base, "fleet_model": mid,
                    "supports_web_search": True, "mode": "chat"}
            for api, model, api_base in (("openai", f"openai/{mid}", base + "/v1"),
                                         ("anthropic", f"anthropic/{mid}", base)):
                model_list.append({
                    "model_name": mid,
                    "litellm_params": {"model": model, "api_base": api_base, "api_key": key},
                    "model_info": {**info, "id": f"{stack}:{api}:{mid}", "fleet_api": api},
                })
            for a in m.get("aliases") or []:
                if a in aliases and aliases[a] != mid:
                    print(f"fleet: alias {a!r} names {aliases[a]!r} and {mid!r}; keeping "
                          f"{aliases[a]!r}", file=sys.stderr)
                    continue
                aliases.setdefault(a, mid)
    ids = {d["model_name"] for d in model_list}
    aliases = {a: m for a, m in aliases.items() if a not in ids}
    model_list += [d for d in wild if d["model_name"] not in ids]
    router = {
        "routing_strategy": "simple-shuffle",
        # a stack that fails is cooled down at once and its traffic retried on another
        # stack declaring the model; it comes back by itself when the cooldown ends
        "allowed_fails": 1, "cooldown_time": cooldown, "num_retries": 2, "retry_after": 0,
        # loads and swaps take minutes (vLLM): never time a stack out during one
        "timeout": 1800, "stream_timeout": 1800,
        "model_group_alias": aliases,
    }
    litellm = {"telemetry": False, "drop_params": False, "request_timeout": 1800}
    general = {
        "master_key": "os.environ/LITELLM_MASTER_KEY",
        # LiteLLM's model health checks send completions (each could start a load):
        # off. The plugin learns health from /healthz and /v1/models instead.
        "background_health_checks": False,
    }
    if strategy == "fleet":
        litellm["callbacks"] = ["routing.fleet_router"]
        # the master key or a 401 (LiteLLM's own check: 400 "No connected db." for a
        # wrong key when no database is configured)
        general["custom_auth"] = "routing.fleet_auth"
    elif strategy != "simple-shuffle":
        router["routing_strategy"] = strategy
    return {
        "model_list": model_list,
        "router_settings": router,
        "litellm_settings": litellm,
        "general_settings": general,
        "environment_variables": {
            "FLEET_STACKS": ",".join(f"{s}={urls[s].rstrip('/')}" for s in stacks),
            "FLEET_POLL_INTERVAL": str(poll),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", action="append", required=True, metavar="NAME=URL",
                    help="a stack's name and proxy base URL (repeat per stack)")
    ap.add_argument("-o", "--output", default="-", help="where to write (default: stdout)")
    ap.add_argument("--strategy", default="fleet",
                    help="fleet (the plugin, default) or a LiteLLM routing_strategy")
    ap.add_argument("--cooldown", type=float, default=10.0, help="seconds a failed stack rests")
    ap.add_argument("--poll", type=float, default=1.0, help="status poll interval, seconds")
    ap.add_argument("--patterns", action="append", default=[], metavar="NAME=GLOB[:USE],...",
                    help="a stack's model_patterns (default: claude-*,gpt-5*,codex-* -> "
                         "@resident, the registry's shipped ones; NAME= for none)")
    a = ap.parse_args(argv)
    pats = {}
    for spec in a.patterns:
        name, sep, text = spec.partition("=")
        if not sep or not name:
            ap.error(f"--patterns {spec!r}: want NAME=GLOB[:USE],...")
        pats[name] = parse_patterns(text)
    import os
    urls, stacks, keyed = {}, {}, set()
    for spec in a.stack:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            ap.error(f"--stack {spec!r}: want NAME=http://host:port")
        urls[name] = url
        key = os.environ.get(env_name(name))
        if key:
            keyed.add(name)
        try:
            stacks[name] = fetch_models(url, key)
        except (requests.RequestException, ValueError) as e:
            print(f"fleet: {name} ({url}): {e}", file=sys.stderr)
            return 1
    if set(pats) - set(urls):
        ap.error(f"--patterns names no --stack: {', '.join(sorted(set(pats) - set(urls)))}")
    text = yaml.safe_dump(build(stacks, urls, a.strategy, keyed, a.cooldown, a.poll, pats),
                          sort_keys=False)
    if a.output == "-":
        sys.stdout.write(text)
    else:
        with open(a.output, "w") as f:
            f.write(text)
        print(f"fleet: wrote {a.output}: " + ", ".join(
            f"{n} ({len(m)} models)" for n, m in stacks.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
