"""Prompt caches across swaps (swapper/kvcache.py) on the fake runtime, with a
fake llama-server slot API that writes real files: each slot holding a prompt
is saved before the stop of a swap, an /unload and an idle TTL, while the old
backend still answers; restored when the model is next healthy, before its
queue is admitted; a failed or slow save never blocks the swap; the cap evicts
the least recently used; a file tied to another backend (build, flags), a
corrupt, truncated or half-written one is never handed to the backend; a
backend that dies on a restore is started again without it."""
import dataclasses
import json
import os
import threading
from types import SimpleNamespace

import pytest

from swapper import kvcache
from swapper.registry import Registry, RegistryError
from swapper.runtime import DockerRuntime
from swapper.settings import Settings
from tests.support.fake_runtime import FakeSlotServer
from tests.support.kvcache import files, make, sample, spec, turn


@pytest.fixture
def servers(tmp_path):
    out = {}
    for m in ("a", "b", "ttl"):
        (tmp_path / m).mkdir()
        out[m] = FakeSlotServer(tmp_path / m).__enter__()
    yield out
    for s in out.values():
        s.__exit__(None, None, None)


def serve(w, model, slot_tokens: dict):
    """Admit a request for `model` (loading it), and let its slots hold prompts."""
    t = w.sched.submit(model)
    turn(w, 3)
    assert t.state == "admitted", t.error
    w.sched.release(t)
    w.servers[model].prompts.update(slot_tokens)


def fresh(server):
    """A new backend process: its slots hold nothing."""
    for i in server.prompts:
        server.prompts[i] = 0
    server.restored.clear()


@pytest.fixture
def w(tmp_path, servers):
    w = make(tmp_path, servers)
    w.servers = servers
    return w


def failures(w, direction, reason):
    return sample(w.metrics.collectors, "swapper_kv_cache_failures_total",
                  direction=direction, reason=reason) or 0


def test_a_swap_saves_the_slots_holding_a_prompt_before_the_stop(w):
    serve(w, "a", {1: 40})                     # slot 0 never used
    seen = {}
    stop = w.runtime.stop

    def watched_stop(target):
        seen["files"] = files(w.root / "a")    # what was on disk when the kill came
        return stop(target)
    w.runtime.stop = watched_stop
    b = w.sched.submit("b")
    turn(w, 3)
    assert b.state == "admitted"
    assert seen["files"] == ["slot1.bin", "slot1.json"]
    assert [c[:2] for c in w.servers["a"].calls] == [("save", 1)]
    assert w.servers["a"].calls[0][2].startswith("tmp-slot1-")    # saved under a temporary name
    meta = json.loads((w.root / "a" / "slot1.json").read_text())
    assert meta["tokens"] == 40 and meta["bytes"] == (w.root / "a" / "slot1.bin").stat().st_size
    assert meta["fingerprint"]["flags"] == {"model": "/models/m.gguf", "ctx": "2048",
                                            "parallel": "2"}
    assert meta["fingerprint"]["build"] == "b1-test"
    saving = [f for e, f in w.events if e == "saving" and f.get("done")]
    assert len(saving) == 1 and saving[0].pop("seconds") < 5
    assert saving == [{"model": "a", "done": True, "slots": [1], "saved": ["slot1"],
                       "tokens": 40, "bytes": meta["bytes"]}]
    assert sample(w.metrics.collectors, "swapper_kv_cache_bytes_total", model="a",
                  direction="saved") == meta["bytes"]


def test_the_way_back_restores_them_before_the_queue_is_admitted(w):
    serve(w, "a", {0: 30, 1: 40})
    serve(w, "b", {0: 5})
    fresh(w.servers["a"])
    restored_at_admission = {}
    load_done = w.sched.load_done

    def watched(epoch, backend=None, error=None):
        restored_at_admission.update(w.servers["a"].restored)
        return load_done(epoch, backend=backend, error=error)
    w.sched.load_done = watched
    t = w.sched.submit("a")
    turn(w, 3)
    assert t.state == "admitted"
    assert restored_at_admission == {0: 30, 1: 40}
    assert [c[:2] for c in w.servers["a"].calls if c[0] == "restore"] == [("restore", 0),
                                                                          ("restore", 1)]
    restoring = [f for e, f in w.events if e == "restoring" and f.get("done")]
    assert restoring[-1]["slots"] == [0, 1] and restoring[-1]["tokens"] == 70
    assert sample(w.metrics.collectors, "swapper_kv_cache_tokens_total", model="a",
                  direction="restored") == 70


def test_unload_and_idle_ttl_save_too(w):
    serve(w, "a", {0: 12})
    u = w.sched.submit(None)
    turn(w, 2)
    assert u.state == "done"
    assert "slot0.bin" in files(w.root / "a")
    serve(w, "ttl", {0: 9})
    w.clock.now += 31
    turn(w, 2)                                 # the watch expires it, then the stop
    assert w.sched.model is None
    assert files(w.root / "ttl") == ["slot0.bin", "slot0.json"]


def test_a_refused_save_costs_only_the_cache(w):
    serve(w, "a", {0: 12})
    w.servers["a"].save_status = 500
    b = w.sched.submit("b")
    turn(w, 3)
    assert b.state == "admitted"
    assert files(w.root / "a") == []
    assert failures(w, "save", "refused") == 1


def test_a_save_past_its_time_is_abandoned_and_the_swap_goes_on(tmp_path, servers):
    w = make(tmp_path, servers, KV_CACHE_SAVE_TIMEOUT=0.3)
    w.servers = servers
    serve(w, "a", {0: 12, 1: 13})
    gate = servers["a"].save_gate = threading.Event()      # the save never ends by itself
    try:
        b = w.sched.submit("b")
        turn(w, 3)
        assert b.state == "admitted" and not gate.is_set()  # admitted with the save pending
    finally:
        gate.set()
    assert failures(w, "save", "timeout") == 2      # the first abandoned, the second skipped
    assert not list((tmp_path / "a").glob("slot*"))


def test_a_half_written_file_is_never_kept(w):
    serve(w, "a", {0: 12})
    w.servers["a"].short_write = 10            # n_written says more than the file holds
    turn_b = w.sched.submit("b")
    turn(w, 3)
    assert turn_b.state == "admitted"
    assert files(w.root / "a") == [] and failures(w, "save", "incomplete") == 1


def test_a_temporary_file_left_by_a_killed_save_is_swept_not_restored(w):
    serve(w, "a", {0: 12})
    w.servers["a"].save_status = 500           # no complete save: only the killed one's file
    serve(w, "b", {})
    (w.root / "a" / "tmp-slot0-deadbeef.bin").write_bytes(b"x" * 100)
    fresh(w.servers["a"])
    t = w.sched.submit("a")
    turn(w, 3)
    assert t.state == "admitted"
    assert not [c for c in w.servers["a"].calls if c[0] == "restore"]
    assert files(w.root / "a") == []


def _saved_then_back(w, tamper):
    serve(w, "a", {0: 30})
    serve(w, "b", {})
    tamper(w.root / "a")
    fresh(w.servers["a"])
    t = w.sched.submit("a")
    turn(w, 3)
    assert t.state == "admitted"
    return [c for c in w.servers["a"].calls if c[0] == "restore"]


def test_a_corrupt_file_is_never_handed_to_the_backend(w):
    def flip(folder):
        p = folder / "slot0.bin"
        data = bytearray(p.read_bytes())
        data[100] ^= 0xFF
        p.write_bytes(bytes(data))
    assert _saved_then_back(w, flip) == []
    assert failures(w, "restore", "corrupt") == 1 and files(w.root / "a") == []


def test_a_truncated_file_is_never_handed_to_the_backend(w):
    def truncate(folder):
        p = folder / "slot0.bin"
        p.write_bytes(p.read_bytes()[:50])
    assert _saved_then_back(w, truncate) == []
    assert failures(w, "restore", "corrupt") == 1


def test_a_broken_sidecar_is_discarded(w):
    assert _saved_then_back(w, lambda f: (f / "slot0.json").write_text("{half")) == []
    assert files(w.root / "a") == []


def test_another_llama_cpp_build_discards_the_files(w):
    assert _saved_then_back(w, lambda f: setattr(w.servers["a"], "build", "b2-other")) == []
    assert failures(w, "restore", "mismatch") == 1 and files(w.root / "a") == []


def test_other_kv_flags_discard_the_files(w):
    def change_context(folder):
        w.models["a"] = spec("a", args=("-m", "/models/m.gguf", "-c", "4096", "--parallel", "2"))
    assert _saved_then_back(w, change_context) == []
    assert failures(w, "restore", "mismatch") == 1


def test_a_restore_the_backend_refuses_is_skipped(w):
    def refuse(folder):
        w.servers["a"].restore_status = 400
    calls = _saved_then_back(w, refuse)
    assert len(calls) == 1 and w.servers["a"].restored == {}
    assert failures(w, "restore", "refused") == 1 and files(w.root / "a") == []


def test_a_backend_that_dies_on_a_restore_is_started_again_without_it(w):
    def die(folder):
        w.servers["a"].die_on_restore = True
    _saved_then_back(w, die)
    starts = [c for c in w.runtime.calls if c == ("start", "a")]
    assert len(starts) == 3                    # first load, the one that died, again
    assert failures(w, "restore", "crashed") == 1 and files(w.root / "a") == []


def test_a_crashed_backend_is_not_saved(w):
    serve(w, "a", {0: 12})
    w.runtime.kill("a")
    turn(w, 2)                                 # the watch notices, then the stop
    assert not [c for c in w.servers["a"].calls if c[0] == "save"]


def test_the_cap_evicts_the_least_recently_used(tmp_path, servers):
    for s in servers.values():
        s.bytes_per_token = 1000               # 100 tokens: ~100 kB a file
    w = make(tmp_path, servers, KV_CACHE_MAX_GB=0.00025)     # 250 kB: two files fit
    w.servers = servers
    serve(w, "a", {0: 100})
    w.clock.now += 1
    serve(w, "b", {0: 100})                     # a saved
    serve(w, "ttl", {0: 100})                   # b saved
    w.sched.submit(None)
    turn(w, 2)                                 # ttl saved: a (the oldest) goes
    assert files(tmp_path / "a") == []
    assert files(tmp_path / "b") == files(tmp_path / "ttl") == ["slot0.bin", "slot0.json"]
    # every file counts (the sidecars too)
    on_disk = sum(p.stat().st_size for m in ("b", "ttl") for p in (tmp_path / m).iterdir())
    assert on_disk > 2 * (8 + 100_000)
    assert sample(w.metrics.collectors, "swapper_kv_cache_disk_bytes") == on_disk


def test_off_without_a_folder_or_for_a_model_that_says_so(tmp_path, servers):
    models = {"a": spec("a", kv=False), "b": spec("b")}
    w = make(tmp_path, servers, models=models)
    w.servers = servers
    serve(w, "a", {0: 10})
    serve(w, "b", {0: 10})
    assert not servers["a"].calls
    assert not kvcache.enabled(Settings(), spec("b"))


# ----------------------------------------------------------- registry, runtime

def test_registry_default_is_on_for_llamacpp_off_for_vllm(tmp_path):
    (tmp_path / "kinds").mkdir()
    (tmp_path / "models").mkdir()
    common = "port: 8080\nhealth_path: /health\nstart_timeout: 10\nslots: 1\nimage: i\n"
    (tmp_path / "kinds" / "llamacpp.yaml").write_text("kind: llamacpp\n" + common)
    (tmp_path / "kinds" / "vllm.yaml").write_text("kind: vllm\n" + common)
    (tmp_path / "models" / "m.yaml").write_text(
        "models:\n  l: {kind: llamacpp}\n  nope: {kind: llamacpp, kv_cache: false}\n"
        "  v: {kind: vllm}\n")
    reg = Registry.load(tmp_path, env={})
    assert (reg.models["l"].kv_cache, reg.models["nope"].kv_cache, reg.models["v"].kv_cache) \
        == (True, False, False)
    (tmp_path / "models" / "m.yaml").write_text("models:\n  v: {kind: vllm, kv_cache: true}\n")
    with pytest.raises(RegistryError, match="kv_cache"):
        Registry.load(tmp_path, env={})


def test_the_backend_gets_its_folder_and_the_save_path(tmp_path):
    s = Settings(STACK_NAME="st", HOST_DIR="/srv/stack", KV_CACHE_DIR=str(tmp_path))
    args = DockerRuntime(s, SimpleNamespace(models={}))._create_args(
        dataclasses.replace(spec("a"), user="65534:65534"), "n")
    assert args["command"][-2:] == ["--slot-save-path", "/kvcache/a/"]
    assert args["volumes"][-1] == f"{tmp_path}/a:/kvcache/a"
    # issue 28: never world-writable (0777 let any local user plant a FIFO or a link):
    # the backend's group (BACKEND_USER's), group-writable, set-group-id
    st = os.stat(tmp_path / "a")
    assert (tmp_path / "a").is_dir() and st.st_mode & 0o7777 == 0o2770, oct(st.st_mode)
    assert st.st_gid == 65534
    DockerRuntime(s, SimpleNamespace(models={}))._create_args(spec("c"), "n")   # image's user
    assert os.stat(tmp_path / "c").st_mode & 0o7777 == 0o700
    # a uid alone (its group is the image's business): the backend's own folder
    DockerRuntime(s, SimpleNamespace(models={}))._create_args(
        dataclasses.replace(spec("d"), user="4242"), "n")
    st = os.stat(tmp_path / "d")
    assert st.st_mode & 0o7777 == 0o700 and st.st_uid == 4242
    named = Settings(KV_CACHE_DIR=str(tmp_path), KV_CACHE_VOLUME="st-kvcache")
    args = DockerRuntime(named, SimpleNamespace(models={}))._create_args(spec("a"), "n")
    assert args["volumes"][-1] == "st-kvcache:/kvcache"
    rel = Settings(HOST_DIR="/srv/stack", KV_CACHE_DIR=str(tmp_path), KV_CACHE_VOLUME="./kv")
    args = DockerRuntime(rel, SimpleNamespace(models={}))._create_args(spec("a"), "n")
    assert args["volumes"][-1] == "/srv/stack/kv/a:/kvcache/a"
    off = DockerRuntime(Settings(), SimpleNamespace(models={}))._create_args(spec("a"), "n")
    assert "--slot-save-path" not in off["command"]


# ------------------------------------------- the first answer after a restore
@pytest.mark.parametrize("tail, counts", [
    # llama-server's chat completion, not streamed: usage, then timings
    (b'{"usage":{"prompt_tokens":440,"prompt_tokens_details":{"cached_tokens":439}},'
     b'"timings":{"cache_n":439,"prompt_n":1,"prompt_ms":9.1}}', (439, 1)),
    # its stream: the last data event carries the timings, then [DONE]
    (b'data: {"choices":[{"delta":{"content":"x"}}],"timings":{"cache_n":12,"prompt_n":3}}'
     b'\n\ndata: {"choices":[],"timings":{"cache_n":430,"prompt_n":2,"predicted_n":4}}'
     b'\n\ndata: [DONE]\n\n', (430, 2)),
    # no timings: OpenAI usage (cached among prompt_tokens)
    (b'{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":90}}}', (90, 10)),
    # Anthropic usage (input_tokens beside the cache's)
    (b'{"usage":{"input_tokens":5,"cache_read_input_tokens":95,"output_tokens":4}}', (95, 5)),
    (b'{"choices":[]}', None),
    (b'', None),
])
def test_prompt_counts_are_read_off_the_answers_end(tail, counts):
    assert kvcache.prompt_counts(tail) == counts


def test_the_first_answer_after_a_restore_is_counted_once(w):
    serve(w, "a", {0: 30, 1: 40})
    serve(w, "b", {0: 5})
    assert not w.driver.kv.awaits_answer("b")          # b was never restored
    fresh(w.servers["a"])
    t = w.sched.submit("a")
    turn(w, 3)
    assert t.state == "admitted"
    kv = w.driver.kv
    assert kv.awaits_answer("a")
    assert kv.answered("a", b'{"choices":[]}') is None         # no counts: still waiting
    assert kv.answered("a", b'{"timings":{"cache_n":29,"prompt_n":3}}') == (29, 3)
    assert not kv.awaits_answer("a")
    assert kv.answered("a", b'{"timings":{"cache_n":1,"prompt_n":50}}') is None
    assert sample(w.metrics.collectors, "swapper_kv_cache_first_answer_tokens_total",
                  model="a", prompt="reused") == 29
    assert sample(w.metrics.collectors, "swapper_kv_cache_first_answer_tokens_total",
                  model="a", prompt="processed") == 3
    (reused,) = [f for e, f in w.events if e == "reused"]
    assert reused == {"model": "a", "conversation": None, "restored": 70, "reused": 29,
                      "processed": 3, "prompt_seconds": None}


def test_a_restore_nobody_asked_for_counts_nothing(w):
    serve(w, "a", {0: 30})
    serve(w, "b", {0: 5})
    fresh(w.servers["a"])
    serve(w, "a", {})                      # restored, then swapped out before any answer
    assert w.driver.kv.awaits_answer("a")
    serve(w, "b", {})
    assert not w.driver.kv.awaits_answer("a")
    assert w.driver.kv.answered("a", b'{"timings":{"cache_n":1,"prompt_n":2}}') is None


# ------------------------------------------------ issue 28: the folder's files
def saved_a(tmp_path, servers, tokens=50):
    w = make(tmp_path, servers)
    w.servers = servers
    serve(w, "a", {0: tokens})
    serve(w, "b", {0: 10})                      # a saved
    assert files(tmp_path / "a") == ["slot0.bin", "slot0.json"]
    return w


def test_a_fifo_named_like_a_sidecar_never_blocks_and_is_swept(tmp_path, servers):
    """A FIFO named slot7.json froze the whole swapper (gevent blocked in its read)."""
    w = saved_a(tmp_path, servers)
    os.mkfifo(tmp_path / "a" / "slot7.json")
    os.mkfifo(tmp_path / "a" / "slot8.bin")
    (tmp_path / "a" / "slot9.json").symlink_to("/etc/passwd")
    (tmp_path / "a" / "evil.bin").write_bytes(b"x" * 1000)     # a save under any name
    assert w.driver.kv.evict() > 1000           # counted without reading the FIFOs
    serve(w, "a", {0: 10})                      # the restore: runs, and sweeps them
    assert files(tmp_path / "a") == ["slot0.bin", "slot0.json"]
    assert [c for c in servers["a"].calls if c[0] == "restore"]


def test_every_file_counts_towards_the_cap_and_strays_go_first(tmp_path, servers):
    w = saved_a(tmp_path, servers)
    (tmp_path / "b" / "evil.bin").write_bytes(b"x" * 5000)
    (tmp_path / "a" / "slot3.bin").write_bytes(b"y" * 7000)      # no sidecar
    usage = w.driver.kv.usage()
    names = [e[3].name for e in usage]
    assert {"evil.bin", "slot3.bin", "slot0.bin"} <= set(names)
    assert names.index("evil.bin") < names.index("slot0.bin")
    total = sum(p.stat().st_size for m in ("a", "b") for p in (tmp_path / m).iterdir())
    assert sum(e[1] for e in usage) == total
    w.driver.kv.settings = dataclasses.replace(w.driver.kv.settings,
                                               KV_CACHE_MAX_GB=(total - 12_000) / 1e9)
    w.driver.kv.evict()                         # over by the strays: they go, not a slot
    assert not (tmp_path / "b" / "evil.bin").exists()
    assert not (tmp_path / "a" / "slot3.bin").exists()
    assert (tmp_path / "a" / "slot0.bin").exists()


def test_a_huge_file_is_hashed_within_the_restore_deadline(tmp_path, servers):
    """A huge (or endless) slotN.bin was hashed with no deadline."""
    w = saved_a(tmp_path, servers)
    sidecar = tmp_path / "a" / "slot0.json"
    meta = json.loads(sidecar.read_text())
    big = 64 << 20
    with open(tmp_path / "a" / "slot0.bin", "ab") as f:
        f.truncate(big)
    meta["bytes"] = big
    sidecar.write_text(json.dumps(meta))
    kv = w.driver.kv
    ticks = iter(range(10 ** 6))
    kv._clock = lambda: 100.0 + next(ticks)     # a second per look at the clock
    with pytest.raises(kvcache._Skip) as e:
        kv._sha256(tmp_path / "a" / "slot0.bin", big, deadline=103.0)
    assert e.value.reason == "timeout"


def test_a_link_is_never_followed(tmp_path, servers):
    w = saved_a(tmp_path, servers)
    target = tmp_path / "elsewhere.bin"
    (tmp_path / "a" / "slot0.bin").rename(target)
    (tmp_path / "a" / "slot0.bin").symlink_to(target)
    with pytest.raises(kvcache._Skip, match="cannot be opened"):
        w.driver.kv._sha256(tmp_path / "a" / "slot0.bin", target.stat().st_size, 1e12)
    serve(w, "a", {0: 10})                      # swept, not restored
    assert not (tmp_path / "a" / "slot0.bin").exists() and target.exists()
    assert not [c for c in servers["a"].calls if c[0] == "restore"]
