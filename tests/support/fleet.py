"""Several stacks behind a real LiteLLM proxy (deploy/fleet): the router process, its
config written by scripts/fleet.py, and helpers to read which stack served a request
and how many loads and swaps each stack did."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import docker
import requests
import yaml

from scripts import fleet
from .process import REPO, ServiceProcess
from .swapperproc import stack_containers

FLEET_DIR = REPO / "deploy" / "fleet"
KEY = "sk-fleet-test"


def litellm_binary() -> str:
    """The pinned LiteLLM the test bed installs (tests/testbed/setup.sh); raises (the
    test fails, never skips) when it is missing."""
    b = os.environ.get("TESTBED_LITELLM", "")
    if not (b and os.access(b, os.X_OK)):
        raise RuntimeError("TESTBED_LITELLM not set or not executable: run tests/testbed/setup.sh "
                           "and source tests/testbed/testbed.env")
    return b


class LiteLLMRouter(ServiceProcess):
    """`litellm --config` with the config scripts/fleet.py writes for `stacks`
    ({name: base URL}); the plugin (deploy/fleet/routing.py) beside the config."""
    name = "litellm"
    health_path = "/health/liveliness"
    ready_timeout = 180.0

    def __init__(self, stacks: dict[str, str], strategy: str = "fleet", cooldown: float = 5.0,
                 poll: float = 0.5, patterns: dict | None = None, keys: dict | None = None,
                 **env):
        # `keys`: the stacks' API_KEYs ({name: key}), given to the router as docs/fleet.md
        # says (FLEET_KEY_<NAME>; the config names the variable, never the key)
        keys = keys or {}
        super().__init__({"LITELLM_MASTER_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                          "LITELLM_LOG": "ERROR", "NO_DOCS": "True",
                          **{fleet.env_name(n): k for n, k in keys.items()}, **env})
        self.dir = Path(tempfile.mkdtemp(prefix="fleet-"))
        shutil.copy(FLEET_DIR / "routing.py", self.dir / "routing.py")
        models = {n: fleet.fetch_models(u, keys.get(n)) for n, u in stacks.items()}
        self.config = fleet.build(models, stacks, strategy, keyed=set(keys), cooldown=cooldown,
                                  poll=poll, patterns=patterns)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))

    def command(self) -> list[str]:
        return [litellm_binary(), "--config", str(self.dir / "config.yaml"), "--host",
                "127.0.0.1", "--port", str(self.port), "--num_workers", "1"]

    def __exit__(self, *exc):
        super().__exit__(*exc)
        shutil.rmtree(self.dir, ignore_errors=True)


def served_by(resp: requests.Response, stacks: dict[str, str]) -> str | None:
    """Which stack answered, from LiteLLM's `x-litellm-model-id` header (the
    deployment id scripts/fleet.py writes: `<stack>:<api>:<model>`)."""
    stack = (resp.headers.get("x-litellm-model-id") or "").split(":", 1)[0]
    return stack if stack in stacks else None


def swapper_counts(swapper_url: str) -> dict[str, float]:
    """{"loads": ..., "swaps": ...} from the swapper's /metrics (swaps: loads that
    stopped another model first, `swapper_swap_seconds_count`)."""
    text = requests.get(swapper_url + "/metrics", timeout=5).text
    loads = swaps = 0.0
    for line in text.splitlines():
        if line.startswith("swapper_loads_total{") and 'result="ok"' in line:
            loads += float(line.rsplit(" ", 1)[1])
        if line.startswith("swapper_swap_seconds_count{"):
            swaps += float(line.rsplit(" ", 1)[1])
    return {"loads": loads, "swaps": swaps}


class DockerSampler:
    """Samples each stack's running backend containers every `every` s on a thread;
    `max_running[stack]` is the most seen at once."""

    def __init__(self, stacks: list[str], every: float = 0.2):
        self.stacks = stacks
        self.every = every
        self.max_running = {s: 0 for s in stacks}
        self.samples = 0
        self._stop = threading.Event()
        self._client = docker.from_env()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for s in self.stacks:
                try:
                    n = len(stack_containers(self._client, s, running_only=True))
                except docker.errors.APIError:
                    continue
                self.max_running[s] = max(self.max_running[s], n)
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)


def chat(router: str, model: str, headers: dict | None = None, timeout: float = 120,
         **body) -> requests.Response:
    return requests.post(router + "/v1/chat/completions", timeout=timeout,
                         headers={"Authorization": f"Bearer {KEY}", **(headers or {})},
                         json={"model": model, "max_tokens": 2, "temperature": 0,
                               "messages": [{"role": "user", "content": "hi"}], **body})
