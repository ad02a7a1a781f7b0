"""The Hugging Face Hub over plain HTTP (the standard library only): what it
says of a file (size, ETag, commit), fetching one resumably into its final name
(download_file and its steps), and its failures in plain words."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .manifest import HUB, FetchError, human, settings_of


def tail(text: str, n: int = 6) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


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
        if settings_of(env).HF_TOKEN:
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


CHUNK = 1 << 20
HTTP_TIMEOUT = 30.0             # seconds without a byte: the connection is given up


def hub_endpoint(env: dict) -> str:
    """The Hub's address: HF_ENDPOINT (as huggingface_hub reads it), else huggingface.co."""
    return (settings_of(env).HF_ENDPOINT or HUB).rstrip("/")


def resolve_url(endpoint: str, repo: str, remote: str, revision: str = "main") -> str:
    from urllib.parse import quote
    return f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(remote)}"


def _request(url: str, env: dict, method: str = "GET", headers: dict | None = None,
             opener=None):
    import urllib.request
    req = urllib.request.Request(url, method=method, headers={
        "User-Agent": "coding-stack download-model", "Accept-Encoding": "identity",
        **(headers or {})})
    token = settings_of(env).HF_TOKEN
    if token:
        # Not sent on to where the Hub redirects (its CDN), as huggingface_hub does.
        req.add_unredirected_header("Authorization", f"Bearer {token}")
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
    pct = settings_of(env).DOWNLOAD_HEADROOM_PCT
    return int(shutil.disk_usage(folder).total * pct / 100)


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
    have = _resumable(part, meta_path, remote, size, what)
    if size is not None:
        _check_space(dest.parent, size - have, (part, meta_path), what, env)
    digest = _hashed(part, have) if sha256 else None
    if progress and have:
        progress(have)
    try:
        if size is None or have < size:
            meta_path.write_text(json.dumps({"commit": remote.commit, "etag": remote.etag,
                                             "size": size}, sort_keys=True))
            digest = _transfer(url, part, remote, have, digest, bool(sha256),
                               env, repo, what, progress)
        _verify(part, meta_path, size, digest, sha256, remote, what)
    except FetchError as e:
        if e.kind == "disk_full":
            _remove(part, meta_path)            # a full disk is not left full
        raise
    part.chmod(0o644)           # backends run as another user (BACKEND_USER)
    os.replace(part, dest)
    _remove(meta_path)


def _resumable(part: Path, meta_path: Path, remote: Remote, size: int | None,
               what: str) -> int:
    """The bytes of `part` a download builds on: all of them when `meta_path`
    says they are of the very file the Hub serves now; else none (the `.part`
    is dropped: of another version, or of an unknown one)."""
    have = part.stat().st_size if part.is_file() else 0
    if not have:
        return 0
    try:
        kept = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        kept = None
    same = isinstance(kept, dict) and kept.get("etag") == remote.etag \
        and kept.get("size") == size
    if same and remote.etag and (size is None or have <= size):
        return have
    print(f"  {what}: the partial file is of another version: fetching it whole", flush=True)
    _remove(part)
    return 0


def _check_space(folder: Path, needed: int, partial: tuple[Path, ...], what: str,
                 env: dict) -> None:
    """The disk of `folder` must hold `needed` more bytes and keep its headroom;
    else the partial files are removed and FetchError(disk_full) raised."""
    free = shutil.disk_usage(folder).free
    spare = headroom_bytes(folder, env)
    if free - spare < needed:
        _remove(*partial)
        raise FetchError(f"the disk is full: {what} needs {human(needed)} more and "
                         f"{human(spare)} must stay free (DOWNLOAD_HEADROOM_PCT), "
                         f"{folder} has {human(free)} free", "disk_full")


def _hashed(part: Path, have: int):
    """A sha256 of the `have` bytes of `part` a resume builds on."""
    digest = hashlib.sha256()
    if have:
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                digest.update(chunk)
                _pause()
    return digest


def _transfer(url: str, part: Path, remote: Remote, have: int, digest, hashing: bool,
              env: dict, repo: str, what: str, progress):
    """GET the file from byte `have` (0: whole), pinned to the remote's commit,
    onto `part`; a server that sends it whole restarts it. Returns the digest
    the bytes were added to (a new one on such a restart; None: not hashing)."""
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
                digest = hashlib.sha256() if hashing else None
            with open(part, "ab" if have else "wb") as out:
                _copy(r, out, digest, progress)
    except FetchError:
        raise
    except Exception as e:
        raise _http_failure(repo, what, e, env) from None
    return digest


def _copy(src, out, digest, progress) -> None:
    """`src`'s bytes onto `out`, chunk by chunk: hashed, told to `progress`."""
    while True:
        chunk = src.read(CHUNK)
        if not chunk:
            return
        out.write(chunk)
        if digest is not None:
            digest.update(chunk)
        if progress:
            progress(len(chunk))
        _pause()


def _verify(part: Path, meta_path: Path, size: int | None, digest, sha256: str | None,
            remote: Remote, what: str) -> None:
    """`part` is whole (its size) and the file asked for (its sha256); a wrong
    sha256 loses the `.part`."""
    got = part.stat().st_size
    if size is not None and got != size:
        raise FetchError(f"could not fetch {what} whole: {got} of {size} bytes arrived (the "
                         f"connection ended early); run it again to resume", "network")
    if digest is not None and digest.hexdigest() != sha256:
        _remove(part, meta_path)
        raise FetchError(f"{what}: its sha256 is not the one the "
                         f"{'manifest' if sha256 != remote.sha256 else 'Hub'} gives (the "
                         f"partial file was removed)", "failed")
