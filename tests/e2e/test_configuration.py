"""Every documented setting reaches its service under compose.

Three descriptions of the configuration must agree: the tables of docs/configuration.md,
.env.example, and what `docker compose config` hands each service. Also: the values in
.env.example are the code's own defaults, every variable the code reads is documented,
and paths do not depend on the folder `docker compose` runs from.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from proxy.settings import Settings as ProxySettings
from swapper.settings import Settings as SwapperSettings

REPO = Path(__file__).resolve().parents[2]
SERVICE_TABLES = ("Compose", "Proxy and swapper", "Swapper", "Models", "Proxy")
# Read by both services, one value (common.settings.Shared).
BOTH = "Proxy and swapper"
# What compose fixes (docs/configuration.md's "Fixed by compose" table), per service.
FIXED = {
    "proxy": {"BACKEND_URL": "http://swapper:9000", "PROXY_HOST": "0.0.0.0", "PROXY_PORT": "11433"},
    "swapper": {"SWAPPER_HOST": "0.0.0.0", "SWAPPER_PORT": "9000", "BACKENDS_DIR": "/app/backends"},
}


def readme_tables() -> dict[str, dict[str, str | None]]:
    """{table: {VAR: default}} from docs/configuration.md's tables. A default is the
    backticked literal, or None when the cell describes it in words ("empty", "the
    compose folder"): .env.example then leaves the value empty."""
    section = (REPO / "docs" / "configuration.md").read_text()
    tables: dict[str, dict[str, str | None]] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"\*\*(.+?)\*\*", line)
        if m:
            current = m.group(1)
            tables[current] = {}
            continue
        if current is None or not line.startswith("| `"):
            continue
        var_cell, default_cell = [c.strip() for c in line.strip("|").split("|")][:2]
        names = re.findall(r"`([A-Z0-9_]+)`", var_cell)
        literals = re.findall(r"`([^`]*)`", default_cell)
        for i, name in enumerate(names):
            tables[current][name] = literals[i] if len(literals) == len(names) else None
    return tables


def env_example() -> dict[str, str]:
    out = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


def documented() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    tables = readme_tables()
    for t in SERVICE_TABLES:
        for var, default in tables[t].items():
            if var in out and out[var] and default:
                assert out[var] == default, f"{var}: docs/configuration.md gives two defaults"
            out[var] = out.get(var) or default
    return out


def test_the_configuration_page_has_the_tables():
    tables = readme_tables()
    assert set(SERVICE_TABLES) | {"Fixed by compose"} <= set(tables), list(tables)
    for t in tables.values():
        assert t


def test_env_example_lists_every_readme_variable_with_its_default():
    doc, ex = documented(), env_example()
    assert sorted(set(doc) - set(ex)) == [], "documented but missing from .env.example"
    assert sorted(set(ex) - set(doc)) == [], "in .env.example but in no table of docs/configuration.md"
    for var, default in doc.items():
        assert ex[var] == (default or ""), f"{var}: docs/configuration.md says {default!r}, .env.example {ex[var]!r}"
    fixed = readme_tables()["Fixed by compose"]
    assert not set(fixed) & set(ex), "compose fixes these: .env must not suggest them"


def test_env_example_values_are_the_code_defaults():
    """Copying .env.example to .env changes nothing: its values are what the services
    assume without it (HOST_DIR empty = derived, see swapper/hostdir.py)."""
    ex = env_example()
    assert ProxySettings.from_env(ex) == ProxySettings.from_env({})
    with_file = SwapperSettings.from_env(ex)
    without = SwapperSettings.from_env({})
    for f in ("env", "HOST_DIR"):
        with_file = type(with_file)(**{**with_file.__dict__, f: getattr(without, f)})
    assert with_file == without


def test_the_model_variables_are_the_ones_backends_interpolates():
    models_table = readme_tables()["Models"]
    used: dict[str, str | None] = {}
    for path in [*(REPO / "backends" / "models").glob("*.yaml"),
                 *(REPO / "backends" / "kinds").glob("*.yaml")]:
        for var, default in re.findall(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}", path.read_text()):
            used.setdefault(var, default or None)
    used.pop("STACK_NAME", None)          # the swapper's own (Swapper table)
    assert sorted(used) == sorted(models_table)
    for var, default in used.items():
        assert models_table[var] == default, (var, models_table[var], default)


def test_every_variable_the_code_reads_is_documented():
    tables = readme_tables()
    proxy_doc = set(tables["Proxy"]) | set(tables[BOTH]) | set(tables["Fixed by compose"]) \
        | {"PROXY_PORT"}
    missing = {f for f in ProxySettings.__dataclass_fields__} - proxy_doc
    assert not missing, f"the proxy reads {sorted(missing)}: document them (docs/configuration.md, .env.example)"
    read = {f.name for f in dataclasses.fields(SwapperSettings) if f.metadata.get("read")}
    assert read, "the swapper's settings changed shape: adapt this test"
    swapper_doc = set(tables["Swapper"]) | set(tables[BOTH]) | set(tables["Models"]) \
        | set(tables["Fixed by compose"]) | set(tables["Development"])
    missing = read - swapper_doc
    assert not missing, f"the swapper reads {sorted(missing)}: document them"


# ------------------------------------------------------------ docker compose config

def _sentinel(var: str) -> str:
    # MODELS_DIR is also a bind mount of the swapper's: a path, not a volume's name
    return {"PROXY_PORT": "12345", "PROXY_BIND": "127.0.0.9",
            "MODELS_DIR": "./v-models_dir"}.get(var, f"v-{var.lower()}")


def _compose_config(project: Path, cwd: Path, env: dict[str, str]) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in documented() and k != "PWD"}
    e.update(env)
    e["PWD"] = str(cwd)
    p = subprocess.run(["docker", "compose", "-f", str(project / "docker-compose.yaml"),
                        "--profile", "searxng", "config", "--format", "json"],
                       cwd=cwd, env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture
def project(tmp_path):
    """A copy of the compose file in a folder of its own (compose reads .env there)."""
    d = tmp_path / "stack"
    d.mkdir()
    shutil.copy(REPO / "docker-compose.yaml", d)
    return d


@pytest.mark.parametrize("route", ["dotenv", "shell"])
def test_every_documented_setting_reaches_its_service(project, tmp_path, route):
    doc = readme_tables()
    values = {var: _sentinel(var) for t in SERVICE_TABLES for var in doc[t]}
    values.update({var: _sentinel(var) for var in doc["Fixed by compose"]})
    shell: dict[str, str] = {}
    if route == "dotenv":
        # plus a variable of the operator's own, for a model file they added
        (project / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items())
                                      + "MY_OWN_MODEL_FILE=x.gguf\n")
    else:
        shell = values
    cfg = _compose_config(project, tmp_path, shell)
    svc = cfg["services"]
    env = {name: svc[name].get("environment") or {} for name in ("proxy", "swapper")}

    for var in (*doc["Swapper"], *doc["Models"], *doc[BOTH]):
        assert env["swapper"].get(var) == values[var], (var, env["swapper"].get(var))
    for var in (*doc["Proxy"], *doc[BOTH]):
        assert env["proxy"].get(var) == values[var], (var, env["proxy"].get(var))
    for name, fixed in FIXED.items():
        for var, want in fixed.items():
            assert env[name][var] == want, f"{name}: {var} must stay {want!r} under compose"
    assert env["swapper"]["DOCKER_NETWORK"] == env["swapper"]["STACK_NAME"] == values["STACK_NAME"]
    assert cfg["name"] == values["STACK_NAME"]
    if route == "dotenv":
        assert env["swapper"]["MY_OWN_MODEL_FILE"] == "x.gguf", "all of .env reaches the swapper"
        assert "MY_OWN_MODEL_FILE" not in env["proxy"] and "HF_TOKEN" not in env["proxy"], \
            "the public-facing proxy gets its own settings, not the rest of .env"

    # the compose table: the host side of the endpoint, the images
    (port,) = svc["proxy"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.9", "12345", 11433)
    for name in ("proxy", "swapper"):
        assert svc[name]["build"]["args"]["BASE_IMAGE"] == values["PYTHON_BASE_IMAGE"]
    assert svc["searxng"]["image"] == values["SEARXNG_IMAGE"]
    assert svc["searxng"]["environment"]["SEARXNG_SECRET"] == values["SEARXNG_SECRET"]


def test_unset_settings_are_left_to_the_services(project, tmp_path):
    """No .env, nothing in the shell: only what compose fixes is set, so every other
    setting takes the service's own default (checked against .env.example above)."""
    cfg = _compose_config(project, tmp_path, {})
    for name, fixed in FIXED.items():
        got = {k: v for k, v in (cfg["services"][name].get("environment") or {}).items()
               if v is not None}
        extra = {"swapper": {"STACK_NAME", "DOCKER_NETWORK", "KV_CACHE_DIR",
                              "KV_CACHE_VOLUME", "DOWNLOAD_MODELS_DIR"},
                 "proxy": {"KEYS_DB"}}.get(name, set())     # the key store on its volume
        assert set(got) == set(fixed) | extra, (name, got)


def test_paths_do_not_depend_on_the_callers_folder(tmp_path):
    """`docker compose -f path/to/docker-compose.yaml` from elsewhere: the registry is
    mounted from the compose folder, and HOST_DIR is not taken from the caller's folder
    (the swapper reads the project folder from its own container; tests/e2e runs it)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg = _compose_config(REPO, elsewhere, {})
    swapper = cfg["services"]["swapper"]
    sources = {v["target"]: v["source"] for v in swapper["volumes"]}
    assert sources["/app/backends"] == str(REPO / "backends")
    assert swapper["environment"].get("HOST_DIR") is None
    assert str(elsewhere) not in json.dumps(cfg)
