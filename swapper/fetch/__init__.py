"""The downloader: what the models of backends/ need on disk (scripts/models.toml),
what is present, and fetching the rest: resumable, size- and sha256-verified,
HF_TOKEN for gated repos, a file at its final name always whole.

Product code of the swapper, run two ways: `./download-model.sh` runs
`python -m swapper.fetch` (__main__: the command line), and the swapper's
downloads on first use (swapper/download.py) call fetch_model. Its parts, each
importing only those before it:

- manifest: the manifest, FetchError, the downloader's settings and folders
- hub: the Hub over plain HTTP, download_file and its steps, failures in words
- status: what is on disk, verified
- hfcli: the Hugging Face CLI, for checkpoints (and files when HF_CLI is set)
- files: fetch_model, one download into MODELS_DIR at a time across processes
"""
from __future__ import annotations

import shutil  # noqa: F401  (tests patch shutil.disk_usage through this module)

from .files import fetch_model, planned_bytes
from .hub import download_file, remote_info, remote_size
from .manifest import MANIFEST, DownloadSpec, FetchError, FileSpec, human, load_manifest, \
    settings_of
from .status import FileStatus, source_text, status

__all__ = ["MANIFEST", "DownloadSpec", "FetchError", "FileSpec", "FileStatus", "download_file",
           "fetch_model", "human", "load_manifest", "planned_bytes", "remote_info",
           "remote_size", "settings_of", "source_text", "status"]
