"""Prompt caches across swaps with the real swapper, the real Docker engine and
the real llama-server (test bed image, SmolLM2): a few hundred tokens of prompt
on tiny-a, a swap to tiny-b, back to tiny-a: the same prompt's answer shows the
restored prefix reused (`timings.cache_n`), where a swapper without the cache
reprocesses all of it; a truncated or corrupted file is never handed to the
backend (this llama-server aborts on a truncated one) and the answer still comes."""
import json
import time

import pytest
import requests

from tests.support.swapperproc import SwapperProcess, stack_containers

PROMPT = "Remember this list of facts. " + " ".join(
    f"Fact {i}: the {w} of item {i} is {i * 7 % 13}." for i, w in
    enumerate(["colour", "weight", "size", "price", "origin", "age"] * 8))


def ask(sw, model, content=PROMPT):
    r = requests.post(sw.url + "/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text[:500]
    return r.json()


@pytest.fixture(scope="module")
def kv_swapper(docker_client, tmp_path_factory):
    root = tmp_path_factory.mktemp("kvcache")
    with SwapperProcess(KV_CACHE_DIR=str(root)) as sw:
        sw.kv_root = root
        yield sw
    assert stack_containers(docker_client, sw.stack) == [], "a backend container leaked"


def metric(sw, name, **labels):
    text = requests.get(sw.url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def round_trip(sw, tamper=None, content=PROMPT):
    """tiny-a answers `content`, tiny-b one request, tiny-a `content` again: its timings."""
    first = ask(sw, "tiny-a", content)["timings"]
    ask(sw, "tiny-b", "Hi.")                 # the swap: tiny-a's slots saved before its stop
    if tamper is not None:
        tamper(sw.kv_root / "tiny-a")
    t0 = time.monotonic()
    again = ask(sw, "tiny-a", content)       # the swap back: restored before admission
    return first, again["timings"], time.monotonic() - t0


def test_the_prefix_survives_a_swap(kv_swapper):
    first, again, _ = round_trip(kv_swapper)
    assert first["prompt_n"] > 300
    saved = json.loads(next((kv_swapper.kv_root / "tiny-a").glob("slot*.json")).read_text())
    assert saved["tokens"] >= first["prompt_n"]
    assert saved["fingerprint"]["flags"]["ctx"] == "2048"
    # all of the prompt but the last token or so comes from the restored slot
    assert again["cache_n"] >= first["prompt_n"] - 8, again
    assert again["prompt_n"] <= 8
    assert metric(kv_swapper, "swapper_kv_cache_bytes_total", model="tiny-a",
                  direction="restored") > 0
    assert metric(kv_swapper, "swapper_kv_cache_bytes_total", model="tiny-a",
                  direction="saved") > 0


def truncate(folder):
    for p in folder.glob("slot*.bin"):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def corrupt(folder):
    for p in folder.glob("slot*.bin"):
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0x5A
        p.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper", [truncate, corrupt])
def test_a_damaged_file_is_not_restored_and_the_answer_still_comes(kv_swapper, tamper):
    before = metric(kv_swapper, "swapper_kv_cache_failures_total", direction="restore",
                    reason="corrupt")
    first, again, _ = round_trip(kv_swapper, tamper, f"{tamper.__name__}: {PROMPT}")
    assert first["prompt_n"] > 300
    assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8
    assert metric(kv_swapper, "swapper_kv_cache_failures_total", direction="restore",
                  reason="corrupt") > before
    assert not list((kv_swapper.kv_root / "tiny-a").glob("tmp-*"))


def test_without_the_cache_the_swap_back_reprocesses_everything(docker_client):
    with SwapperProcess() as sw:
        first = ask(sw, "tiny-a")["timings"]
        ask(sw, "tiny-b", "Hi.")
        again = ask(sw, "tiny-a")["timings"]
        requests.post(sw.url + "/unload", timeout=120)
    assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8


def test_stopping_the_swapper_saves_the_resident_backends_cache(docker_client, tmp_path):
    """`docker compose down` (SIGTERM to the swapper): the resident llama.cpp
    backend's slots are saved before it is removed, and restored by the next
    swapper that loads the model."""
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        first = ask(sw, "tiny-a")["timings"]
    assert stack_containers(docker_client, sw.stack) == []
    (sidecar,) = (tmp_path / "tiny-a").glob("slot*.json")
    assert json.loads(sidecar.read_text())["tokens"] >= first["prompt_n"]
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        again = ask(sw, "tiny-a")["timings"]
    assert again["cache_n"] >= first["prompt_n"] - 8, again
