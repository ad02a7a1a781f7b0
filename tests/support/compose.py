"""`docker compose` on the repository's compose file with the stand-in images, run
from another folder, and the stack up for a test and down after it."""
import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import docker

from .process import REPO
from .servers import free_port, wait_http
from .swapperproc import load_testbed_env, stack_containers


class Compose:
    """Runs `docker compose -f <repo>/docker-compose.yaml ...` from ANOTHER folder (cwd),
    as a user may: nothing may depend on the caller's folder."""

    def __init__(self, cwd: Path, *overrides: Path):
        self.cwd = cwd
        self.files = [REPO / "docker-compose.yaml", REPO / "tests/e2e/compose.test.yaml",
                      *overrides]
        self.stack = f"cse2e-{uuid.uuid4().hex[:6]}"
        self.proxy_port = free_port()
        self.backend_port = free_port()
        self.env = {
            **os.environ, **load_testbed_env(),
            "STACK_NAME": self.stack,
            "PROXY_PORT": str(self.proxy_port), "PROXY_BIND": "127.0.0.1",
            "BACKEND_PUBLISH_PORT": str(self.backend_port),
            "BACKEND_API_KEY": "e2e-backend-key",
            "PYTHON_BASE_IMAGE": os.environ["TESTBED_BASE_IMAGE"],
            "WEB_SEARCH": "0",        # no SearXNG in this test; the search loop has its own tests
            "PWD": str(cwd),
        }
        self.env.pop("HOST_DIR", None)

    def __call__(self, *args, check=True, timeout=900):
        cmd = ["docker", "compose", *[a for f in self.files for a in ("-f", str(f))], *args]
        p = subprocess.run(cmd, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "80", check=False).stdout


@contextlib.contextmanager
def up(compose: Compose):
    """The stack built and up (healthy), then down, nothing left behind."""
    client = docker.from_env()
    try:
        compose("build")
        compose("up", "-d", "--wait", "--wait-timeout", "180")
        wait_http(f"http://127.0.0.1:{compose.proxy_port}/healthz", 60)
        yield compose
    except Exception:
        print(compose.logs())
        raise
    finally:
        down = compose("down", "--remove-orphans", "--timeout", "60", check=False)
        left = stack_containers(client, compose.stack) + client.containers.list(
            all=True, filters={"label": f"com.docker.compose.project={compose.stack}"})
        nets = client.networks.list(names=[compose.stack])
        for c in left:                       # never leak, even when the test fails
            c.remove(force=True)
        for n in nets:
            n.remove()
        assert down.returncode == 0, down.stderr
        assert not left, f"left behind: {[c.name for c in left]}"
        assert not nets, "network left behind"
