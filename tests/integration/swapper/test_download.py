"""Downloads on first use for real: the swapper (python -m swapper, real Docker,
the test bed's llama-server) with MODELS_DIR a fresh folder and the SmolLM2 GGUF
served by a stand-in Hub over HF_ENDPOINT. A streamed request sees the progress
comments, /v1/models shows `downloading`, and then the model answers (200)."""
from __future__ import annotations

import threading
import time

import requests

from tests.support.fake_runtime import TINY_REPO, FakeHub, tiny_a_from_hub
from tests.support.swapperproc import SwapperProcess


def test_a_missing_model_is_downloaded_then_answers(tmp_path, docker_client):
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o755)
    tmp_path.chmod(0o755)
    gguf, manifest = tiny_a_from_hub(tmp_path)
    with FakeHub({f"{TINY_REPO}/{gguf.name}": gguf}, rate=40e6) as hub, \
            SwapperProcess(TESTBED_MODELS_DIR=str(models), MODELS_DIR=str(models),
                           MODELS_MANIFEST=str(manifest), HF_ENDPOINT=hub.url,
                           KEEPALIVE_INTERVAL="0.2") as sw:
        statuses = []

        def watch():
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    data = requests.get(sw.url + "/v1/models", timeout=5).json()["data"]
                    st = next(m for m in data if m["id"] == "tiny-a")["status"]
                    statuses.append(st)
                    if st["value"] == "loaded":
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.1)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        r = requests.post(sw.url + "/v1/chat/completions", stream=True, timeout=300, json={
            "model": "tiny-a", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        text = r.content.decode()
        del r               # its kept-alive socket would hold the swapper's stop 5 s
        watcher.join(60)
        assert ": downloading tiny-a: " in text, text[:2000]
        assert "/ 98.4 MB" in text
        assert "data: [DONE]" in text and '"error"' not in text, text[-2000:]
        down = [s for s in statuses if s["value"] == "downloading"]
        assert down and down[-1]["total_bytes"] == gguf.stat().st_size
        assert any(s["value"] == "loaded" for s in statuses)
        assert (models / gguf.name).stat().st_size == gguf.stat().st_size
        assert len([q for q in hub.requests if q[0] == "GET"]) == 1


def test_two_downloads_never_fill_a_small_disk(tmp_path, docker_client):
    """Issue 28's reproduction on a tmpfs (there 300 MB and 2 x 150 MB): two
    models that do not both fit, asked for at once through the real swapper.
    Each downloaded in its own thread and the free-space check ignored the
    other: the disk filled up (100 %) and both `.part` files stayed. Now one
    downloads (and answers), the other is refused with disk_full before it
    writes, the disk never goes below its 5 % headroom, no `.part` is left."""
    import shutil
    import subprocess
    gguf, _ = tiny_a_from_hub(tmp_path)
    size = gguf.stat().st_size                              # 98.4 MB
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6)},mode=0755",
                    "tmpfs", str(disk)], check=True)
    try:
        manifest = tmp_path / "two.toml"
        manifest.write_text(
            f'[tiny-a]\nsource = "hf"\nrepo = "{TINY_REPO}"\n'
            f'files = [ {{ local = "{gguf.name}", remote = "{gguf.name}" }} ]\n'
            f'[tiny-b]\nsource = "hf"\nrepo = "{TINY_REPO}"\n'
            f'files = [ {{ local = "b/{gguf.name}", remote = "b/{gguf.name}" }} ]\n')
        manifest.chmod(0o644)
        files = {f"{TINY_REPO}/{gguf.name}": gguf, f"{TINY_REPO}/b/{gguf.name}": gguf}
        lowest = []
        with FakeHub(files, rate=60e6) as hub, \
                SwapperProcess(TESTBED_MODELS_DIR=str(disk), MODELS_DIR=str(disk),
                               MODELS_MANIFEST=str(manifest), HF_ENDPOINT=hub.url) as sw:
            stop = threading.Event()

            def watch():
                while not stop.is_set():
                    lowest.append(shutil.disk_usage(disk).free)
                    time.sleep(0.02)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            answers = {}

            def ask(m):
                answers[m] = requests.post(sw.url + "/v1/chat/completions", timeout=300, json={
                    "model": m, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            threads = [threading.Thread(target=ask, args=(m,)) for m in ("tiny-a", "tiny-b")]
            # tiny-a first (tiny-b's registry entry loads tiny-a's file: were tiny-b's
            # download the one to go, its load would fail whatever the disk did).
            threads[0].start()
            deadline = time.monotonic() + 60
            while requests.get(sw.url + "/v1/models/tiny-a", timeout=10).json()[
                    "status"]["value"] != "downloading":
                assert time.monotonic() < deadline, "tiny-a's download never started"
                time.sleep(0.02)
            threads[1].start()
            for t in threads:
                t.join(300)
            stop.set()
            watcher.join(5)
            statuses = sorted(a.status_code for a in answers.values())
            assert statuses == [200, 507], {m: (a.status_code, a.text[:300])
                                            for m, a in answers.items()}
            refused = next(a for a in answers.values() if a.status_code == 507)
            assert "the disk is full" in refused.json()["error"]["message"]
            del answers, refused    # their kept-alive sockets would hold the swapper's stop 5 s
            requests.post(sw.url + "/unload", timeout=120)
        total = shutil.disk_usage(disk).total
        assert min(lowest) >= 0.05 * total - 4096, (min(lowest), total)
        assert list(disk.rglob("*.part")) == [] and list(disk.rglob("*.part.json")) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_file_changed_upstream_between_two_attempts_is_fetched_whole(tmp_path, docker_client):
    """Issue 28: a resumed download sent Range against the moving `main` with no
    If-Range: a file changed upstream between two attempts was stitched from two
    versions (the size still right) and then loaded. Through the real swapper:
    the first attempt is cut at 30 MB, a new version is published (a MB of its
    tensor data changed, before the cut: llama-server still loads it), the next
    request gets it whole (resumed, it would keep the old MB)."""
    import hashlib
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o755)
    tmp_path.chmod(0o755)
    gguf, manifest = tiny_a_from_hub(tmp_path)
    v1 = gguf.read_bytes()
    at, n = 10 << 20, 1 << 20                                   # tensor data, before the cut
    v2 = v1[:at] + bytes(b ^ 0x01 for b in v1[at:at + n]) + v1[at + n:]
    key = f"{TINY_REPO}/{gguf.name}"
    body = {"model": "tiny-a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with FakeHub({key: v1}, rate=80e6) as hub, \
            SwapperProcess(TESTBED_MODELS_DIR=str(models), MODELS_DIR=str(models),
                           MODELS_MANIFEST=str(manifest), HF_ENDPOINT=hub.url) as sw:
        hub.reset_after = 30 << 20
        r = requests.post(sw.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 502 and "download failed" in r.text, r.text[:300]
        assert (models / (gguf.name + ".part")).stat().st_size >= 30 << 20
        hub.reset_after = None
        hub.replace(key, v2)                                    # a new version upstream
        r = requests.post(sw.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text[:300]
        got = hashlib.sha256((models / gguf.name).read_bytes()).hexdigest()
        assert got == hashlib.sha256(v2).hexdigest(), "stitched from two versions"
        method, path, rng = [q for q in hub.requests if q[0] == "GET"][-1]
        assert rng is None and f"/resolve/{FakeHub.commit(v2)}/" in path
        del r               # its kept-alive socket would hold the swapper's stop 5 s
        requests.post(sw.url + "/unload", timeout=120)
