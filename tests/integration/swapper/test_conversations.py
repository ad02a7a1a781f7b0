"""Every conversation keeps its prompt cache across swaps (issue 33), with the real
swapper, the real Docker engine and the test bed's real llama-server (SmolLM2, one
slot, its RAM prompt cache at its default): three conversations of ~1,000 tokens
that differ from their first token, and a side call in the first one's session
last before the swap; swapped away and back, each conversation's next turn
re-processes at most 5 % of its prompt, in the order they came and in the
reverse; a swap that served only some of them saves only those. What each turn
cost (prompt tokens, prompt_ms) is printed for docs/kv-cache.md."""
import json
import shutil

import pytest
import requests

from tests.support.swapperproc import FIXTURE_BACKENDS, SwapperProcess, stack_containers

REGISTRY = """
models:
  conv-a:
    kind: llamacpp
    image: ${TESTBED_LLAMACPP_IMAGE}
    volumes: ["${TESTBED_MODELS_DIR}:/models:ro"]
    args: [-m, "/models/${TESTBED_MODEL_FILE}", -c, "4096", -fa, "on", --parallel, "1",
           -t, "2", --no-warmup]
    slots: 1
    start_timeout: 120
    stop_timeout: 5
  conv-b:
    kind: llamacpp
    image: ${TESTBED_LLAMACPP_IMAGE}
    volumes: ["${TESTBED_MODELS_DIR}:/models:ro"]
    args: [-m, "/models/${TESTBED_MODEL_FILE}", -c, "512", --parallel, "1", -t, "2",
           --no-warmup]
    slots: 1
    start_timeout: 120
    stop_timeout: 5
"""

WORDS = ["colour", "weight", "size", "price", "origin", "age", "owner", "shape"]


def task(name: str, n: int = 80) -> str:
    """A first user message of ~1,000 tokens, unlike the others from its first word."""
    return f"{name} asks you to remember: " + " ".join(
        f"Item {i} of {name} has {WORDS[i % len(WORDS)]} {(i * 7 + len(name)) % 13}."
        for i in range(n))


SYSTEM = "You are a careful coding agent. Answer in one word."


class Conversation:
    def __init__(self, name: str, system: str = SYSTEM):
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": task(name)}]

    def turn(self, sw, model="conv-a") -> dict:
        r = requests.post(sw.url + "/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": 3, "temperature": 0, "messages": self.messages})
        assert r.status_code == 200, r.text[:500]
        body = r.json()
        self.messages = self.messages + [
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Go on."}]
        return body["timings"]


@pytest.fixture(scope="module")
def conv_swapper(docker_client, tmp_path_factory):
    backends = tmp_path_factory.mktemp("conv-backends")
    shutil.copytree(FIXTURE_BACKENDS / "kinds", backends / "kinds")
    (backends / "models").mkdir()
    (backends / "models" / "conv.yaml").write_text(REGISTRY)
    root = tmp_path_factory.mktemp("conv-kv")
    with SwapperProcess(backends_dir=backends, KV_CACHE_DIR=str(root)) as sw:
        sw.kv_root = root
        yield sw
        requests.post(sw.url + "/unload", timeout=120)
    assert stack_containers(docker_client, sw.stack) == [], "a backend container leaked"


def swap_away_and_back(sw):
    """One short request to conv-b: the swap away (conv-a's caches saved); the
    next request to conv-a swaps back."""
    r = requests.post(sw.url + "/v1/chat/completions", timeout=600, json={
        "model": "conv-b", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]})
    assert r.status_code == 200, r.text[:500]


def share(t: dict) -> float:
    return t["prompt_n"] / (t["prompt_n"] + t["cache_n"])


def events_of(sw, name):
    """The /running view of the last swap (what the ledger kept)."""
    return requests.get(sw.url + "/running", timeout=10).json()["swaps"]


def test_every_conversation_keeps_its_cache_in_any_order(conv_swapper):
    sw = conv_swapper
    a, c, e = Conversation("Alice"), Conversation("Carol"), Conversation("Erin")
    side = Conversation("Alice", system="Write a five-word title for this conversation.")
    cold = {n: conv.turn(sw) for n, conv in (("A", a), ("C", c), ("E", e))}
    assert all(t["prompt_n"] > 900 for t in cold.values()), cold
    warm = a.turn(sw)                        # within the stint: the RAM cache brings A back
    print(f"\nwarm turn within the stint: {warm}")
    side.turn(sw)                            # a side call of A's session, last
    swap_away_and_back(sw)
    saved = sorted(p.name for p in (sw.kv_root / "conv-a").glob("conv-*.json"))
    assert len(saved) == 4, saved            # A, C, E and the side call
    for order in (("A", "C", "E"), ("E", "C", "A")):
        for name in order:
            t = {"A": a, "C": c, "E": e}[name].turn(sw)
            print(f"after a swap back, {name}: {t}")
            assert share(t) <= 0.05, (name, t)
        swap_away_and_back(sw)
    swaps = events_of(sw, "swap")
    last = swaps["last_swap"]
    assert last["from"] == "conv-a" and last["saved"]["prompts"] == 3, last
    assert set(last["phases"]) == {"stop", "save", "start", "healthy", "restore"}
    assert swaps["last_hour"]["serving_share"] is not None
    print(f"last swap: {json.dumps(last)}")


def test_a_stint_that_served_one_conversation_saves_only_it(conv_swapper):
    sw = conv_swapper
    first = Conversation("Grace")
    first.turn(sw)                           # conv-a loads: every saved one restored
    before = {p.name: p.stat().st_mtime_ns for p in (sw.kv_root / "conv-a").glob("*.bin")}
    swap_away_and_back(sw)
    after = {p.name: p.stat().st_mtime_ns for p in (sw.kv_root / "conv-a").glob("*.bin")}
    changed = [n for n in after if before.get(n) != after[n]]
    assert len(changed) == 1, changed        # Grace's, new; the others' files untouched
    t = first.turn(sw)
    assert share(t) <= 0.05, t
