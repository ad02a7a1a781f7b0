"""Each setting declared once; docs/configuration.md and .env.example are what
`python -m scripts.settings_doc` writes from the declarations, and
docker-compose.yaml passes each service the settings it declares (issue 34)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from common.config import GROUPS, declared
from proxy.settings import Settings as ProxySettings
from scripts import settings_doc
from swapper.settings import MODEL_VARIABLES
from swapper.settings import Settings as SwapperSettings

REPO = Path(__file__).resolve().parents[2]
# Groups compose passes through by name (a name alone: the shell's or .env's value).
PASSED = {"proxy": ("proxy", "both"), "swapper": ("swapper", "both", "models")}


def test_the_committed_files_are_what_the_declarations_give():
    for path, text in settings_doc.outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)} drifted from the declarations: run "
            f"`python -m scripts.settings_doc` and commit the result")


def test_the_check_command_says_so():
    r = subprocess.run([sys.executable, "-m", "scripts.settings_doc", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_each_name_is_declared_once_with_help_in_a_table():
    names = [v.name for v in settings_doc.variables()]
    assert len(names) == len(set(names))
    tables = settings_doc.tables()          # raises on a missing help or table
    assert list(tables) == [g for g in GROUPS if g in tables]
    # the names both services read: one declaration, in the table of both
    both = {v.name for v in tables["both"]}
    assert both == {"CONNECT_TIMEOUT", "ALLOWED_HOSTS", "KEEPALIVE_INTERVAL"}
    env = [line.partition("=")[0] for line in (REPO / ".env.example").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    assert len(env) == len(set(env)), "a name stands twice in .env.example"
    assert env.count("KEEPALIVE_INTERVAL") == 1


def _compose_environment(service: str) -> dict[str, str | None]:
    cfg = yaml.safe_load((REPO / "docker-compose.yaml").read_text())
    out: dict[str, str | None] = {}
    for item in cfg["services"][service]["environment"]:
        name, eq, value = item.partition("=")
        out[name] = value if eq else None
    return out


def test_compose_passes_each_service_what_it_declares():
    """Every setting of a service (its own, both services', what backends/
    interpolates) is passed by name; compose sets only declared ones."""
    for service, cls in (("proxy", ProxySettings), ("swapper", SwapperSettings)):
        env = _compose_environment(service)
        mine = declared(cls, service) + (list(MODEL_VARIABLES) if service == "swapper" else [])
        passed = {v.name for v in mine if v.group in PASSED[service]}
        by_name = {name for name, value in env.items()
                   if value is None or value.startswith("${%s:-" % name)}
        assert sorted(passed - by_name) == [], f"{service}: compose does not pass these"
        assert sorted(set(env) - {v.name for v in mine}) == [], \
            f"{service}: compose sets variables the service does not declare"
        for v in mine:
            if v.group == "fixed" and v.name in env:
                assert env[v.name] is not None, f"{service}: {v.name} is fixed by compose"


def test_compose_defaults_are_the_declared_ones():
    """`${VAR:-default}` in docker-compose.yaml says what the declaration says."""
    declared_defaults = {v.name: v.default for v in settings_doc.variables()}
    text = json.dumps(yaml.safe_load((REPO / "docker-compose.yaml").read_text()))
    found = re.findall(r"\$\{([A-Z0-9_]+):-([^}]*)\}", text)
    assert found
    for name, default in found:
        assert name in declared_defaults, f"compose reads {name}: declare it"
        assert declared_defaults[name] == default, (name, declared_defaults[name], default)
