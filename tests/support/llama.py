"""A real llama-server process on a free loopback port (from tests/testbed/testbed.env)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from .servers import free_port, wait_http


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


class LlamaServer:
    def __init__(self, ctx: int = 2048, parallel: int = 2):
        self.binary, self.model = llama_paths()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port",
                     str(self.port), "-c", str(ctx), "--parallel", str(parallel),
                     "--metrics", "--slots", "-t", "2"]

    def __enter__(self):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url + "/health", 120, proc=self.proc)
        except Exception:
            self.__exit__()
            raise RuntimeError("llama-server did not start:\n" + Path(self.log.name).read_text()[-3000:])
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
