"""The Hugging Face CLI (`hf`, from huggingface_hub), for what plain HTTP does
not fetch: checkpoint folders and the Hub's cache (vLLM), and every file when
HF_CLI names one. Installed into a private venv only when needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .hub import hf_error, tail
from .manifest import HUB, DownloadSpec, FetchError, hf_home, human, models_dir, settings_of
from .status import FileStatus, checkpoint_status, folder_status, verify_file


def tools_venv(env: dict) -> Path:
    cfg = settings_of(env)
    base = cfg.XDG_CACHE_HOME or os.path.expanduser("~/.cache")
    return Path(cfg.CODING_STACK_TOOLS_VENV or Path(base) / "coding-stack" / "hf-venv")


def hf_cli(env: dict) -> tuple[list[str], str | None]:
    """(the `hf` command, a python that has huggingface_hub or None). HF_CLI overrides."""
    cfg = settings_of(env)
    if cfg.HF_CLI:
        return [cfg.HF_CLI], cfg.HF_PYTHON
    venv = tools_venv(env)
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
    token = settings_of(env).HF_TOKEN
    if token:
        e["HF_TOKEN"] = token
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


def fetch_hf_files_cli(m: DownloadSpec, missing: list[FileStatus], env: dict) -> None:
    folder = models_dir(env)
    hf, py = hf_cli(env)
    # One `hf download` per target folder (files of a model normally share one).
    groups: dict[Path, list[FileStatus]] = {}
    for st in missing:
        base = st.label[: len(st.label) - len(st.remote)]
        groups.setdefault(folder / base, []).append(st)
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
    folder = models_dir(env)
    hf, py = hf_cli(env)
    sizes = remote_sizes(py, m.repo, [], env)
    if sizes is not None:
        sizes = {k: v for k, v in sizes.items()
                 if any(fnmatch.fnmatch(k, pat) for pat in m.include or ["*"])}
    target = folder / m.dir_for(env)
    target.mkdir(parents=True, exist_ok=True)
    include = [a for pat in m.include for a in ("--include", pat)]
    run_hf(hf + ["download", m.repo, *include, "--local-dir", str(target)], m.repo, m.repo, env)
    st = folder_status(folder, m, env)
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
    cache = hf_home(env)
    repo = m.repo_for(env)
    hf, py = hf_cli(env)
    sizes = remote_sizes(py, repo, [], env)
    cache.mkdir(parents=True, exist_ok=True)
    run_hf(hf + ["download", repo], repo, repo, env, hf_home=cache)
    st = checkpoint_status(cache, m, env)
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
