"""Every environment variable the swapper reads, typed, with its default
(read by common.config: a bad value stops the swapper at start, naming the variable)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from common import config
from common.config import PORT, setting

_REPO_BACKENDS = Path(__file__).resolve().parent.parent / "backends"


@dataclass(frozen=True)
class Settings:
    host: str = setting("0.0.0.0", env="SWAPPER_HOST")
    port: int = setting(9000, env="SWAPPER_PORT", **PORT)
    backends_dir: str = setting(str(_REPO_BACKENDS), env="BACKENDS_DIR")
    default_model: str | None = setting(None, env="DEFAULT_MODEL")
    stack_name: str = setting("coding-stack", env="STACK_NAME")
    max_queue: int = setting(64, env="MAX_QUEUE", min=1)
    # Where the backend's internal port is published on the host (direct access).
    publish_port: int = setting(18080, env="BACKEND_PUBLISH_PORT", **PORT)
    publish_bind: str = setting("127.0.0.1", env="BACKEND_BIND")
    # The stack's Docker network. Set (compose does): the swapper reaches the
    # backend by container name. Unset: through the published port on backend_host.
    docker_network: str | None = setting(None, env="DOCKER_NETWORK")
    backend_host: str = setting("127.0.0.1", env="BACKEND_HOST")
    # Host folder that relative volume paths in backends/ are resolved against
    # (the Docker daemon needs host paths, also when the swapper runs in a container).
    host_dir: str = setting(str(_REPO_BACKENDS.parent), env="HOST_DIR")
    connect_timeout: float = setting(10.0, env="CONNECT_TIMEOUT", min=0.001)
    health_interval: float = setting(0.01, env="HEALTH_INTERVAL", min=0.001)
    watch_interval: float = setting(1.0, env="WATCH_INTERVAL", min=0.01)
    backoff_base: float = setting(2.0, env="CRASH_BACKOFF", min=0)
    backoff_max: float = setting(60.0, env="CRASH_BACKOFF_MAX", min=0)
    pull_images: bool = setting(True, env="PULL_IMAGES")
    log_tail: int = setting(40, env="LOG_TAIL", min=0)
    max_n: int = setting(8, env="MAX_N", min=1)
    # SSE comment interval while a streamed request waits (load, swap, queue).
    keepalive_interval: float = setting(5.0, env="KEEPALIVE_INTERVAL", min=0.05)
    preload: str | None = setting(None, env="PRELOAD")         # loaded when the swapper starts
    idle_model: str | None = setting(None, env="IDLE_MODEL")   # swapped back in after an idle_ttl
    # The whole environment: backends/ interpolates ${VAR:-default} from it.
    env: Mapping[str, str] = setting({}, read=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Raises common.config.ConfigError naming a bad variable."""
        e = dict(os.environ if env is None else env)
        return config.load(cls, e, env=e, **overrides)
