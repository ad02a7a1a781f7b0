"""Prefetching a waiting model's files into the page cache (swapper/prefetch.py):
which files, bounded by free memory, stopped when its load starts."""
from types import SimpleNamespace

from swapper.prefetch import CHUNK, Prefetcher, local_view, model_files
from swapper.settings import Settings


def spec(volumes, args):
    return SimpleNamespace(volumes=tuple(volumes), args=tuple(args))


def test_the_files_a_backend_reads_from_its_mounts(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.gguf").write_bytes(b"x" * 10)
    (tmp_path / "m" / "mmproj.gguf").write_bytes(b"y")
    (tmp_path / "m" / "ckpt").mkdir()
    (tmp_path / "m" / "ckpt" / "w.safetensors").write_bytes(b"z")
    s = spec([f"{tmp_path}/m:/models:ro", "named-volume:/kv"],
             ["-m", "/models/a.gguf", "--mmproj", "/models/mmproj.gguf", "--model",
              "/models/ckpt", "-c", "2048", "/models/missing.gguf", "/kv/slot0.bin"])
    settings = Settings.from_env({"HOST_DIR": str(tmp_path)})
    files = model_files(s, local_view(settings))
    assert [f.name for f in files] == ["a.gguf", "mmproj.gguf", "w.safetensors"]


def test_compose_models_folder_is_read_where_the_swapper_mounts_it(tmp_path):
    mounted = tmp_path / "in-swapper"
    mounted.mkdir()
    (mounted / "q.gguf").write_bytes(b"q")
    settings = Settings.from_env({"HOST_DIR": "/nonexistent-host", "MODELS_DIR": "./models",
                                  "DOWNLOAD_MODELS_DIR": str(mounted)})
    files = model_files(spec(["./models:/models:ro"], ["-m", "/models/q.gguf"]),
                        local_view(settings))
    assert files == [mounted / "q.gguf"]


def run_now(fn, *args):
    fn(*args)


def test_reads_while_free_memory_stays_above_the_reserve(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"\0" * (3 * CHUNK))
    free = iter([10 * CHUNK, 10 * CHUNK, 2 * CHUNK, 10 * CHUNK])
    p = Prefetcher(lambda m: [f], reserve_bytes=2 * CHUNK, free=lambda: next(free),
                   spawn=run_now)
    p.want("y")
    assert p.done["y"] == 2 * CHUNK      # the third chunk would eat into the reserve


def test_events_start_and_stop_it(tmp_path):
    asked = []
    p = Prefetcher(lambda m: asked.append(m) or [], reserve_bytes=0, spawn=run_now)
    p.scheduler_event("queued", {"model": "y", "resident": "x", "phase": "ready"})
    p.scheduler_event("queued", {"model": "x", "resident": "x", "phase": "ready"})
    p.scheduler_event("queued", {"model": "z", "resident": "x", "phase": "loading"})
    p.scheduler_event("holding", {"model": "x", "waiting": "z"})
    assert asked == ["y", "z"]
    p._want = "z"                                   # a read under way...
    p.scheduler_event("load_started", {"model": "z"})
    assert p._want is None                          # ...stops at its next chunk
    off = Prefetcher(lambda m: asked.append(m) or [], 0, enabled=False, spawn=run_now)
    off.want("q")
    assert "q" not in asked
