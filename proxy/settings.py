"""Every environment variable the proxy reads, typed, with its default, in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields


def _bool(v: str) -> bool:
    return v.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Settings:
    # where requests go: the swapper, or a single llama-server / vLLM
    BACKEND_URL: str = "http://swapper:9000"
    PROXY_HOST: str = "0.0.0.0"
    PROXY_PORT: int = 11433
    PROXY_WORKERS: int = 1              # gunicorn gevent workers (metrics are per worker)
    CONNECT_TIMEOUT: float = 10.0       # upstream connect timeout; read timeout is unbounded
    MAX_BODY_BYTES: int = 64 * 1024 * 1024
    API_KEY: str = ""                   # when set: Bearer required on every route but /healthz
    DEFAULT_MODEL: str = ""             # filled into chat requests that name no model
    MAX_N: int = 8                      # largest `n` (choices per request) accepted
    MODELS_TTL: float = 30.0            # cache of the upstream's /v1/models (system prompt, floor)

    # web search
    WEB_SEARCH: bool = True
    SEARXNG_URL: str = "http://host.docker.internal:8080"
    SEARXNG_RESULTS: int = 5
    SEARXNG_TIMEOUT: float = 10.0
    MAX_SEARCH_ITER: int = 10
    SEARCH_SNIPPET_CHARS: int = 400
    SEARCH_SOURCES: bool = True         # append a "Sources:" block to answers that used search
    KEEPALIVE_INTERVAL: float = 5.0     # SSE comment while a search runs inside a stream

    # normalisation
    INJECT_SYSTEM: bool = True
    SYSTEM_PROMPT: str = ""
    TOOL_MAX_TOKENS_FLOOR: int = 1024   # 0 = off

    LOG_LEVEL: str = "INFO"

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            if f.name in overrides:
                values[f.name] = overrides[f.name]
                continue
            raw = env.get(f.name)
            if raw is None:
                continue
            typ = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float,
                                                            "bool": bool}[f.type]
            try:
                if typ is bool:
                    values[f.name] = _bool(raw)
                elif typ is int:
                    values[f.name] = int(raw)
                elif typ is float:
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                raise ValueError(f"environment variable {f.name}={raw!r} is not a valid {typ.__name__}")
        s = cls(**values)
        object.__setattr__(s, "BACKEND_URL", s.BACKEND_URL.rstrip("/"))
        object.__setattr__(s, "SEARXNG_URL", s.SEARXNG_URL.rstrip("/"))
        return s
