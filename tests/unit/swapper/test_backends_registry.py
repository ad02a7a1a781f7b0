"""The shipped registry (backends/) and the download manifest (scripts/models.toml):
every model validates, `python -m swapper --check` accepts it and rejects broken
registries with the file and key, interpolation behaves, and the manifest's file names
are the ones backends/ loads."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from swapper.registry import Registry, RegistryError, interpolate
from tests.support.seed_names import SEED_NAMES

REPO = Path(__file__).resolve().parents[3]
BACKENDS = REPO / "backends"
MANIFEST = REPO / "scripts" / "models.toml"
GPU_MODELS = ("qwen-38-27b", "qwen-35b", "qwen-122b", "foundation")

TYPICAL_ENV = {
    "MODELS_DIR": "/srv/models",
    "HF_HOME": "/srv/hf",
    "HF_TOKEN": "hf_dummy",
    "LLAMACPP_CUDA_IMAGE": "ghcr.io/ggml-org/llama.cpp:server-cuda-b99999",
    "LLAMACPP_CPU_IMAGE": "local/llama.cpp:cpu",
    "VLLM_IMAGE": "vllm/vllm-openai:v9.9.9",
    "GPU0": "1",
    "GPU1": "0",
    "CPU_THREADS": "8",
    "QWEN27_GGUF": "Qwen3.8-27B-GGUF/Qwen3.8-27B-Q4_K_M.gguf",
    "QWEN122_N_CPU_MOE": "20",
    "FOUNDATION_MAX_MODEL_LEN": "65536",
    "STACK_NAME": "other-stack",
}


def check(backends: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "DEFAULT_MODEL"}
    e.update(env or {})
    e["BACKENDS_DIR"] = str(backends)
    return subprocess.run([sys.executable, "-m", "swapper", "--check"], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------- the shipped registry

def test_every_model_validates_with_no_environment():
    reg = Registry.load(BACKENDS, env={})
    ids = [m.id for m in reg]
    assert "smollm2" in ids
    for mid in GPU_MODELS:
        assert mid in ids
    assert reg.default == "smollm2", "a machine without a GPU must get a working default"
    for m in reg:
        assert m.image and "${" not in m.image
        assert all("${" not in a for a in m.args), (m.id, m.args)
        assert all("${" not in v for v in m.volumes), (m.id, m.volumes)


def test_every_model_validates_with_typical_overrides():
    reg = Registry.load(BACKENDS, env=TYPICAL_ENV)
    q27 = reg.resolve("qwen-38-27b")
    assert q27.image == TYPICAL_ENV["LLAMACPP_CUDA_IMAGE"]
    assert q27.gpus == ("1", "0")
    assert "/models/Qwen3.8-27B-GGUF/Qwen3.8-27B-Q4_K_M.gguf" in q27.args
    assert "/srv/models:/models:ro" in q27.volumes
    q122 = reg.resolve("qwen-122b")
    assert q122.args[q122.args.index("--n-cpu-moe") + 1] == "20"
    f = reg.resolve("foundation")
    assert f.image == "vllm/vllm-openai:v9.9.9"
    assert f.context_length == 65536 and isinstance(f.context_length, int)
    assert f.args[f.args.index("--max-model-len") + 1] == "65536"
    assert "/srv/hf:/root/.cache/huggingface" in f.volumes
    assert "other-stack-vllm-cache:/root/.cache/vllm" in f.volumes
    assert f.env["HF_TOKEN"] == "hf_dummy"


def test_the_seed_names_resolve_to_the_seed_models():
    reg = Registry.load(BACKENDS, env={})
    for model_id, aliases in SEED_NAMES.items():
        assert reg.resolve(model_id).id == model_id
        for alias in aliases:
            assert reg.resolve(alias) is not None, f"{alias} is not a name of any model"
            assert reg.resolve(alias).id == model_id, (alias, reg.resolve(alias).id)


def test_the_seed_tool_floors():
    reg = Registry.load(BACKENDS, env={})
    assert reg.resolve("qwen-38-27b").max_tokens_floor == 512
    assert reg.resolve("qwen-35b").max_tokens_floor == 512
    assert reg.resolve("qwen-122b").max_tokens_floor == 4096
    # /v1/models carries it: the proxy reads the floor from there
    assert reg.resolve("qwen36").public()["max_tokens_floor"] == 512


def test_llamacpp_backends_answer_under_the_model_id():
    """llama-server names its responses after --alias (else the GGUF path)."""
    for m in Registry.load(BACKENDS, env={}):
        if m.kind == "llamacpp":
            assert _flag(m, "--alias") == m.id, m.args


def test_no_backend_serves_a_web_page_on_the_published_port():
    """Issue 35: llama-server copied any Origin into Access-Control-Allow-Origin with
    credentials allowed. Every backend is started refusing every origin (`none` is no
    origin a browser sends; `null` would let sandboxed pages in)."""
    for m in Registry.load(BACKENDS, env={}):
        if m.kind == "llamacpp":
            assert _flag(m, "--cors-origins") == "none", m.args
            assert "--no-cors-credentials" in m.args, m.args
        else:
            assert _flag(m, "--allowed-origins") == "[]", m.args
            assert "--allow-credentials" not in m.args, m.args


def test_gpu_models_ask_for_gpus_and_vllm_ones_are_of_the_vllm_kind():
    reg = Registry.load(BACKENDS, env={})
    for mid in GPU_MODELS:
        m = reg.resolve(mid)
        assert m.gpus, f"{mid} must name its GPUs"
        assert m.slots == 1
    assert reg.resolve("smollm2").gpus == ()
    gpu_file = yaml.safe_load((BACKENDS / "models" / "gpu.yaml").read_text())["models"]
    for mid, raw in gpu_file.items():
        if "vllm" in raw["image"]:
            assert raw["kind"] == "vllm", mid
        else:
            assert raw["kind"] == "llamacpp", mid
    assert reg.resolve("qwen-38-27b").gpus == ("0", "1")
    assert reg.resolve("foundation").gpus == ("0",)


def _flag(m, name):
    return m.args[m.args.index(name) + 1]


def test_llamacpp_seed_flags():
    reg = Registry.load(BACKENDS, env={})
    for mid in ("qwen-38-27b", "qwen-35b", "qwen-122b"):
        m = reg.resolve(mid)
        assert m.kind == "llamacpp"
        assert m.image.startswith("ghcr.io/ggml-org/llama.cpp:server-cuda-b"), m.image
        assert _flag(m, "-c") == "131072" and m.context_length == 131072
        assert _flag(m, "--cache-type-k") == "q8_0" and _flag(m, "--cache-type-v") == "q8_0"
        assert _flag(m, "--parallel") == "1"
        assert _flag(m, "--flash-attn") == "on"
        assert "--jinja" in m.args and _flag(m, "--reasoning-format") == "deepseek"
        assert _flag(m, "--spec-type") == "draft-mtp"
        assert _flag(m, "--split-mode") == "layer" and "," in _flag(m, "--tensor-split")
        assert m.args[:4] == ("--host", "0.0.0.0", "--port", "8080")
    q27 = reg.resolve("qwen-38-27b")
    assert _flag(q27, "-m").endswith("Q6_K.gguf") and _flag(q27, "--mmproj").endswith(".gguf")
    assert int(_flag(reg.resolve("qwen-122b"), "--n-cpu-moe")) > 0


def test_vllm_seed_flags():
    f = Registry.load(BACKENDS, env={}).resolve("foundation")
    assert f.kind == "vllm" and f.port == 8000 and f.ipc_mode == "host"
    assert f.image.startswith("vllm/vllm-openai:v")
    # `vllm serve` takes the model as its FIRST positional argument (vLLM 0.32
    # exits otherwise): the kind's --host/--port/--served-model-name come after.
    assert f.args[0] == "shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP"
    assert _flag(f, "--served-model-name") == "foundation"
    assert _flag(f, "--max-model-len") == "253952" and f.context_length == 253952
    assert _flag(f, "--gpu-memory-utilization") == "0.93"
    assert _flag(f, "--max-num-seqs") == "1"
    assert _flag(f, "--max-num-batched-tokens") == "16384"
    assert "--trust-remote-code" in f.args
    # 253952 exceeds what the checkpoint declares: vLLM needs the explicit go-ahead
    assert f.env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    assert _flag(f, "--reasoning-parser") == "qwen3"
    assert _flag(f, "--tool-call-parser") == "qwen3_coder"
    assert _flag(f, "--dtype") == "float16"
    for flag in ("--enable-chunked-prefill", "--enable-prefix-caching",
                 "--enable-auto-tool-choice", "--language-model-only"):
        assert flag in f.args
    assert f.start_timeout == 900
    assert "coding-stack-vllm-cache:/root/.cache/vllm" in f.volumes
    assert "./hf-cache:/root/.cache/huggingface" in f.volumes


# ------------------------------------------------------------ `python -m swapper --check`

def test_every_vllm_model_names_its_model_first():
    for m in Registry.load(BACKENDS, env={}):
        if m.kind == "vllm":
            assert not m.args[0].startswith("-"), f"{m.id}: {m.args[:3]}"
            assert m.args[-2:] == ("--served-model-name", m.id)


def test_check_accepts_the_shipped_registry():
    r = check(BACKENDS)
    assert r.returncode == 0, r.stderr
    for mid in ("smollm2", *GPU_MODELS):
        assert mid in r.stdout


def _temp_registry(tmp_path: Path, models_yaml: str, extra: dict[str, str] | None = None) -> Path:
    root = tmp_path / "backends"
    shutil.copytree(BACKENDS / "kinds", root / "kinds")
    (root / "models").mkdir()
    (root / "models" / "a.yaml").write_text(models_yaml)
    for name, text in (extra or {}).items():
        (root / "models" / name).write_text(text)
    return root


GOOD = """
models:
  m1:
    kind: llamacpp
    image: img:1
    aliases: [one]
"""


@pytest.mark.parametrize("models_yaml, extra, needles", [
    pytest.param(GOOD.replace("aliases: [one]", "aliases: [one]\n    colour: red"), None,
                 ["a.yaml", "'colour'", "unknown key"], id="unknown-key"),
    pytest.param(GOOD, {"b.yaml": "models:\n  m2:\n    kind: llamacpp\n    image: img:2\n"
                                  "    aliases: [one]\n"},
                 ["b.yaml", "'one'", "already used"], id="duplicate-alias"),
    pytest.param(GOOD, {"b.yaml": "models:\n  m1:\n    kind: llamacpp\n    image: img:2\n"},
                 ["b.yaml", "'m1'", "already used"], id="duplicate-id"),
    pytest.param(GOOD.replace("    image: img:1\n", ""), None,
                 ["a.yaml", "'image'", "missing required key"], id="missing-image"),
    pytest.param(GOOD.replace("    kind: llamacpp\n", ""), None,
                 ["a.yaml", "'kind'", "missing"], id="missing-kind"),
    pytest.param(GOOD.replace("kind: llamacpp", "kind: tgi"), None,
                 ["a.yaml", "'kind'", "tgi"], id="unknown-kind"),
    pytest.param(GOOD + "    slots: lots\n", None, ["a.yaml", "'slots'"], id="bad-type"),
    pytest.param(GOOD + "    start_timeout: ${T:-0}\n", None,
                 ["a.yaml", "'start_timeout'"], id="bad-interpolated-value"),
    pytest.param("models: [\n", None, ["a.yaml", "YAML"], id="not-yaml"),
])
def test_check_rejects_broken_registries_naming_file_and_key(tmp_path, models_yaml, extra, needles):
    root = _temp_registry(tmp_path, models_yaml, extra)
    r = check(root)
    assert r.returncode != 0
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


def test_check_rejects_a_default_model_that_does_not_exist(tmp_path):
    r = check(_temp_registry(tmp_path, GOOD), {"DEFAULT_MODEL": "nope"})
    assert r.returncode != 0 and "nope" in r.stderr


def test_check_accepts_a_minimal_temp_registry(tmp_path):
    r = check(_temp_registry(tmp_path, GOOD))
    assert r.returncode == 0, r.stderr
    assert "m1" in r.stdout


# --------------------------------------------------------------------------- interpolation

def test_interpolation_forms():
    env = {"A": "x", "EMPTY": "", "N": "7"}
    assert interpolate("${A}", env) == "x"
    assert interpolate("${MISSING}", env) == ""
    assert interpolate("${MISSING:-d}", env) == "d"
    assert interpolate("${A:-d}", env) == "x"
    assert interpolate("${EMPTY:-d}", env) == "d", "empty counts as unset with :-"
    assert interpolate("pre-${A}-${N}-post", env) == "pre-x-7-post"
    assert interpolate("${MISSING:-a,b/c.d}", env) == "a,b/c.d"
    assert interpolate(["${A}", {"k": "${N}"}, 3, True], env) == ["x", {"k": "7"}, 3, True]


def test_interpolated_numbers_and_booleans_are_coerced(tmp_path):
    root = _temp_registry(tmp_path, GOOD + "    slots: ${S:-3}\n    start_timeout: ${T}\n"
                                           "    context_length: ${C:-4096}\n"
                                           "    native_n: ${NN:-false}\n    idle_ttl: ${I:-1.5}\n")
    m = Registry.load(root, env={"T": "42"}).resolve("m1")
    assert (m.slots, m.start_timeout, m.context_length, m.native_n, m.idle_ttl) == (3, 42.0, 4096, False, 1.5)
    m = Registry.load(root, env={"T": "5", "S": "2", "C": "8192", "NN": "yes"}).resolve("one")
    assert (m.slots, m.start_timeout, m.context_length, m.native_n) == (2, 5.0, 8192, True)
    with pytest.raises(RegistryError, match="'slots'"):
        Registry.load(root, env={"T": "5", "S": "two"})


# ---------------------------------------------------------------- manifest <-> registry

def _manifest() -> dict:
    with open(MANIFEST, "rb") as f:
        return tomllib.load(f)


def _defaults(backends: Path) -> dict[str, str]:
    """VAR -> default of every ${VAR:-default} in the model files."""
    import re
    out = {}
    for path in (backends / "models").glob("*.yaml"):
        for var, default in re.findall(r"\$\{([A-Z0-9_]+):-([^}]*)\}", path.read_text()):
            out.setdefault(var, default)
    return out


def test_manifest_file_names_are_the_ones_backends_loads():
    manifest = _manifest()
    defaults = _defaults(BACKENDS)
    reg = Registry.load(BACKENDS, env={})
    mounted = {}
    for m in reg:
        for a in m.args:
            if a.startswith("/models/"):
                mounted.setdefault(m.id, set()).add(a[len("/models/"):])
    for model_id, entry in manifest.items():
        assert reg.resolve(model_id) is not None, f"manifest model {model_id} is not in backends/"
        for f in entry.get("files", []):
            assert f["local"].endswith(f["remote"].split("/")[-1])
            if "var" in f:
                assert defaults.get(f["var"]) == f["local"], (
                    f"backends/ defaults ${{{f['var']}}} to {defaults.get(f['var'])!r}, "
                    f"the manifest to {f['local']!r}")
                assert f["local"] in mounted.get(model_id, set()), (model_id, f["local"])
        if entry["source"] == "hf-cache":
            assert defaults.get(entry["var"]) == entry["repo"]
            assert entry["repo"] in reg.resolve(model_id).args
        if entry["source"] == "hf-dir":
            assert defaults.get(entry["var"]) == entry["dir"]
            assert f"/models/{entry['dir']}" in reg.resolve(model_id).args


def test_every_model_can_be_fetched():
    """README's model table promises ./download-model.sh for every model."""
    manifest = _manifest()
    for m in Registry.load(BACKENDS, env={}):
        assert m.id in manifest, f"download-model.sh cannot fetch {m.id} (scripts/models.toml)"


def test_every_gguf_that_backends_loads_is_in_the_manifest():
    manifest = _manifest()
    known = {f["local"] for e in manifest.values() for f in e.get("files", [])}
    known |= {e["dir"] for e in manifest.values() if e["source"] == "hf-dir"}
    for m in Registry.load(BACKENDS, env={}):
        if m.id not in manifest:
            continue            # models maintained elsewhere (e.g. test-bed-only ones)
        for a in m.args:
            if a.startswith("/models/"):
                assert a[len("/models/"):] in known, (m.id, a)


def test_manifest_sources_are_well_formed():
    for model_id, e in _manifest().items():
        assert e["source"] in ("pypi", "hf", "hf-cache", "hf-dir"), model_id
        if e["source"] == "pypi":
            assert "==" in e["package"], "pin the wheel"
            for f in e["files"]:
                assert f["size"] > 0 and len(f["sha256"]) == 64
        elif e["source"] == "hf":
            assert e["repo"].count("/") == 1 and e["files"]
        elif e["source"] == "hf-dir":
            assert e["repo"].count("/") == 1 and e["dir"] and e["var"] and e["include"]
        else:
            assert e["repo"].count("/") == 1 and e["var"]


# ------------------------------------------------------------------- README's model table

def _readme_models() -> dict[str, list[str]]:
    """id -> aliases, from the table under README's '## Models'."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Models"):]
    section = section[:section.index("\n## ", 1)]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0].startswith("`"):
            model_id = cells[0].split("`")[1]
            out[model_id] = [a.strip() for a in cells[1].split(",") if a.strip()]
    return out


def test_readme_model_table_is_the_registry():
    """The table shows every model with exactly its names (the seed's included)."""
    table = _readme_models()
    reg = Registry.load(BACKENDS, env={})
    assert table == {m.id: list(m.aliases) for m in reg}
    for model_id, aliases in SEED_NAMES.items():
        assert table[model_id] == aliases


# ------------------------------------------------- agent sessions: per-model fields, names

TWO = GOOD + """  m2:
    kind: llamacpp
    image: img:2
    aliases: [two]
    late_system: keep
    preserve_reasoning: "${KEEP_THINK:-true}"
"""


def test_agent_fields_default_and_show_in_v1_models(tmp_path):
    reg = Registry.load(_temp_registry(tmp_path, TWO), env={})
    m1, m2 = reg.lookup("m1").public(), reg.lookup("m2").public()
    assert (m1["late_system"], m1["preserve_reasoning"]) == ("convert", False)
    assert (m2["late_system"], m2["preserve_reasoning"]) == ("keep", True)
    for m in Registry.load(BACKENDS, env={}):
        assert m.late_system == "convert", m.id


def test_late_system_must_be_a_known_mode(tmp_path):
    root = _temp_registry(tmp_path, GOOD + "    late_system: drop\n")
    with pytest.raises(RegistryError, match=r"a\.yaml.*'late_system'.*convert, merge, keep"):
        Registry.load(root, env={})


CLAUDE_NAMES = ("claude-opus-4-8[1m]", "claude-opus-4-8", "claude-sonnet-4-6",
                "claude-haiku-4-5-20251001")
CODEX_NAMES = ("gpt-5.5", "gpt-5-codex", "gpt-5.1-codex-max")


@pytest.mark.parametrize("name", CLAUDE_NAMES + CODEX_NAMES)
def test_agents_own_names_go_to_the_resident_model_else_the_default(tmp_path, name):
    reg = Registry.load(_temp_registry(tmp_path, TWO), env={})
    assert reg.resolve(name, resident="m2").id == "m2", "the resident one: no swap"
    assert reg.resolve(name, resident="two").id == "m2", "named by alias"
    assert reg.resolve(name, resident=None).id == "m1", "nothing resident: the default"
    assert reg.resolve(name, resident="gone").id == "m1"
    assert reg.mapping(name).use == "@resident"
    assert reg.resolve(name) is None, "without resident (operator names: /load) never mapped"
    assert reg.lookup(name) is None


def test_shipped_registry_maps_the_agents_names(tmp_path):
    reg = Registry.load(BACKENDS, env={})
    assert [(p.match, p.use) for p in reg.patterns] == [
        ("claude-*", "@resident"), ("gpt-5*", "@resident"), ("codex-*", "@resident")]
    assert all("agents.yaml" in p.source for p in reg.patterns)
    assert reg.resolve("claude-haiku-4-5", resident="qwen-35b").id == "qwen-35b"
    assert reg.resolve("claude-haiku-4-5", resident=None).id == reg.default


def test_ids_aliases_and_unmatched_names_are_unchanged(tmp_path):
    reg = Registry.load(_temp_registry(tmp_path, TWO), env={})
    assert reg.resolve("two", resident="m1").id == "m2", "a registry name wins over residency"
    assert reg.mapping("two") is None and reg.mapping("m1") is None
    assert reg.resolve("no-such-model", resident="m1") is None, "still a 404"
    assert reg.mapping("no-such-model") is None
    assert reg.resolve(None, resident="m2").id == "m1", "no name: as before (the caller's rule)"
    assert reg.resolve("").id == "m1" and reg.resolve("m2").id == "m2"


def test_configured_patterns_replace_the_defaults_in_file_order(tmp_path):
    root = _temp_registry(tmp_path, TWO, {
        "b.yaml": "model_patterns:\n  - {match: 'claude-haiku-*', use: two}\n"
                  "  - {match: 'claude-*', use: '@default'}\n",
        "c.yaml": "model_patterns:\n  - {match: '${AGENT_GLOB:-my-*}', use: '@resident'}\n"})
    reg = Registry.load(root, env={})
    assert reg.resolve("claude-haiku-4-5", resident="m1").id == "m2"
    assert reg.resolve("claude-opus-4-8[1m]", resident="m2").id == "m1"
    assert reg.mapping("claude-opus-4-8").match == "claude-*"
    assert reg.resolve("my-model", resident="m2").id == "m2"
    assert reg.resolve("gpt-5.5", resident="m2") is None, "the defaults are replaced"


def test_a_keys_scope_keeps_a_mapped_name_within_it(tmp_path):
    """Issue 35: a key scoped to some models and an agent's tier name: the
    resident model when the key may use it (no swap), else the default, else
    the first it may use; what the pattern names when it may use none (the
    caller refuses it). Ids and aliases are not moved: the caller refuses them."""
    root = _temp_registry(tmp_path, TWO + "  m3:\n    kind: llamacpp\n    image: img:3\n",
                          {"b.yaml": "model_patterns:\n  - {match: 'claude-haiku-*', use: two}\n"
                                     "  - {match: 'claude-*', use: '@resident'}\n"})
    reg = Registry.load(root, env={})
    only = lambda *ids: (lambda spec: spec.id in ids)          # noqa: E731
    assert reg.default == "m1"
    assert reg.resolve("claude-opus-4-8", resident="m2", allowed=only("m2", "m3")).id == "m2"
    assert reg.resolve("claude-opus-4-8", resident="m1", allowed=only("m2", "m3")).id == "m2"
    assert reg.resolve("claude-opus-4-8", resident="m1", allowed=only("m3")).id == "m3"
    assert reg.resolve("claude-opus-4-8", resident=None, allowed=only("m1", "m3")).id == "m1"
    assert reg.resolve("claude-opus-4-8", resident="m3", allowed=only("m1", "m3")).id == "m3"
    assert reg.resolve("claude-haiku-4-5", resident="m3", allowed=only("m1", "m3")).id == "m3"
    assert reg.resolve("claude-haiku-4-5", resident="m3", allowed=only("m2")).id == "m2"
    assert reg.resolve("claude-haiku-4-5", resident="m1", allowed=only("m1", "m3")).id == "m1"
    assert reg.resolve("claude-opus-4-8", resident="m2", allowed=only()).id == "m2"
    assert reg.resolve("m1", resident="m2", allowed=only("m3")).id == "m1"
    assert reg.resolve("nope", resident="m2", allowed=only("m3")) is None


def test_an_empty_pattern_list_turns_the_mapping_off(tmp_path):
    reg = Registry.load(_temp_registry(tmp_path, TWO, {"b.yaml": "model_patterns: []\n"}), env={})
    assert reg.patterns == () and reg.resolve("claude-opus-4-8", resident="m1") is None


def test_without_configuration_the_built_in_patterns_apply(tmp_path):
    reg = Registry.load(_temp_registry(tmp_path, TWO), env={})
    assert [p.match for p in reg.patterns] == ["claude-*", "gpt-5*", "codex-*"]
    assert Registry([]).resolve("claude-x", resident=None) is None, "an empty registry: nothing"


@pytest.mark.parametrize("text, needles", [
    ("model_patterns: {claude: x}\n", ["b.yaml", "'model_patterns'", "list"]),
    ("model_patterns: [claude-*]\n", ["b.yaml", "model_patterns[0]", "mapping"]),
    ("model_patterns:\n  - {match: 'claude-*'}\n", ["model_patterns[0]", "'use'"]),
    ("model_patterns:\n  - {match: 'claude-*', use: nope}\n",
     ["b.yaml", "model_patterns[0]", "'nope'", "@resident"]),
    ("model_patterns:\n  - {match: 'x', use: m1, when: never}\n", ["'when'", "unknown key"]),
    ("model_pattern: []\n", ["b.yaml", "model_pattern"]),
])
def test_bad_patterns_are_refused_naming_file_and_entry(tmp_path, text, needles):
    root = _temp_registry(tmp_path, TWO, {"b.yaml": text})
    with pytest.raises(RegistryError) as e:
        Registry.load(root, env={})
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
