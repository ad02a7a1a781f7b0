"""llama.cpp prompt caches across swaps: each slot that holds a prompt is saved
before its backend stops, and restored when that model is next healthy, before
its queue is admitted (the driver calls `save` and `restore`; docs/kv-cache.md).

llama-server does the writing and the reading (`--slot-save-path DIR`, `POST
/slots/{id}?action=save|restore {"filename"}`); this module owns the folder:

- one folder per model under KV_CACHE_DIR, mounted into the backend at
  /kvcache/<model>/ (`backend_mount`, used by the runtime's create);
- a save goes to a temporary name (`tmp-slot<N>-<hex>.bin`); only once the call
  returned 200 and the file holds every byte llama-server says it wrote is it
  renamed to `slot<N>.bin`, its sha256 and what it is tied to in the sidecar
  `slot<N>.json` (written after it, atomically). A backend killed mid-save leaves
  a temporary file only, swept before the next restore;
- a file is restored only when its sidecar matches the backend now running
  (the image and its id, llama.cpp's build, the model file as llama-server
  reports it, the KV-shaping flags: -m, -c, -ctk, -ctv, -np, -fa...), and its
  size and sha256 are those saved: this llama-server ABORTS on a truncated file,
  so nothing unchecked is ever handed to it. A mismatch, a corrupt file or a
  restore the backend refuses discards the file;
- the total is capped (KV_CACHE_MAX_GB): least recently used files go first;
- what a restore bought is read off the first answer after it (`answered`: the
  backend's `timings.cache_n` / `prompt_n`, else its usage's cached tokens), once
  per restore: swapper_kv_cache_first_answer_tokens and a `reused` event.

Nothing here may fail a stop or a load: every failure costs only the cache, is
logged with its reason and counted (swapper_kv_cache_failures). Each direction
is bounded in time (KV_CACHE_SAVE_TIMEOUT, KV_CACHE_RESTORE_TIMEOUT): past it the
remaining slots are skipped (a save in progress is abandoned: the backend is
killed and its temporary file never used).
"""
from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

log = logging.getLogger("swapper.kvcache")

CONTAINER_ROOT = "/kvcache"      # where backends see the cache folder
CONNECT_SECONDS = 2.0
HASH_CHUNK = 8 << 20             # bytes hashed between two yields (gevent: the hub runs)
ANSWER_TAIL = 16 << 10           # bytes of the first answer after a restore read for its counts

# Launch flags that shape the KV cache (or the file's meaning): a file saved
# under other values is discarded. Short and long spellings of llama-server.
KV_FLAGS = {
    "-m": "model", "--model": "model",
    "-c": "ctx", "--ctx-size": "ctx",
    "-ctk": "cache_k", "--cache-type-k": "cache_k",
    "-ctv": "cache_v", "--cache-type-v": "cache_v",
    "-np": "parallel", "--parallel": "parallel",
    "-fa": "flash_attn", "--flash-attn": "flash_attn",
    "--override-kv": "override_kv",
    "--kv-unified-per-slot": "per_slot",
    "--rope-scaling": "rope", "--rope-freq-base": "rope_base", "--yarn-orig-ctx": "yarn",
}
KV_SWITCHES = {"--swa-full", "-kvu", "--kv-unified", "--no-kv-unified", "--no-kv-offload"}


def enabled(settings, spec) -> bool:
    return bool(settings.KV_CACHE_DIR) and spec.kind == "llamacpp" and spec.kv_cache


def backend_mount(settings, spec) -> tuple[str, tuple[str, ...]] | None:
    """(volume, extra args) a backend of `spec` is created with, its folder made
    (writable by the backend's user); None when the cache is off for it or its
    folder cannot be made (then it runs without: said once in the log)."""
    if not enabled(settings, spec):
        return None
    folder = Path(settings.KV_CACHE_DIR) / spec.id
    try:
        folder.mkdir(parents=True, exist_ok=True)
        share_with_backend(folder, spec.user)
    except OSError as e:
        log.warning("model %s: no prompt cache across swaps: cannot make %s (%s)",
                    spec.id, folder, e)
        return None
    source = settings.KV_CACHE_VOLUME or settings.KV_CACHE_DIR
    inside = f"{CONTAINER_ROOT}/{spec.id}"
    if "/" in source or source.startswith((".", "~")):     # a path: this model's folder only
        volume = f"{source.rstrip('/')}/{spec.id}:{inside}"
    else:                                                  # a named volume: all of it
        volume = f"{source}:{CONTAINER_ROOT}"
    return volume, ("--slot-save-path", inside + "/")


def backend_ids(user: str | None) -> tuple[int | None, int | None]:
    """(uid, gid) of a registry `user:` ("uid", "uid:gid", or names known to this
    host); None where it cannot be told (no user: the image's, root for ours)."""
    if not user:
        return None, None
    name, _, group = str(user).partition(":")
    uid = gid = None
    try:
        uid = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
        if not group and not name.isdigit():
            gid = pwd.getpwnam(name).pw_gid
    except KeyError:
        pass
    if group:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            pass
    # "uid" alone: Docker gives it the image's group for that uid, else 0: unknown here
    return uid, gid


def share_with_backend(folder: Path, user: str | None) -> None:
    """Make a model's folder writable by its backend and nobody else: the
    backend's group, group-writable, set-group-id (what it writes keeps that
    group), never world-writable (a local user could plant a FIFO or a link
    there). The swapper must be root or a member of that group (its privileges
    drop adds BACKEND_USER's group); it says so when it is not."""
    uid, gid = backend_ids(user)
    mode = 0o700
    if gid is None and uid is not None and os.geteuid() == 0:
        os.chown(folder, uid, -1)           # its group unknown: the backend's own folder
    elif gid is not None and gid != os.getegid():
        try:
            os.chown(folder, -1, gid)
            mode = 0o2770
        except PermissionError:
            log.warning("cannot give %s to the backend's group %s (the swapper, uid %d, is not "
                        "in it): the backend cannot write its prompt cache there", folder, gid,
                        os.geteuid())
    elif gid is not None:
        mode = 0o2770
    os.chmod(folder, mode)


def kv_flags(spec) -> dict:
    """The KV-shaping launch flags of a model (args and LLAMA_ARG_* variables)."""
    out: dict = {}
    args = list(spec.args)
    for i, a in enumerate(args):
        if a in KV_FLAGS and i + 1 < len(args):
            key = KV_FLAGS[a]
            if key == "override_kv":
                out.setdefault(key, []).append(args[i + 1])
            else:
                out[key] = args[i + 1]
        elif a in KV_SWITCHES:
            out[a.lstrip("-")] = True
    for k, v in sorted(spec.env.items()):
        if k.startswith("LLAMA_ARG_"):
            out[k] = v
    return out


@dataclass
class Outcome:
    """What one save or restore did: for the event, the metrics and the tests."""
    slots: list[int] = field(default_factory=list)
    bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)    # reasons
    died: bool = False           # the backend stopped answering during a restore

    def fields(self) -> dict:
        out = {"slots": self.slots, "bytes": self.bytes, "tokens": self.tokens,
               "seconds": round(self.seconds, 3)}
        if self.failures:
            out["failures"] = self.failures
        return out


class _Skip(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class KvCache:
    def __init__(self, settings, metrics, emit: Callable[..., None] | None = None,
                 image_id: Callable[[str], str | None] | None = None,
                 clock=time.monotonic, wall=time.time, pause=time.sleep):
        self.settings = settings
        self.metrics = metrics
        self._emit = emit or (lambda event, **fields: None)
        self._image_id = image_id
        self._clock = clock
        self._wall = wall
        self._pause = pause                      # time.sleep(0): a gevent yield
        self._http = requests.Session()
        self._http.trust_env = False
        # model -> tokens restored, until the first answer after that restore
        self._awaiting: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        return Path(self.settings.KV_CACHE_DIR or ".")

    def enabled(self, spec) -> bool:
        return enabled(self.settings, spec)

    def folder(self, model: str) -> Path:
        return self.root / model

    # ------------------------------------------------------------ identity
    def fingerprint(self, spec, backend, timeout: float) -> dict:
        """What a saved file is tied to, as the running backend tells it."""
        props = self._get(backend, "/props", timeout)
        models = self._get(backend, "/v1/models", timeout)
        meta = {}
        data = models.get("data") or [{}]
        for k in ("n_params", "size", "n_vocab", "n_embd", "n_ctx_train", "n_ctx"):
            if k in (data[0].get("meta") or {}):
                meta[k] = data[0]["meta"][k]
        image_id = None
        if self._image_id is not None:
            try:
                image_id = self._image_id(spec.image)
            except Exception:            # the engine may be down: the tag still counts
                image_id = None
        return {"image": spec.image, "image_id": image_id, "build": props.get("build_info"),
                "model_path": props.get("model_path"), "total_slots": props.get("total_slots"),
                "meta": meta, "flags": kv_flags(spec)}

    def _get(self, backend, path: str, timeout: float) -> dict:
        r = self._http.get(backend.url + path, timeout=(CONNECT_SECONDS, max(timeout, 0.1)),
                           headers=_auth(backend))
        if r.status_code != 200:
            raise _Skip("refused", f"GET {path}: HTTP {r.status_code}")
        return r.json()

    # ---------------------------------------------------------------- save
    def save(self, spec, backend) -> Outcome:
        """Save every slot of the running `backend` that holds a prompt (the
        backend still answers: before its stop). Never raises."""
        out = Outcome()
        budget = self.settings.KV_CACHE_SAVE_TIMEOUT
        if not self.enabled(spec) or budget <= 0:
            return out
        with self._lock:
            self._awaiting.pop(spec.id, None)    # its restore had no answer: none counts
        t0 = self._clock()
        deadline = t0 + budget
        folder = self.folder(spec.id)
        self._emit("saving", model=spec.id, done=False)
        try:
            fp = self.fingerprint(spec, backend, budget)
            slots = self._get(backend, "/slots", deadline - self._clock())
        except Exception as e:
            self._fail(out, "save", spec.id, _reason(e), f"cannot read its slots: {e}")
            slots, fp = [], None
        slots = slots if isinstance(slots, list) else []
        # This build lists n_prompt_tokens for a slot once it served a request: one
        # that never did holds nothing. A build that does not say: try them all (an
        # empty slot saves 0 tokens, and that file is dropped).
        told = any("n_prompt_tokens" in s for s in slots if isinstance(s, dict))
        for slot in slots:
            sid = slot.get("id") if isinstance(slot, dict) else None
            if not isinstance(sid, int) or slot.get("is_processing"):
                continue
            if told and not slot.get("n_prompt_tokens"):
                continue
            left = deadline - self._clock()
            if left <= 0:
                self._fail(out, "save", spec.id, "timeout",
                           f"slot {sid} not saved: KV_CACHE_SAVE_TIMEOUT ({budget:g} s) spent")
                continue
            try:
                self._save_slot(spec, backend, folder, sid, fp, left, out)
            except Exception as e:
                self._fail(out, "save", spec.id, _reason(e), f"slot {sid} not saved: {e}")
        return self._ended(spec, "saved", "saving", out, t0, tidy=self.evict)

    def _save_slot(self, spec, backend, folder: Path, sid: int, fp: dict, left: float,
                   out: Outcome) -> None:
        tmp = folder / f"tmp-slot{sid}-{secrets.token_hex(4)}.bin"
        try:
            r = self._http.post(f"{backend.url}/slots/{sid}", params={"action": "save"},
                                json={"filename": tmp.name}, headers=_auth(backend),
                                timeout=(CONNECT_SECONDS, left))
            if r.status_code != 200:
                raise _Skip("refused", f"HTTP {r.status_code}: {r.text[:200]}")
            body = r.json()
            saved, written = int(body.get("n_saved", 0)), int(body.get("n_written", -1))
            if saved <= 0:
                return                                   # an empty slot: nothing to keep
            size = written
            digest = self._sha256(tmp, written, self._clock() + left, missing="disk",
                                  short="incomplete")
            final, sidecar = folder / f"slot{sid}.bin", folder / f"slot{sid}.json"
            sidecar.unlink(missing_ok=True)      # an old sidecar never describes the new file
            os.replace(tmp, final)
            now = self._wall()
            _write_json(sidecar, {"slot": sid, "bytes": size, "tokens": saved,
                                  "sha256": digest, "fingerprint": fp,
                                  "saved": now, "used": now})
            out.slots.append(sid)
            out.bytes += size
            out.tokens += saved
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    # -------------------------------------------------------------- restore
    def restore(self, spec, backend) -> Outcome:
        """Restore the model's saved slots into the freshly healthy `backend`
        (nothing admitted yet). Never raises; `died` when the backend stopped
        answering meanwhile (its files are discarded)."""
        out = Outcome()
        budget = self.settings.KV_CACHE_RESTORE_TIMEOUT
        if not self.enabled(spec) or budget <= 0:
            return out
        folder = self.folder(spec.id)
        self._sweep(folder)
        entries = self._entries(folder)
        if not entries:
            return out
        t0 = self._clock()
        deadline = t0 + budget
        self._emit("restoring", model=spec.id, done=False)
        try:
            fp = self.fingerprint(spec, backend, budget)
        except Exception as e:
            self._fail(out, "restore", spec.id, _reason(e), f"cannot identify the backend: {e}")
            fp = None
            out.died = isinstance(e, requests.ConnectionError)
        for sidecar, meta in entries if fp is not None else []:
            sid = meta.get("slot") if isinstance(meta, dict) else None
            final = folder / f"slot{sid}.bin"
            left = deadline - self._clock()
            try:
                if left <= 0:
                    raise _Skip("timeout", f"KV_CACHE_RESTORE_TIMEOUT ({budget:g} s) spent")
                self._check(meta, final, fp, deadline)
                r = self._http.post(f"{backend.url}/slots/{sid}", params={"action": "restore"},
                                    json={"filename": final.name}, headers=_auth(backend),
                                    timeout=(CONNECT_SECONDS, left))
                if r.status_code != 200:
                    raise _Skip("refused", f"HTTP {r.status_code}: {r.text[:200]}")
                body = r.json()
                meta["used"] = self._wall()
                _write_json(sidecar, meta)
                out.slots.append(sid)
                out.bytes += int(body.get("n_read", meta.get("bytes", 0)))
                out.tokens += int(body.get("n_restored", 0))
            except requests.ConnectionError as e:
                self._discard(sidecar, final)
                self._fail(out, "restore", spec.id, "crashed",
                           f"slot {sid}: the backend stopped answering on its restore ({e}); "
                           "its file is discarded")
                out.died = True
                break
            except Exception as e:
                reason = _reason(e)
                if reason != "timeout":
                    self._discard(sidecar, final)
                self._fail(out, "restore", spec.id, reason, f"slot {sid} not restored: {e}")
        if out.slots and not out.died:
            with self._lock:
                self._awaiting[spec.id] = out.tokens
        return self._ended(spec, "restored", "restoring", out, t0, tidy=self._disk)

    # ------------------------------------------- what the restore bought
    def awaits_answer(self, model: str) -> bool:
        """Was `model` restored and has no answer been read since? (The
        forwarder then keeps the tail of the next answer for `answered`.)"""
        return model in self._awaiting

    def answered(self, model: str, tail: bytes) -> tuple[int, int] | None:
        """The first complete answer after a restore of `model` (its last
        bytes): the prompt tokens the backend reused and processed, counted
        once per restore (a later answer, or one without the counts, counts
        nothing). Returns (reused, processed) when it counted."""
        counts = prompt_counts(tail)
        if counts is None:
            return None
        with self._lock:
            restored = self._awaiting.pop(model, None)
        if restored is None:
            return None
        reused, processed = counts
        self.metrics.kv_first_answer(model, reused, processed)
        log.info("model %s: the first answer after its restore (%d tokens) reused %d prompt "
                 "tokens and processed %d", model, restored, reused, processed)
        self._emit("reused", model=model, restored=restored, reused=reused,
                   processed=processed)
        return counts

    def _ended(self, spec, direction: str, event: str, out: "Outcome", t0: float,
               tidy: Callable[[], object]) -> "Outcome":
        """A save or restore done: its seconds, metrics and log line, then `tidy`
        (the cap's eviction, the disk gauge), then its event."""
        out.seconds = self._clock() - t0
        if out.slots:
            self.metrics.kv_done(spec.id, direction, out.bytes, out.tokens, out.seconds)
            log.info("model %s: %s slot(s) %s (%d tokens, %.1f MB) in %.2f s", spec.id,
                     direction, out.slots, out.tokens, out.bytes / 1e6, out.seconds)
        tidy()
        self._emit(event, model=spec.id, done=True, **out.fields())
        return out

    def _check(self, meta: dict, final: Path, fp: dict, deadline: float) -> None:
        if meta.get("fingerprint") != fp:
            theirs = meta.get("fingerprint") or {}
            diff = sorted(k for k in set(fp) | set(theirs) if fp.get(k) != theirs.get(k))
            raise _Skip("mismatch", f"saved for another backend (differs in {', '.join(diff)})")
        size = meta.get("bytes")
        if not isinstance(size, int) or size <= 0:
            raise _Skip("corrupt", f"its sidecar gives no size ({size!r})")
        if self._sha256(final, size, deadline) != meta.get("sha256"):
            raise _Skip("corrupt", f"{final.name} is not the file saved (sha256 differs)")

    # ---------------------------------------------------------------- files
    def _entries(self, folder: Path) -> list[tuple[Path, dict]]:
        """(sidecar, what it says) of every saved slot: regular files only, read
        without following a link or waiting on a FIFO (_read_regular)."""
        out = []
        for name in sorted(_names(folder)):
            m = _SIDECAR.fullmatch(name)
            if m is None:
                continue
            sidecar = folder / name
            try:
                meta = json.loads(_read_regular(sidecar, SIDECAR_MAX))
                if not isinstance(meta, dict) or meta.get("slot") != int(m.group(1)):
                    raise ValueError("not a sidecar of that slot")
            except (OSError, ValueError, _Skip) as e:
                log.warning("discarding %s: %s", sidecar, e)
                self.metrics.kv_failed("restore", "corrupt")
                self._discard(sidecar, sidecar.with_suffix(".bin"))
                continue
            out.append((sidecar, meta))
        return out

    def _sweep(self, folder: Path) -> None:
        """Before a restore (one backend at a time: none writes now): remove
        everything that is not a saved slot (slot<N>.bin, slot<N>.json, regular
        files): temporary files of saves that never completed, links, FIFOs,
        and files of any other name."""
        for name in _names(folder):
            path = folder / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                log.warning("prompt cache: %s is a folder, not a saved slot (left alone; not "
                            "the swapper's)", path)
                continue
            ours = stat.S_ISREG(st.st_mode) and (_SIDECAR.fullmatch(name) or _BIN.fullmatch(name))
            if not ours:
                if not name.startswith("tmp-"):
                    log.warning("prompt cache: removing %s (not a saved slot)", path)
                self._discard(path)

    def _discard(self, *paths: Path) -> None:
        for p in paths:
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                log.warning("cannot remove %s: %s", p, e)

    def usage(self) -> list[tuple[float, int, Path, Path]]:
        """(last used, bytes, sidecar, file) of every file of every model's
        folder: a saved slot counts its file and its sidecar; any other file (a
        temporary one, a file without its sidecar, one of another name) counts
        as last used never, so it goes first. Nothing is followed or read but
        regular sidecars."""
        out = []
        for model in _names(self.root):
            folder = self.root / model
            try:
                if not stat.S_ISDIR(folder.lstat().st_mode):
                    continue
            except OSError:
                continue
            sizes: dict[str, int] = {}
            for name in _names(folder):
                try:
                    st = (folder / name).lstat()
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    sizes[name] = st.st_size if stat.S_ISREG(st.st_mode) else 0
            for name, size in sizes.items():
                m = _BIN.fullmatch(name)
                sidecar_name = f"slot{m.group(1)}.json" if m else None
                if _SIDECAR.fullmatch(name) and name[:-5] + ".bin" in sizes:
                    continue                    # counted with its file
                final = folder / name
                used = 0.0
                sidecar = final
                if sidecar_name in sizes:
                    sidecar = folder / sidecar_name
                    size += sizes[sidecar_name]
                    try:
                        used = float(json.loads(_read_regular(sidecar, SIDECAR_MAX)).get("used", 0))
                    except (OSError, ValueError, AttributeError, TypeError, _Skip):
                        used = 0.0
                out.append((used, size, sidecar, final))
        return sorted(out, key=lambda e: (e[0], str(e[3])))

    def evict(self) -> int:
        """Remove the least recently used files until the total fits
        KV_CACHE_MAX_GB. Returns the bytes left on disk."""
        entries = self.usage()
        total = sum(e[1] for e in entries)
        cap = self.settings.KV_CACHE_MAX_GB * 1e9
        for used, size, sidecar, final in entries:
            if total <= cap:
                break
            log.info("prompt cache over KV_CACHE_MAX_GB (%g): evicting %s (%.1f MB)",
                     self.settings.KV_CACHE_MAX_GB, final, size / 1e6)
            self._discard(sidecar, final)
            total -= size
        self.metrics.kv_disk(total)
        return total

    def _disk(self) -> None:
        try:
            self.metrics.kv_disk(sum(e[1] for e in self.usage()))
        except OSError:
            pass

    def _sha256(self, path: Path, size: int, deadline: float, missing: str = "corrupt",
                short: str = "corrupt") -> str:
        """The sha256 of the regular file `path`, which must hold `size` bytes
        (only those are read: a file that grows never holds the hash up), by
        `deadline` (else _Skip timeout). In a thread of the OS when gevent runs:
        a file read blocks the whole hub, and hashlib lets the GIL go."""
        return _offload(_hash_file, path, size, deadline, self._clock, missing, short)

    def _fail(self, out: Outcome, direction: str, model: str, reason: str, detail: str) -> None:
        log.warning("model %s: prompt cache %s: %s (%s); the %s goes on", model,
                    "save" if direction == "save" else "restore", detail, reason,
                    "stop" if direction == "save" else "load")
        out.failures.append(reason)
        self.metrics.kv_failed(direction, reason)


SIDECAR_MAX = 1 << 20           # bytes: a sidecar is a few hundred
_SIDECAR = re.compile(r"slot(\d+)\.json")
_BIN = re.compile(r"slot(\d+)\.bin")
# Regular files only: never follow a link, never wait for a FIFO's writer (an open
# for reading blocks until one comes; under gevent, the whole swapper with it).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _open_regular(path: Path, missing: str = "corrupt") -> tuple[int, int]:
    """(fd, size) of `path` if it is a regular file, opened without following a
    link or blocking; else _Skip (`missing` when it is absent)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise _Skip(missing, f"{path.name} is missing") from None
    except OSError as e:
        raise _Skip("corrupt", f"{path.name} cannot be opened as a file: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Skip("corrupt", f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_regular(path: Path, limit: int) -> bytes:
    fd, size = _open_regular(path)
    try:
        if size > limit:
            raise _Skip("corrupt", f"{path.name} holds {size} bytes (at most {limit})")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def _hash_file(path: Path, size: int, deadline: float, clock, missing: str, short: str) -> str:
    fd, have = _open_regular(path, missing)
    try:
        if have != size:
            raise _Skip(short, f"{path.name} has {have} bytes, {size} saved")
        h = hashlib.sha256()
        left = size
        while left > 0:
            if clock() > deadline:
                raise _Skip("timeout", f"hashing {path.name} ran past its deadline")
            chunk = os.read(fd, min(HASH_CHUNK, left))
            if not chunk:
                raise _Skip(short, f"{path.name} ended {left} bytes early")
            h.update(chunk)
            left -= len(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _offload(fn, *args):
    """fn(*args) in a thread of the OS when gevent patched threading (the
    swapper's worker), else here."""
    try:
        from gevent import monkey
        patched = monkey.is_module_patched("threading")
    except ImportError:
        patched = False
    if not patched:
        return fn(*args)
    import gevent

    def run():
        try:
            return fn(*args), None
        except Exception as e:          # raised here, not logged by the pool's thread
            return None, e
    result, error = gevent.get_hub().threadpool.apply(run)
    if error is not None:
        raise error
    return result


def _auth(backend) -> dict:
    """The backend's key (swapper.runtime.Backend.key), when it has one."""
    key = getattr(backend, "key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _reason(e: Exception) -> str:
    if isinstance(e, _Skip):
        return e.reason
    if isinstance(e, requests.Timeout):
        return "timeout"
    if isinstance(e, requests.ConnectionError):
        return "unreachable"
    if isinstance(e, OSError):
        return "disk"
    return "refused"


_TIMINGS = re.compile(rb'"cache_n"\s*:\s*(\d+)|"prompt_n"\s*:\s*(\d+)')
_USAGE = re.compile(rb'"(prompt_tokens|input_tokens|cached_tokens|cache_read_input_tokens)"'
                    rb'\s*:\s*(\d+)')


def prompt_counts(tail: bytes) -> tuple[int, int] | None:
    """(reused, processed) prompt tokens from the end of a llama-server answer,
    streamed or not: its `timings` (cache_n, prompt_n; the last ones given),
    else its usage (OpenAI: prompt_tokens with cached_tokens among them;
    Anthropic: input_tokens beside cache_read_input_tokens). None: neither."""
    cache_n = prompt_n = None
    for m in _TIMINGS.finditer(tail):
        if m.group(1) is not None:
            cache_n = int(m.group(1))
        else:
            prompt_n = int(m.group(2))
    if cache_n is not None and prompt_n is not None:
        return cache_n, prompt_n
    usage = {m.group(1).decode(): int(m.group(2)) for m in _USAGE.finditer(tail)}
    if "cache_read_input_tokens" in usage and "input_tokens" in usage:
        return usage["cache_read_input_tokens"], usage["input_tokens"]
    if "cached_tokens" in usage:
        total = usage.get("prompt_tokens", usage.get("input_tokens"))
        if total is not None:
            return usage["cached_tokens"], max(total - usage["cached_tokens"], 0)
    return None


def _write_json(path: Path, data: dict) -> None:
    """Atomically: a temporary file renamed into place."""
    tmp = path.with_name(f"tmp-{path.name}-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)
