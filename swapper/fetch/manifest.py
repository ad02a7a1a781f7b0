"""The download manifest (scripts/models.toml: each model's files and where they
come from), the downloader's error, and where its folders are: the downloader's
settings (swapper.settings.DownloadSettings) read by the one loader."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python < 3.11
    import tomli as tomllib          # type: ignore[no-redef]

from common import config

from ..settings import DownloadSettings

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "scripts" / "models.toml"
HUB = "https://huggingface.co"


def settings_of(env: dict) -> DownloadSettings:
    """The downloader's settings in `env` (the variables as strings), read by the
    one loader: download-model.sh and the swapper check them at their start
    (a bad value stops them there), so here they parse."""
    return config.load(DownloadSettings, env)


class FetchError(RuntimeError):
    """A model could not be fetched; the message says why in plain words. `kind`
    names the cause for callers that act on it (the swapper's downloads on first
    use): unauthorized | not_found | network | disk_full | failed."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------- manifest

@dataclass
class FileSpec:
    local: str                  # default path under MODELS_DIR
    remote: str                 # path inside the HF repo / the wheel
    var: str | None = None
    size: int | None = None
    sha256: str | None = None
    approx_gb: float | None = None

    def effective(self, env: dict) -> tuple[str, str, bool]:
        """(local, remote, overridden): the ${var} of backends/ wins over the default."""
        value = env.get(self.var) if self.var else None
        if not value or value == self.local:
            return self.local, self.remote, False
        base = self.local[: len(self.local) - len(self.remote)]
        if not self.local.endswith(self.remote) or not value.startswith(base):
            raise FetchError(f"{self.var}={value} is not under {base or 'MODELS_DIR/'}: "
                             f"download-model.sh can only fetch files of the default folder; "
                             f"put that file into MODELS_DIR yourself")
        return value, value[len(base):], True


@dataclass
class DownloadSpec:
    """One model of the download manifest (scripts/models.toml): where its files
    come from. Not the registry's swapper.registry.ModelSpec."""
    id: str
    source: str
    description: str = ""
    repo: str | None = None
    package: str | None = None
    var: str | None = None
    approx_gb: float | None = None
    files: list[FileSpec] = field(default_factory=list)
    dir: str | None = None          # hf-dir: the folder under MODELS_DIR (overridable by var)
    include: list[str] = field(default_factory=list)   # hf-dir: which files of the repo

    def dir_for(self, env: dict) -> str:
        """hf-dir models: the folder under MODELS_DIR, overridable like backends/ does."""
        return (env.get(self.var) if self.var else None) or self.dir

    def repo_for(self, env: dict) -> str:
        """hf-cache models: the checkpoint, overridable like backends/ does."""
        return (env.get(self.var) if self.var else None) or self.repo


def load_manifest(path: Path = MANIFEST) -> dict[str, DownloadSpec]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    models = {}
    for model_id, raw in data.items():
        files = [FileSpec(**f) for f in raw.get("files", [])]
        rest = {k: v for k, v in raw.items() if k != "files"}
        spec = DownloadSpec(id=model_id, files=files, **rest)
        if spec.source not in ("pypi", "hf", "hf-cache", "hf-dir"):
            raise ValueError(f"{path}: model {model_id}: unknown source {spec.source!r}")
        models[model_id] = spec
    return models



def host_dir(value: str) -> Path:
    """Relative paths resolve against the repo folder, like the swapper's HOST_DIR."""
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (REPO / p).resolve()


def models_dir(env: dict) -> Path:
    """MODELS_DIR, where GGUF files and model folders go."""
    return host_dir(settings_of(env).MODELS_DIR)


def hf_home(env: dict) -> Path:
    """HF_HOME, the Hugging Face cache vLLM checkpoints go into."""
    return host_dir(settings_of(env).HF_HOME)


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


