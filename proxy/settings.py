"""Every environment variable the proxy reads, typed, with its default and its
help, in one place (read by common.config: a bad value stops the proxy at start,
naming the variable). Those the swapper reads too are common.settings.Shared's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from common import config
from common.config import PORT, setting
from common.settings import Shared

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Settings(Shared):
    BACKEND_URL: str = setting(
        "http://swapper:9000", "the proxy's upstream: the swapper, or a single llama-server "
        "/ vLLM", url=True, group="fixed")
    PROXY_HOST: str = setting(
        "0.0.0.0", "the proxy's listen address (outside Docker `PROXY_PORT` is its listen "
        "port)", group="fixed")
    PROXY_PORT: int = setting(
        11433, "host port the endpoint is published on; in its container the proxy always "
        "listens on 11433 (outside Docker: its listen port)", **PORT, group="compose")
    PROXY_WORKERS: int = setting(
        1, "gunicorn gevent workers; above 1, metrics are merged over all workers "
        "(`PROMETHEUS_MULTIPROC_DIR`, a temporary folder unless set)", min=1, max=64)
    MAX_BODY_BYTES: int = setting(
        64 * 1024 * 1024, "larger request bodies get 413 (chunked ones too)", min=1)
    API_KEY: str = setting(
        "", "set: `Authorization: Bearer <key>` (or `x-api-key`) on every route but "
        "`/healthz` and the console's page and assets, else 401 (checked before the body "
        "is read)", repr=False)
    KEYS_DB: str = setting(
        "", "the key store's SQLite file (docs/keys.md), made on first start with mode 0600; "
        "compose sets `/data/keys.db` on the proxy's volume. With no key in it the door is "
        "as without it (open, or `API_KEY`'s). Empty, and no `KEYS_DATABASE_URL`: keys off",
        group="fixed")
    KEYS_DATABASE_URL: str = setting(
        "", "a PostgreSQL URL (`postgresql://user:pass@host/db`) for the key store instead "
        "of `KEYS_DB`: several proxies that share keys and their limits (docs/keys.md)",
        repr=False)
    AUTH_FAILURES_PER_MINUTE: int = setting(
        30, "with a key store: failed key checks an address may make in a minute; then it "
        "gets 429 with `Retry-After` (its key not checked) until the oldest is a minute old",
        min=1)
    CORS_ORIGINS: str = setting(
        "", "web origins allowed to call the proxy from a browser, exact and "
        "comma-separated (`https://app.example`); they get `Access-Control-Allow-Origin` "
        "(never credentials) and their preflights are answered by the proxy. Empty: every "
        "other origin is refused (403)")
    HEADER_TIMEOUT: float = setting(
        10.0, "seconds a new connection's request line and headers may take to arrive from "
        "its accept; slower, or nothing sent, and the connection is closed without an "
        "answer (slow or silent clients cannot hold the server's connections). A served "
        "connection waits 75 s (gunicorn's keep-alive) for its next request", min=0.001)
    BODY_TIMEOUT: float = setting(
        30.0, "seconds a request body may take to arrive, plus 1 s per 64 KiB received; "
        "slower is a 408 and the connection is closed (trickling clients cannot hold the "
        "server's connections)", min=0.001)
    MODELS_TTL: float = setting(
        30.0, "seconds the upstream's `/v1/models` is cached (per-model system prompt and "
        "token floor); 0: no cache", min=0)

    # web search
    WEB_SEARCH: bool = setting(True, "inject and run the `web_search` tool")
    SEARXNG_URL: str = setting(
        "http://host.docker.internal:8080", "SearXNG base URL (the bundled one, "
        "`--profile searxng`: `http://searxng:8080`)", url=True)
    SEARXNG_RESULTS: int = setting(5, "results per search query", min=1)
    SEARXNG_TIMEOUT: float = setting(
        10.0, "seconds a whole query may take (connect, headers and body)", min=0.001)
    MAX_SEARCH_ITER: int = setting(
        10, "search rounds per request; then one last call without the tool", min=0)
    SEARCH_SNIPPET_CHARS: int = setting(400, "snippet length cap", min=0)
    SEARCH_SOURCES: bool = setting(
        True, "append a `Sources:` block to answers that used search")
    WAIT_PROGRESS: bool = setting(
        True, "with each comment of a stream still waiting for its first event (queue, "
        "hold, download, load, prefill), the dialect's progress events, which agents' idle "
        "timers count (see [Agents that wait](agents.md#agents-that-wait)); `0`: comments "
        "only (proxy/progress.py)")

    # normalisation
    INJECT_SYSTEM: bool = setting(
        True, "prepend a system prompt when the conversation does not start with a "
        "system/developer message")
    SYSTEM_PROMPT: str = setting(
        "", "its text when the model's registry entry has no `system_prompt`")
    TOOL_MAX_TOKENS_FLOOR: int = setting(
        1024, "when the request carries tools of its own (the injected `web_search` does "
        "not count), a smaller `max_tokens` / `max_completion_tokens` is raised to this "
        "(or the model's `max_tokens_floor`); a request without tools of its own and a "
        "smaller budget gets no `web_search`; `0`: off", min=0)

    LOG_LEVEL: str = setting("INFO", "log level", choices=LOG_LEVELS)

    def __post_init__(self):
        object.__setattr__(self, "BACKEND_URL", self.BACKEND_URL.rstrip("/"))
        object.__setattr__(self, "SEARXNG_URL", self.SEARXNG_URL.rstrip("/"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Raises common.config.ConfigError (a ValueError) naming a bad variable."""
        return config.load(cls, env, **overrides)
