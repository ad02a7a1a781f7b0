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
        watcher.join(60)
        assert ": downloading tiny-a: " in text, text[:2000]
        assert "/ 98.4 MB" in text
        assert "data: [DONE]" in text and '"error"' not in text, text[-2000:]
        down = [s for s in statuses if s["value"] == "downloading"]
        assert down and down[-1]["total_bytes"] == gguf.stat().st_size
        assert any(s["value"] == "loaded" for s in statuses)
        assert (models / gguf.name).stat().st_size == gguf.stat().st_size
        assert len([q for q in hub.requests if q[0] == "GET"]) == 1
