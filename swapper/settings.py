"""Every environment variable the swapper reads, typed, with its default."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from common.config import env_bool, env_float, env_int, env_str

_REPO_BACKENDS = Path(__file__).resolve().parent.parent / "backends"


@dataclass(frozen=True)
class Settings:
    host: str = "0.0.0.0"
    port: int = 9000
    backends_dir: str = str(_REPO_BACKENDS)
    default_model: str | None = None
    stack_name: str = "coding-stack"
    max_queue: int = 64
    # Where the backend's internal port is published on the host (direct access).
    publish_port: int = 18080
    publish_bind: str = "127.0.0.1"
    # The stack's Docker network. Set (compose does): the swapper reaches the
    # backend by container name. Unset: through the published port on backend_host.
    docker_network: str | None = None
    backend_host: str = "127.0.0.1"
    # Host folder that relative volume paths in backends/ are resolved against
    # (the Docker daemon needs host paths, also when the swapper runs in a container).
    host_dir: str = str(_REPO_BACKENDS.parent)
    connect_timeout: float = 10.0
    health_interval: float = 0.025
    watch_interval: float = 1.0
    backoff_base: float = 2.0
    backoff_max: float = 60.0
    pull_images: bool = True
    log_tail: int = 40
    max_n: int = 8
    keepalive_interval: float = 5.0      # SSE comment while a streamed request waits
    preload: str | None = None           # model loaded when the swapper starts
    idle_model: str | None = None        # model swapped back in when another's idle_ttl ends
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        e = dict(os.environ if env is None else env)
        d = cls()
        return cls(
            host=env_str(e, "SWAPPER_HOST", d.host),
            port=env_int(e, "SWAPPER_PORT", d.port),
            backends_dir=env_str(e, "BACKENDS_DIR", d.backends_dir),
            default_model=env_str(e, "DEFAULT_MODEL", "") or None,
            stack_name=env_str(e, "STACK_NAME", d.stack_name),
            max_queue=env_int(e, "MAX_QUEUE", d.max_queue),
            publish_port=env_int(e, "BACKEND_PUBLISH_PORT", d.publish_port),
            publish_bind=env_str(e, "BACKEND_BIND", d.publish_bind),
            docker_network=env_str(e, "DOCKER_NETWORK", "") or None,
            backend_host=env_str(e, "BACKEND_HOST", d.backend_host),
            host_dir=env_str(e, "HOST_DIR", d.host_dir),
            connect_timeout=env_float(e, "CONNECT_TIMEOUT", d.connect_timeout),
            health_interval=env_float(e, "HEALTH_INTERVAL", d.health_interval),
            watch_interval=env_float(e, "WATCH_INTERVAL", d.watch_interval),
            backoff_base=env_float(e, "CRASH_BACKOFF", d.backoff_base),
            backoff_max=env_float(e, "CRASH_BACKOFF_MAX", d.backoff_max),
            pull_images=env_bool(e, "PULL_IMAGES", d.pull_images),
            log_tail=env_int(e, "LOG_TAIL", d.log_tail),
            max_n=env_int(e, "MAX_N", d.max_n),
            keepalive_interval=env_float(e, "KEEPALIVE_INTERVAL", d.keepalive_interval),
            preload=env_str(e, "PRELOAD", "") or None,
            idle_model=env_str(e, "IDLE_MODEL", "") or None,
            env=e,
        )
