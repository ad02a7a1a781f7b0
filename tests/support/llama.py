"""A real llama-server process on a free loopback port (from tests/testbed/testbed.env)."""
from __future__ import annotations

import os
from pathlib import Path

from .process import ServiceProcess


def llama_paths() -> tuple[str, str]:
    """(binary, model file). Raises (so tests FAIL, not skip) when the test bed is missing."""
    binary = os.environ.get("TESTBED_LLAMA_SERVER")
    models = os.environ.get("TESTBED_MODELS_DIR")
    model = os.environ.get("TESTBED_MODEL_FILE")
    if not binary or not model:
        raise RuntimeError("TESTBED_LLAMA_SERVER / TESTBED_MODEL_FILE are not set: source "
                           "tests/testbed/testbed.env (made by tests/testbed/setup.sh)")
    path = Path(model)
    if not path.is_absolute() and models:
        path = Path(models) / model
    if not Path(binary).exists() or not path.exists():
        raise RuntimeError(f"llama-server {binary} or model {path} does not exist")
    return binary, str(path)


class LlamaServer(ServiceProcess):
    name = "llama-server"
    health_path = "/health"
    ready_timeout = 120.0

    def __init__(self, ctx: int = 2048, parallel: int = 2):
        super().__init__()
        self.binary, self.model = llama_paths()
        self.args = [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port",
                     str(self.port), "-c", str(ctx), "--parallel", str(parallel),
                     "--metrics", "--slots", "-t", "2"]

    def command(self) -> list[str]:
        return self.args
