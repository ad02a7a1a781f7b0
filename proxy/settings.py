"""Every environment variable the proxy reads, typed, with its default, in one place
(read by common.config: a bad value stops the proxy at start, naming the variable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from common import config
from common.config import PORT, setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Settings:
    # where requests go: the swapper, or a single llama-server / vLLM
    BACKEND_URL: str = setting("http://swapper:9000", url=True)
    PROXY_HOST: str = "0.0.0.0"
    PROXY_PORT: int = setting(11433, **PORT)
    # gunicorn gevent workers; > 1 puts the metrics in multiprocess mode (one set for all)
    PROXY_WORKERS: int = setting(1, min=1, max=64)
    # upstream connect timeout; read timeout is unbounded
    CONNECT_TIMEOUT: float = setting(10.0, min=0.001)
    MAX_BODY_BYTES: int = setting(64 * 1024 * 1024, min=1)
    API_KEY: str = setting("", repr=False)  # when set: Bearer required on every route but /healthz
    # Host names it answers for besides loopback names and IP addresses (comma-separated;
    # "*": any). Anything else is a 421 (a DNS-rebinding page). common.origins
    ALLOWED_HOSTS: str = ""
    # Web origins allowed to call it from a browser (comma-separated, exact:
    # "https://app.example"); none by default: every other origin is refused (403).
    CORS_ORIGINS: str = ""
    # Seconds a new connection's request head may take to arrive; slower: closed.
    HEADER_TIMEOUT: float = setting(10.0, min=0.001)
    # Seconds a request body may take to arrive (plus 1 s per 64 KiB); slower: 408, closed.
    BODY_TIMEOUT: float = setting(30.0, min=0.001)
    # cache of the upstream's /v1/models (system prompt, floor); 0 = no cache
    MODELS_TTL: float = setting(30.0, min=0)

    # web search
    WEB_SEARCH: bool = True
    SEARXNG_URL: str = setting("http://host.docker.internal:8080", url=True)
    SEARXNG_RESULTS: int = setting(5, min=1)
    SEARXNG_TIMEOUT: float = setting(10.0, min=0.001)
    MAX_SEARCH_ITER: int = setting(10, min=0)
    SEARCH_SNIPPET_CHARS: int = setting(400, min=0)
    SEARCH_SOURCES: bool = True         # append a "Sources:" block to answers that used search
    # SSE comment while a search runs inside a stream
    KEEPALIVE_INTERVAL: float = setting(5.0, min=0.001)
    # with each comment of a stream still waiting for its first event, the dialect's
    # progress events, which agents' idle timers count (proxy/progress.py); 0: comments only
    WAIT_PROGRESS: bool = True

    # normalisation
    INJECT_SYSTEM: bool = True
    SYSTEM_PROMPT: str = ""
    TOOL_MAX_TOKENS_FLOOR: int = setting(1024, min=0)   # 0 = off

    LOG_LEVEL: str = setting("INFO", choices=LOG_LEVELS)

    def __post_init__(self):
        object.__setattr__(self, "BACKEND_URL", self.BACKEND_URL.rstrip("/"))
        object.__setattr__(self, "SEARXNG_URL", self.SEARXNG_URL.rstrip("/"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Raises common.config.ConfigError (a ValueError) naming a bad variable."""
        return config.load(cls, env, **overrides)
