"""The product as a user runs it: `docker compose up -d`, then the OpenAI SDK
against :11433, then `docker compose down` leaving nothing behind."""
import json
import subprocess

import docker
import openai
import pytest
import requests

from tests.support.compose import REPO, Compose, up
from tests.support.swapperproc import stack_containers


def test_default_compose_file_is_valid():
    p = subprocess.run(["docker", "compose", "-f", "docker-compose.yaml", "config", "-q"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(["docker", "compose", "-f", "docker-compose.yaml", "--profile", "searxng",
                        "config", "--services"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and set(p.stdout.split()) == {"proxy", "swapper", "searxng"}


def test_env_example_parses_as_documented():
    """Every value of .env.example reaches the services as written (compose reads
    an inline comment into the value, so the file must not have any)."""
    import json as _json
    p = subprocess.run(["docker", "compose", "-f", "docker-compose.yaml", "--env-file",
                        ".env.example", "config", "--format", "json"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    services = _json.loads(p.stdout)["services"]
    for name in ("proxy", "swapper"):
        for key, value in services[name]["environment"].items():
            assert "#" not in (value or ""), f"{name}: {key}={value!r}"
    assert services["swapper"]["environment"]["MAX_QUEUE"] == "64"
    assert services["proxy"]["ports"][0]["host_ip"] == "127.0.0.1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with up(Compose(tmp_path_factory.mktemp("elsewhere"))) as compose:
        yield compose


@pytest.fixture
def openai_client(stack):
    """Closed after the test: an idle keep-alive connection left open to the proxy holds
    its shutdown (gunicorn waits graceful_timeout, 30 s, for it) in `docker compose down`."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.proxy_port}/v1", api_key="none",
                       timeout=None, max_retries=0) as client:
        yield client


def test_the_stack_end_to_end(stack, openai_client):
    client = openai_client
    ids = {m.id for m in client.models.list().data}
    assert {"tiny-a", "tiny-b"} <= ids

    r = client.chat.completions.create(model="tiny-a", max_tokens=8,
                                       messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content

    chunks = list(client.chat.completions.create(
        model="a", max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "Say hello."}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    running = requests.get(f"http://127.0.0.1:{stack.proxy_port}/running", timeout=10).json()
    assert running["model"] == "tiny-a"

    # swap to the other CPU model
    r = client.chat.completions.create(model="tiny-b", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None
    running = requests.get(f"http://127.0.0.1:{stack.proxy_port}/running", timeout=10).json()
    assert running["model"] == "tiny-b"
    assert running["last_swap_seconds"] > 0 and running["last_load_seconds"] > 0
    # The load times (the next loads' ETAs) are kept in the swapper's volume.
    kept = stack("exec", "-T", "swapper", "cat", "/kvcache/load-times.json").stdout
    # tiny-a's prompt cache was saved by its backend (nobody) into its folder, which is
    # shared with the backends' group only (issue 28: not world-writable), by the
    # swapper running as its own user with that group kept.
    folder = stack("exec", "-T", "swapper", "stat", "-c", "%a %g", "/kvcache/tiny-a").stdout
    assert folder.split() == ["2770", "65534"], folder
    saved = stack("exec", "-T", "swapper", "ls", "/kvcache/tiny-a").stdout.split()
    assert "slot0.bin" in saved or "slot1.bin" in saved, saved
    assert set(json.loads(kept)["models"]) == {"tiny-a", "tiny-b"}, kept
    backends = stack_containers(docker.from_env(), stack.stack, running_only=True)
    assert [c.labels["org.coding-stack.model"] for c in backends] == ["tiny-b"]

    # the resident backend, directly on its published port: with its own key only
    # (BACKEND_API_KEY; issue 28: the port is no side door for a web page)
    url = f"http://127.0.0.1:{stack.backend_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert requests.post(url, json=body, timeout=60).status_code == 401
    direct = requests.post(url, json=body, timeout=60,
                           headers={"Authorization": "Bearer e2e-backend-key"})
    assert direct.status_code == 200 and direct.json()["choices"]


def test_services_run_without_root(stack):
    """Least privilege under compose: the swapper drops to its own user with
    the Docker socket's group; the proxy's image has its own user too. (Docker
    runs the image's HEALTHCHECK probe as the image's user: a probe caught
    mid-run is not the service.)"""
    client = docker.from_env()
    for service, uid in (("swapper", "10001"), ("proxy", None)):
        (c,) = client.containers.list(filters={
            "label": [f"com.docker.compose.project={stack.stack}",
                      f"com.docker.compose.service={service}"]})
        top = c.top(ps_args="-o pid,uid,args")
        col = top["Titles"].index("UID")
        uids = {row[col] for row in top["Processes"] if "healthz" not in row[-1]}
        assert "0" not in uids, f"{service} runs processes as root: {top['Processes']}"
        if uid:
            assert uids == {uid}, uids


def test_relative_volumes_resolve_against_the_compose_folder(stack):
    """compose ran from another folder (and PWD says so): `./` in backends/ is still the
    compose folder, which the swapper read from its own container. rel-mount serves the
    folder it mounts and is healthy only when that folder holds the marker."""
    base = f"http://127.0.0.1:{stack.proxy_port}"
    # Its health path is /marker.txt: the load's upstream_status is 200 only when the
    # mounted folder holds the marker (/upstream forwards read-only paths only).
    r = requests.post(f"{base}/load/rel-mount", timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["upstream_status"] == 200, r.text
    assert (REPO / "tests/fixtures/mounted/marker.txt").is_file()
    assert not (stack.cwd / "tests").exists(), "nothing was mounted from the caller's folder"
