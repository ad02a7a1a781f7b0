"""The seed's API, on the real swapper and the real Docker engine.

- Every id and alias of the shipped registry (backends/) answers everywhere a model is
  named: the `model` field, `/load/<model>`, `/upstream/<model>/...`. This host has no
  GPU, so a GPU model's answer is the 502 that names the model id and the missing GPU
  runtime: the name resolved, the swapper tried to start that very model (an unknown
  name is a 404).
- Responses name the model id, not the GGUF path (llama.cpp's --alias), in streams too,
  with the real test-bed llama-server.
"""
from __future__ import annotations

import json
import os

import pytest
import requests

from tests.support.process import REPO
from tests.support.seed_names import SEED_NAMES
from tests.support.swapperproc import SwapperProcess

USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def shipped(docker_client):
    """The product's registry, its GPU models on images this host has (the test bed's),
    so what fails is the GPU request, not a pull."""
    env = {
        "LLAMACPP_CUDA_IMAGE": os.environ["TESTBED_LLAMACPP_IMAGE"],
        "VLLM_IMAGE": os.environ["TESTBED_BASE_IMAGE"],
        "MODELS_DIR": os.environ["TESTBED_MODELS_DIR"],
        "HF_HOME": os.environ["TESTBED_MODELS_DIR"],
        "PULL_IMAGES": "0", "CRASH_BACKOFF": "0.01", "CRASH_BACKOFF_MAX": "0.05",
    }
    with SwapperProcess(backends_dir=REPO / "backends", **env) as sw:
        yield sw
    # foundation's compile-cache volume is named after the stack; Docker made it when
    # the container was created, before the GPU request failed.
    for v in docker_client.volumes.list(filters={"name": sw.stack}):
        if v.name.startswith(sw.stack + "-"):
            v.remove(force=True)
    assert not docker_client.volumes.list(filters={"name": sw.stack})


def _gpu_refusal(r: requests.Response, model_id: str) -> str:
    assert r.status_code == 502, (r.status_code, r.text[:500])
    msg = r.json()["error"]["message"]
    assert f"model '{model_id}'" in msg and "GPU" in msg, msg
    return msg


@pytest.mark.parametrize("model_id", list(SEED_NAMES))
def test_every_seed_name_answers_in_the_model_field(shipped, model_id):
    for name in [model_id, *SEED_NAMES[model_id]]:
        r = requests.post(shipped.url + "/v1/chat/completions", timeout=60,
                          json={"model": name, "messages": USER, "max_tokens": 4})
        _gpu_refusal(r, model_id)


@pytest.mark.parametrize("name, model_id", [("qwen38", "qwen-38-27b"), ("qwen36-35b", "qwen-35b"),
                                            ("qwen35-122b", "qwen-122b"), ("foundation", "foundation"),
                                            ("qwen-moe", "qwen-35b")])
def test_seed_names_answer_on_load_and_upstream(shipped, name, model_id):
    _gpu_refusal(requests.post(f"{shipped.url}/load/{name}", timeout=60), model_id)
    _gpu_refusal(requests.get(f"{shipped.url}/upstream/{name}/health", timeout=60), model_id)


def test_an_unknown_name_is_404_listing_the_seed_ids(shipped):
    r = requests.post(shipped.url + "/v1/chat/completions", timeout=30,
                      json={"model": "qwen37", "messages": USER})
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    for model_id in SEED_NAMES:
        assert model_id in msg, msg


def test_models_lists_the_seed_ids_with_their_aliases(shipped):
    data = requests.get(shipped.url + "/v1/models", timeout=30).json()["data"]
    got = {m["id"]: m["aliases"] for m in data}
    for model_id, aliases in SEED_NAMES.items():
        assert got[model_id] == aliases


# ------------------------------------------- responses name the model id (real llama-server)

def test_responses_name_the_model_id_not_the_gguf(swapper):
    """Asked by alias ('a'), answered as 'tiny-a': full responses and every stream chunk."""
    url = swapper.url + "/v1/chat/completions"
    r = requests.post(url, json={"model": "a", "messages": USER, "max_tokens": 4}, timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-a"

    r = requests.post(url, json={"model": "a", "messages": USER, "max_tokens": 4, "stream": True},
                      stream=True, timeout=180)
    assert r.status_code == 200, r.text
    models = [json.loads(line[6:])["model"] for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    assert models and set(models) == {"tiny-a"}, models

    # n=2 on a one-slot model: the swapper fans out and merges; the name survives
    r = requests.post(url, json={"model": "b", "messages": USER, "max_tokens": 4, "n": 2},
                      timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-b" and len(r.json()["choices"]) == 2
