"""Load faster where the host allows: while one model serves and another's
requests wait (a hold, a quantum, a drain), read the waiting model's files into
the page cache, so its load reads memory instead of the disk.

A model's files are what its registry entry hands the backend: every argument
under a mounted folder (`-m /models/x.gguf`, `--mmproj ...`, a vLLM model
folder), read where this process sees that folder (the models folder and
HF_HOME as compose mounts them into the swapper; the host path itself when the
swapper runs on the host). Files the swapper cannot see are skipped.

Bounded: one model at a time, in one OS thread (never the event loop), in
chunks; it reads only while the host's *free* memory (not the page cache, which
holds the resident model's pages) stays above PREFETCH_RESERVE_GB plus what is
left to read of the file, so it never evicts the resident model's pages; it stops
at once when that model starts loading (its load reads the rest) or another
model is wanted. PREFETCH=0 turns it off.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("swapper.prefetch")

CHUNK = 16 << 20
MAX_FILES = 4096              # files of one model folder looked at


def free_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemFree of the host (None when unknown: then nothing is prefetched)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def model_files(spec, local_view: Callable[[str], str | None]) -> list[Path]:
    """The files the backend of `spec` reads from its mounted folders, as this
    process sees them (`local_view`: a volume's source -> a local folder)."""
    mounts = []
    for v in spec.volumes:
        source, _, rest = v.partition(":")
        target = rest.split(":")[0]
        local = local_view(source)
        if local and target.startswith("/"):
            mounts.append((target.rstrip("/") + "/", Path(local)))
    out: list[Path] = []
    for arg in spec.args:
        for target, local in mounts:
            if not arg.startswith(target):
                continue
            p = local / arg[len(target):]
            try:
                if p.is_file():
                    out.append(p)
                elif p.is_dir():
                    out.extend(sorted(q for q in p.rglob("*") if q.is_file())[:MAX_FILES])
            except OSError:
                pass
    return out


class Prefetcher:
    def __init__(self, files: Callable[[str], list[Path]], reserve_bytes: int,
                 enabled: bool = True, free: Callable[[], int | None] = free_bytes,
                 spawn: Callable | None = None):
        self._files = files
        self.reserve = reserve_bytes
        self.enabled = enabled
        self._free = free
        self._spawn = spawn or _os_thread
        self._lock = threading.Lock()
        self._want: str | None = None        # the model being read
        self.done: dict[str, int] = {}       # model -> bytes read by its last prefetch

    def want(self, model: str | None) -> None:
        """Read `model`'s files in the background (None: stop reading)."""
        if not self.enabled:
            return
        with self._lock:
            if model == self._want:
                return
            self._want = model
        if model is not None:
            self._spawn(self._run, model)

    def scheduler_event(self, event: str, fields: dict) -> None:
        """A scheduler listener: prefetch what waits while another model serves;
        stop when a load starts (it reads the files itself) or nothing waits."""
        if event == "holding":
            self.want(fields.get("waiting"))
        elif event == "queued" and fields.get("phase") == "ready":
            model = fields.get("model")
            if model and model != fields.get("resident"):
                self.want(model)
        elif event == "stop":
            self.want(fields.get("next_model"))
        elif event in ("load_started", "unloaded"):
            self.want(None)

    def _wanted(self, model: str) -> bool:
        with self._lock:
            return self._want == model

    def _run(self, model: str) -> None:
        total = 0
        try:
            for path in self._files(model):
                total += self._read(model, path)
                if not self._wanted(model):
                    break
        except Exception:  # noqa: BLE001 - a prefetch only ever costs itself
            log.exception("prefetch of %s failed", model)
        finally:
            self.done[model] = total
            with self._lock:
                if self._want == model:
                    self._want = None
            if total:
                log.info("prefetched %.1f MB of model %s into the page cache",
                         total / 1e6, model)

    def _read(self, model: str, path: Path) -> int:
        n = 0
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            left = os.fstat(fd).st_size
            while left > 0 and self._wanted(model):
                free = self._free()
                if free is None or free - min(left, CHUNK) < self.reserve:
                    log.info("prefetch of %s stopped: free memory %s near the reserve",
                             model, free)
                    return n
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    break
                n += len(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        return n


def local_view(settings) -> Callable[[str], str | None]:
    """A volume's source (as backends/ names it) -> where this process sees it:
    the models folder and HF_HOME where compose mounts them into the swapper
    (DOWNLOAD_MODELS_DIR, DOWNLOAD_HF_HOME), else the path itself when it exists
    here (a swapper on the host)."""
    views = {settings._host_path(settings.MODELS_DIR): settings.models_dir(),
             settings._host_path(settings.HF_HOME): settings.hf_home()}

    def view(source: str) -> str | None:
        if not source.startswith(("/", ".", "~")):
            return None                     # a named volume
        path = settings._host_path(source)
        local = views.get(path, path)
        return local if os.path.isdir(local) else None
    return view


def _os_thread(fn, *args) -> None:
    """fn(*args) in a thread of the OS (gevent's threadpool when the worker
    patched threading: file reads block whatever thread runs them)."""
    try:
        from gevent import monkey
        if monkey.is_module_patched("threading"):
            import gevent
            gevent.get_hub().threadpool.spawn(fn, *args)
            return
    except ImportError:
        pass
    threading.Thread(target=fn, args=args, name="prefetch", daemon=True).start()
