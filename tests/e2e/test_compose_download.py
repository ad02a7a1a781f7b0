"""Downloads on first use as a user meets them: `docker compose up -d` with a
MODELS_DIR that does not hold the model (AUTO_DOWNLOAD on, its default), then one
streamed request through :11433. The swapper container fetches the GGUF from a
stand-in Hub on the host (the Hub's resolve/HEAD protocol, over HF_ENDPOINT),
into the MODELS_DIR compose mounts, and the backend it then starts answers."""
from __future__ import annotations


import requests

from tests.support.compose import REPO, Compose, up
from tests.support.fake_runtime import TINY_REPO, FakeHub, tiny_a_from_hub


def streamed_chat(base: str) -> tuple[int, str]:
    """The status and body of one streamed chat. Its response dies here: kept alive,
    it keeps its socket open (requests/urllib3 close the connection, not the file
    the response reads from), and that idle connection holds the proxy's shutdown in
    `docker compose down` for gunicorn's graceful_timeout (30 s)."""
    r = requests.post(base + "/v1/chat/completions", stream=True, timeout=600, json={
        "model": "tiny-a", "stream": True, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    return r.status_code, r.content.decode()


def test_a_model_not_on_disk_is_downloaded_then_answers_through_compose(tmp_path_factory):
    root = tmp_path_factory.mktemp("download")
    root.chmod(0o755)
    models = root / "models"
    models.mkdir()                          # empty, root's: the swapper makes it its own
    gguf, manifest = tiny_a_from_hub(root)
    with FakeHub({f"{TINY_REPO}/{gguf.name}": gguf}, rate=40e6, host="0.0.0.0") as hub:
        compose = Compose(tmp_path_factory.mktemp("elsewhere"),
                          REPO / "tests/e2e/compose.download.yaml")
        compose.env.update(MODELS_DIR=str(models), TESTBED_MODELS_DIR=str(models),
                           HF_ENDPOINT=f"http://host.docker.internal:{hub.port}",
                           E2E_MANIFEST=str(manifest), KEEPALIVE_INTERVAL="0.5")
        compose.env.pop("AUTO_DOWNLOAD", None)          # the default: on
        with up(compose):
            base = f"http://127.0.0.1:{compose.proxy_port}"
            status = {m["id"]: m["status"] for m in
                      requests.get(base + "/v1/models", timeout=10).json()["data"]}
            assert status["tiny-a"]["value"] == "unloaded"
            assert not (models / gguf.name).exists()
            status_code, body = streamed_chat(base)
            assert status_code == 200, body
            assert ": downloading tiny-a: " in body and "/ 98.4 MB" in body, \
                body[:2000] + compose.logs()
            assert "data: [DONE]" in body and '"error"' not in body, body[-2000:]
            assert (models / gguf.name).stat().st_size == gguf.stat().st_size
            assert [q[0] for q in hub.requests].count("GET") == 1
            status = {m["id"]: m["status"] for m in
                      requests.get(base + "/v1/models", timeout=10).json()["data"]}
            assert status["tiny-a"]["value"] == "loaded"
            rec = requests.get(base + "/ui/activity", timeout=10).json()["data"][-1]
            assert rec["model"] == "tiny-a" and rec["queue_wait"] > 0, rec
