"""Every environment variable the swapper reads, typed, with its default
(read by common.config: a bad value stops the swapper at start, naming the
variable). Each setting is spelled as its variable, as in the proxy's."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from common import config
from common.config import PORT, setting

_REPO_BACKENDS = Path(__file__).resolve().parent.parent / "backends"
_REPO_SCRIPTS = _REPO_BACKENDS.parent / "scripts"


@dataclass(frozen=True)
class Settings:
    SWAPPER_HOST: str = setting("0.0.0.0")
    SWAPPER_PORT: int = setting(9000, **PORT)
    # Host names it answers for besides `swapper` (its compose service name),
    # loopback names and IP addresses (comma-separated; "*": any); else 421.
    ALLOWED_HOSTS: str = ""
    BACKENDS_DIR: str = setting(str(_REPO_BACKENDS))
    DEFAULT_MODEL: str | None = setting(None)
    STACK_NAME: str = setting("coding-stack")
    MAX_QUEUE: int = setting(64, min=1)
    # The swap policy (swapper/scheduler.py; README "How swapping and queueing
    # behave"). hold: an agent session's next request within its hold goes
    # before other models' waiting requests (HOLD_FIRST_SECONDS after its first
    # request, then twice its longest recent gap + 1 s, at most HOLD_SECONDS),
    # for at most a quantum of
    # QUANTUM_FACTOR x the waiting model's expected load time, clamped to
    # [QUANTUM_MIN_SECONDS, QUANTUM_MAX_SECONDS]. fifo: swap as soon as the
    # resident model is drained (no holds).
    SWAP_POLICY: str = setting("hold", choices=("hold", "fifo"))
    HOLD_SECONDS: float = setting(10.0, min=0)
    HOLD_FIRST_SECONDS: float = setting(3.0, min=0)
    QUANTUM_FACTOR: float = setting(3.0, min=0)
    QUANTUM_MIN_SECONDS: float = setting(5.0, min=0)
    QUANTUM_MAX_SECONDS: float = setting(300.0, min=0)
    # While one model serves and another's requests wait, read the waiting model's
    # files into the page cache (swapper/prefetch.py), only while the host's free
    # memory stays above PREFETCH_RESERVE_GB (the resident model's pages are kept).
    PREFETCH: bool = setting(True)
    PREFETCH_RESERVE_GB: float = setting(4.0, min=0)
    # Where the backend's internal port is published on the host (direct access).
    BACKEND_PUBLISH_PORT: int = setting(18080, **PORT)
    BACKEND_BIND: str = setting("127.0.0.1")
    # The backends' own API key (llama-server/vLLM --api-key, given as LLAMA_API_KEY /
    # VLLM_API_KEY), added by the swapper to what it sends them: the published port is
    # no side door. Unset: a random secret per swapper run (or the one of the backend
    # it adopts). Set it to use the published port directly (benchmark.sh --direct).
    BACKEND_API_KEY: str | None = setting(None, repr=False)
    # The stack's Docker network. Set (compose does): the swapper reaches the
    # backend by container name. Unset: through the published port on BACKEND_HOST.
    DOCKER_NETWORK: str | None = setting(None)
    BACKEND_HOST: str = setting("127.0.0.1")
    # Host folder that relative volume paths in backends/ are resolved against
    # (the Docker daemon needs host paths, also when the swapper runs in a container).
    HOST_DIR: str = setting(str(_REPO_BACKENDS.parent))
    CONNECT_TIMEOUT: float = setting(10.0, min=0.001)
    HEALTH_INTERVAL: float = setting(0.01, min=0.001)
    WATCH_INTERVAL: float = setting(1.0, min=0.01)
    CRASH_BACKOFF: float = setting(2.0, min=0)
    CRASH_BACKOFF_MAX: float = setting(60.0, min=0)
    PULL_IMAGES: bool = setting(True)
    LOG_TAIL: int = setting(40, min=0)
    MAX_N: int = setting(8, min=1)
    # SSE comment interval while a streamed request waits (load, swap, queue).
    KEEPALIVE_INTERVAL: float = setting(5.0, min=0.05)
    # A streamed request to a llama.cpp backend asks for its prompt progress, relayed
    # as SSE comments in words (swapper/progress.py); 0: sent as the client sent it.
    PREFILL_PROGRESS: bool = setting(True)
    PRELOAD: str | None = setting(None)         # loaded when the swapper starts
    IDLE_MODEL: str | None = setting(None)   # swapped back in after an idle_ttl
    # llama.cpp prompt caches saved when a backend stops, restored when it is next
    # loaded (swapper/kvcache.py, docs/kv-cache.md). KV_CACHE_DIR: the swapper's
    # folder for them (unset: off). KV_CACHE_VOLUME: what backends mount for it (a
    # host path, ./ relative to HOST_DIR, or a named Docker volume; unset: KV_CACHE_DIR).
    KV_CACHE_DIR: str | None = setting(None)
    KV_CACHE_VOLUME: str | None = setting(None)
    KV_CACHE_MAX_GB: float = setting(20.0, min=0)       # total on disk; least recently used go
    KV_CACHE_SAVE_TIMEOUT: float = setting(30.0, min=0)     # per stop, all slots; 0: never save
    KV_CACHE_RESTORE_TIMEOUT: float = setting(30.0, min=0)  # per load, all slots; 0: never restore
    # Conversations kept per model (one-slot backends): saved before a stop, restored
    # into llama-server's RAM prompt cache at the next load; the least recent go first.
    KV_CACHE_CONVERSATIONS: int = setting(8, min=1, max=256)
    # Downloads on first use (swapper/download.py): a model whose files are missing
    # is fetched when first asked for, by download-model.sh's code (scripts/models.py)
    # from the files of scripts/models.toml. AUTO_DOWNLOAD=0: a 409 naming
    # ./download-model.sh instead. DOWNLOAD_MODELS_DIR / DOWNLOAD_HF_HOME: where this
    # process sees MODELS_DIR / HF_HOME (compose mounts them; unset: MODELS_DIR and
    # HF_HOME resolved against HOST_DIR, as backends/ mounts them).
    AUTO_DOWNLOAD: bool = setting(True)
    MODELS_MANIFEST: str = setting(str(_REPO_SCRIPTS / "models.toml"))
    MODELS_SCRIPT: str = setting(str(_REPO_SCRIPTS / "models.py"))
    DOWNLOAD_MODELS_DIR: str | None = setting(None)
    DOWNLOAD_HF_HOME: str | None = setting(None)
    # The whole environment: backends/ interpolates ${VAR:-default} from it.
    env: Mapping[str, str] = setting({}, read=False, repr=False)

    def models_dir(self) -> str:
        """MODELS_DIR as this process sees it (where downloads are written)."""
        return self.DOWNLOAD_MODELS_DIR or self._host_path(self.env.get("MODELS_DIR"), "./models")

    def hf_home(self) -> str:
        return self.DOWNLOAD_HF_HOME or self._host_path(self.env.get("HF_HOME"), "./hf-cache")

    def _host_path(self, value: str | None, default: str) -> str:
        p = Path(os.path.expanduser(value or default))
        return str(p if p.is_absolute() else (Path(self.HOST_DIR) / p).resolve())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Raises common.config.ConfigError naming a bad variable."""
        e = dict(os.environ if env is None else env)
        return config.load(cls, e, env=e, **overrides)
