"""Every environment variable the swapper reads, typed, with its default and its
help (read by common.config: a bad value stops the swapper at start, naming the
variable). Each setting is spelled as its variable, as in the proxy's; those the
proxy reads too are common.settings.Shared's, the downloader's (download-model.sh
and the downloads on first use) DownloadSettings', and what backends/
interpolates, beyond those, MODEL_VARIABLES."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from common import config
from common.config import PORT, Var, setting
from common.settings import Shared

_REPO_BACKENDS = Path(__file__).resolve().parent.parent / "backends"
_REPO_SCRIPTS = _REPO_BACKENDS.parent / "scripts"


@dataclass(frozen=True)
class DownloadSettings:
    """What the downloader (swapper.fetch) reads: download-model.sh, and the
    swapper's downloads on first use (whose Settings extend this)."""
    MODELS_DIR: str = setting(
        "./models", "GGUF files and model folders (`download-model.sh` puts them here); "
        "relative to the compose folder", group="models")
    HF_HOME: str = setting(
        "./hf-cache", "Hugging Face cache for vLLM checkpoints", group="models")
    HF_TOKEN: str | None = setting(
        None, "token for gated checkpoints (`download-model.sh`, downloads on first use, "
        "vLLM)", repr=False, group="models")
    HF_ENDPOINT: str | None = setting(
        None, "another Hub (a mirror) for downloads; empty: https://huggingface.co",
        url=True)
    DOWNLOAD_HEADROOM_PCT: float = setting(
        5.0, "percent of the disk a download must leave free (else `disk_full` before it "
        "writes; downloads run one at a time per disk, and a disk that fills anyway loses "
        "the partial file)", min=0, max=100)
    HF_CLI: str | None = setting(
        None, "the `hf` command to fetch checkpoints with (unset: huggingface_hub is "
        "installed into CODING_STACK_TOOLS_VENV on first need)", group="outside")
    HF_PYTHON: str | None = setting(
        None, "with HF_CLI: a python that has huggingface_hub, for the Hub's file sizes",
        group="outside")
    CODING_STACK_TOOLS_VENV: str | None = setting(
        None, "where `download-model.sh` installs the Hugging Face CLI",
        shown="$XDG_CACHE_HOME/coding-stack/hf-venv", group="outside")
    XDG_CACHE_HOME: str | None = setting(
        None, "the user's cache folder (the freedesktop variable)", shown="~/.cache",
        group="outside")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides):
        """Raises common.config.ConfigError naming a bad variable."""
        return config.load(cls, env, **overrides)


@dataclass(frozen=True)
class Settings(Shared, DownloadSettings):
    SWAPPER_HOST: str = setting("0.0.0.0", "the swapper's listen address", group="fixed")
    SWAPPER_PORT: int = setting(9000, "the swapper's listen port", **PORT, group="fixed")
    BACKENDS_DIR: str = setting(
        str(_REPO_BACKENDS), "the model registry", group="fixed",
        shown="./backends (in the image /app/backends)")
    DEFAULT_MODEL: str | None = setting(
        None, "model for requests that name none", shown="first model in the registry")
    STACK_NAME: str = setting(
        "coding-stack", "prefixes containers, labels, network, images; two stacks on one "
        "engine never touch")
    MAX_QUEUE: int = setting(
        64, "requests waiting in all; beyond: 503 + `Retry-After`", min=1)
    # The swap policy (swapper/scheduler.py; docs/swapping.md). hold: an agent session's next request within its hold goes
    # before other models' waiting requests (HOLD_FIRST_SECONDS after its first
    # request, then twice its longest recent gap + 1 s, at most HOLD_SECONDS),
    # for at most a quantum of
    # QUANTUM_FACTOR x the waiting model's expected load time, clamped to
    # [QUANTUM_MIN_SECONDS, QUANTUM_MAX_SECONDS]. fifo: swap as soon as the
    # resident model is drained (no holds).
    SWAP_POLICY: str = setting(
        "hold", "`hold`: an agent session's next turn keeps its model, within the quantum; "
        "`fifo`: swap as soon as the resident model is drained (see "
        "[swapping.md](swapping.md))", choices=("hold", "fifo"))
    HOLD_SECONDS: float = setting(
        10.0, "how long after its request a session's next request goes first, at most (a "
        "session's hold is twice its longest recent gap + 1 s)", min=0)
    HOLD_FIRST_SECONDS: float = setting(
        3.0, "the hold after a session's first request (before it has shown it comes "
        "back)", min=0)
    QUANTUM_FACTOR: float = setting(
        3.0, "a model is held while another waits at most this × the waiting model's "
        "expected load time", min=0)
    QUANTUM_MIN_SECONDS: float = setting(5.0, "the quantum's floor", min=0)
    QUANTUM_MAX_SECONDS: float = setting(
        300.0, "the quantum's cap (it bounds anyone's wait)", min=0)
    # Tenants (swapper/tenants.py; docs/fairness.md): the proxy names a request's
    # tenant and weight on the internal hop; each load's seconds are charged to
    # the tenants whose waiting requests caused it, in an account that decays.
    FAIR_HALF_LIFE_SECONDS: float = setting(
        900.0, "tenants' charged load seconds halve in this many seconds (the window fair "
        "shares between models are measured over)", min=1)
    FAIR_SLACK: float = setting(
        0.1, "a tenant whose charged load seconds exceed its weighted share by more than "
        "this fraction waits for the next stint instead of forcing a swap", min=0, max=10)
    METRICS_TENANTS: int = setting(
        16, "tenants named in the swapper's metrics (the first seen); later ones are "
        "counted as `other`", min=1, max=1000)
    PREFETCH: bool = setting(
        True, "while one model serves and another's requests wait, read the waiting "
        "model's files into the page cache (its load then reads memory; "
        "swapper/prefetch.py)")
    PREFETCH_RESERVE_GB: float = setting(
        4.0, "prefetch only while the host's free memory stays above this (so the resident "
        "model's cached pages are never evicted)", min=0)
    BACKEND_PUBLISH_PORT: int = setting(
        18080, "host port the resident backend is published on for direct access", **PORT)
    BACKEND_BIND: str = setting(
        "127.0.0.1", "host address the resident backend is published on")
    BACKEND_API_KEY: str | None = setting(
        None, "the backends' own key (llama-server / vLLM `--api-key`), added by the "
        "swapper to all it sends them; set it to use the published port directly "
        "(`Authorization: Bearer …`, benchmark.sh --direct); empty: a random secret per "
        "swapper run, or the one of the backend it adopts (the port then answers only "
        "the swapper)", repr=False)
    DOCKER_NETWORK: str | None = setting(
        None, "set: backends are reached by container name; unset: through the published "
        "port on `BACKEND_HOST`", group="fixed", shown="the stack's network")
    BACKEND_HOST: str = setting(
        "127.0.0.1", "outside Docker (no `DOCKER_NETWORK`): where the swapper reaches the "
        "published backend")
    HOST_DIR: str = setting(
        str(_REPO_BACKENDS.parent), "host folder that relative volume paths of `backends/` "
        "resolve against (the Docker daemon needs host paths); unset, the swapper reads it "
        "from its own container (as compose resolved it)", shown="the compose folder")
    HEALTH_INTERVAL: float = setting(
        0.01, "seconds between health polls while a backend starts (for its first 3 s; "
        "every 0.05 s after that, or this if longer)", min=0.001)
    WATCH_INTERVAL: float = setting(
        1.0, "seconds between checks of the resident model: idle TTL, leftover containers, "
        "and crashes while Docker's event stream is down (otherwise a crash is noticed "
        "from Docker's events at once)", min=0.01)
    CRASH_BACKOFF: float = setting(
        2.0, "seconds before restarting a model that keeps dying (doubling)", min=0)
    CRASH_BACKOFF_MAX: float = setting(60.0, "the most CRASH_BACKOFF doubles to", min=0)
    PULL_IMAGES: bool = setting(
        True, "pull a missing image on first use, with progress in the log (0: fail with a "
        "clear error instead)")
    LOG_TAIL: int = setting(40, "backend log lines quoted in a failed load's error", min=0)
    MAX_N: int = setting(8, "largest `n` (completions) per request", min=1)
    PREFILL_PROGRESS: bool = setting(
        True, "a streamed request to a llama.cpp model asks llama-server for its prompt "
        "progress (`return_progress`), relayed as SSE comments in words (`: processing the "
        "prompt: 4,096 of 18,112 tokens (22 %), ~41 s left`; swapper/progress.py); a "
        "client that asks for it itself gets llama-server's chunks. `0`: requests go as "
        "the client sent them")
    PRELOAD: str | None = setting(
        None, "a model (id or alias) loaded when the swapper starts")
    IDLE_MODEL: str | None = setting(
        None, "a model swapped back in when the resident model's `idle_ttl` ends (itself "
        "never unloaded by its TTL)")
    # llama.cpp prompt caches saved when a backend stops, restored when it is next
    # loaded (swapper/kvcache.py, docs/kv-cache.md).
    KV_CACHE_DIR: str | None = setting(
        None, "the swapper's folder for saved llama.cpp prompt caches (see "
        "[kv-cache.md](kv-cache.md))",
        group="fixed", shown="compose: /kvcache; empty: no cache")
    KV_CACHE_VOLUME: str | None = setting(
        None, "what backends mount for KV_CACHE_DIR: a host path, `./` under HOST_DIR, or a "
        "named Docker volume", group="fixed",
        shown="compose: the stack's kvcache volume; empty: KV_CACHE_DIR")
    KV_CACHE_MAX_GB: float = setting(
        20.0, "the saved prompt caches' total size on disk; the least recently used go "
        "first", min=0)
    KV_CACHE_SAVE_TIMEOUT: float = setting(
        30.0, "seconds a stop may spend saving prompt caches (all slots); past it the rest "
        "is skipped; 0: never save", min=0)
    KV_CACHE_RESTORE_TIMEOUT: float = setting(
        30.0, "seconds a load may spend restoring prompt caches (all slots); past it the "
        "rest is skipped; 0: never restore", min=0)
    KV_CACHE_CONVERSATIONS: int = setting(
        8, "conversations per model whose prompt caches a swap keeps (one-slot llama.cpp "
        "backends): saved before a stop, restored into llama-server's RAM prompt cache at "
        "the next load; the newest first, as many as llama-server's `--cache-ram` holds; "
        "`1`: only the slot's last", min=1, max=256)
    # Downloads on first use (swapper/download.py): a model whose files are missing
    # is fetched when first asked for, by download-model.sh's code (swapper.fetch)
    # from the files of scripts/models.toml.
    AUTO_DOWNLOAD: bool = setting(
        True, "download a model's missing files on first use (resumable, size-verified; "
        "streamed requests see progress, `/v1/models` shows `downloading`); `0`: a 409 "
        "naming `./download-model.sh <model>`")
    MODELS_MANIFEST: str = setting(
        str(_REPO_SCRIPTS / "models.toml"), "what the downloads read: each model's files",
        group="fixed", shown="the repository's scripts/models.toml (in the image "
        "/app/scripts)")
    DOWNLOAD_MODELS_DIR: str | None = setting(
        None, "where the swapper itself sees MODELS_DIR, which it downloads into",
        group="fixed", shown="compose: /models; outside Docker: MODELS_DIR under HOST_DIR")
    DOWNLOAD_HF_HOME: str | None = setting(
        None, "where the swapper itself sees HF_HOME", group="fixed",
        shown="HF_HOME under HOST_DIR")
    BACKEND_USER: str = setting(
        "65534:65534", "uid:gid llama.cpp backends run as (the kind's `user`; least "
        "privilege; model files must be readable by it); the swapper keeps its group",
        group="models")
    SWAPPER_USER: str = setting(
        "", "the user the swapper drops to after learning the Docker socket's group "
        "(the image sets `swapper`; empty: it stays who it is)", group="outside")
    DOCKER_HOST: str | None = setting(
        None, "the Docker engine (the Docker SDK's own variable)",
        shown="/var/run/docker.sock", group="outside")
    # The whole environment: backends/ interpolates ${VAR:-default} from it.
    env: Mapping[str, str] = setting({}, read=False, repr=False)

    def models_dir(self) -> str:
        """MODELS_DIR as this process sees it (where downloads are written)."""
        return self.DOWNLOAD_MODELS_DIR or self._host_path(self.MODELS_DIR)

    def hf_home(self) -> str:
        return self.DOWNLOAD_HF_HOME or self._host_path(self.HF_HOME)

    def _host_path(self, value: str) -> str:
        p = Path(os.path.expanduser(value))
        return str(p if p.is_absolute() else (Path(self.HOST_DIR) / p).resolve())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Raises common.config.ConfigError naming a bad variable."""
        e = dict(os.environ if env is None else env)
        return config.load(cls, e, env=e, **overrides)


# What backends/ interpolates beyond the settings above (MODELS_DIR, HF_HOME,
# HF_TOKEN, BACKEND_USER, STACK_NAME): the swapper hands them to the registry
# as they are (`Settings.env`), so they are declared here for the docs only.
MODEL_VARIABLES = tuple(Var(name, default, help, "models") for name, default, help in (
    ("GPU0", "0", "host GPU id (nvidia-smi order) the models use as their first GPU"),
    ("GPU1", "1", "host GPU id the models use as their second GPU"),
    ("LLAMACPP_CPU_IMAGE", "ghcr.io/ggml-org/llama.cpp:server-b12191", "CPU llama.cpp image"),
    ("LLAMACPP_CUDA_IMAGE", "ghcr.io/ggml-org/llama.cpp:server-cuda-b12191",
     "CUDA llama.cpp image"),
    ("VLLM_IMAGE", "vllm/vllm-openai:v0.27.0", "vLLM image"),
    ("VLLM_CPU_IMAGE", "coding-stack-testbed/vllm:cpu",
     "a CPU vLLM image (`smollm2-vllm`; the test bed builds this one)"),
    ("CPU_THREADS", "2", "threads of the CPU llama.cpp model"),
    ("QWEN27_GGUF", "Qwen3.8-27B-GGUF/Qwen3.8-27B-Q6_K.gguf",
     "file of `qwen-38-27b` under `MODELS_DIR` (download-model.sh fetches what these name)"),
    ("QWEN27_MMPROJ", "Qwen3.8-27B-GGUF/mmproj-F16.gguf", "its vision projector"),
    ("QWEN35_GGUF", "Qwen3.8-35B-A3B-GGUF/Qwen3.8-35B-A3B-Q6_K.gguf", "file of `qwen-35b`"),
    ("QWEN122_GGUF", "Qwen3.8-122B-A10B-GGUF/Q4_K_M/Qwen3.8-122B-A10B-Q4_K_M-00001-of-00002.gguf",
     "first shard of `qwen-122b`"),
    ("QWEN27_TENSOR_SPLIT", "1,1", "how `qwen-38-27b`'s layers split over GPU0,GPU1"),
    ("QWEN35_TENSOR_SPLIT", "1,1", "how `qwen-35b`'s layers split over GPU0,GPU1"),
    ("QWEN122_TENSOR_SPLIT", "1,1", "how `qwen-122b`'s layers split over GPU0,GPU1"),
    ("QWEN122_N_CPU_MOE", "28",
     "MoE expert layers of `qwen-122b` kept in host RAM (more: less VRAM, slower)"),
    ("MTP_DRAFT_MAX", "2", "tokens drafted per step by MTP speculative decoding"),
    ("FOUNDATION_REPO", "shawnw3i/Huihui-Qwen3.8-27B-abliterated-AWQ-MTP",
     "checkpoint of `foundation`"),
    ("FOUNDATION_MAX_MODEL_LEN", "253952", "its context (lower it on a GPU under 40 GB)"),
    ("SMOLLM2_GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf", "file of `smollm2`"),
    ("SMOLLM2_HF_DIR", "smollm2-135m-hf", "safetensors folder of `smollm2-vllm` under "
     "`MODELS_DIR`"),
    ("VLLM_CPU_KVCACHE_SPACE", "1", "GiB of RAM for `smollm2-vllm`'s KV cache"),
))
