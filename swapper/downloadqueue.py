"""The downloads on first use as the scheduler sees them (swapper/download.py
performs them): which models miss files, the downloads running (model -> its
progress, what /running and a model's status show), and the jobs the
downloader thread has still to start.

A request for a model whose download runs is *parked*: it waits in the
scheduler's queue but takes no part in the policy (no swap, no stop of the
resident model), so other models are served during the download; when it ends
the scheduler lets those requests line up like any others (or fails them).

The state is guarded by the scheduler's lock (`cv`, shared): the scheduler calls
`parks`, `wanted`, `asked`, `start`, `end` and `status` with it held; the
downloader's side (`mark_missing`, `next_job`, `progress`) takes it. A
download's events (`download_started`, `download_progress`, `downloaded`,
`download_failed`) are told from here.
"""
from __future__ import annotations

import threading
from typing import Callable

from .tickets import LoadFailed

# A download's `waiting_for` when another process holds MODELS_DIR (swapper.fetch's
# models_dir_lock): ./download-model.sh run by hand, or a second swapper.
OTHER_PROCESS = "another process"


class DownloadQueue:
    def __init__(self, cv: threading.Condition, clock: Callable[[], float],
                 emit: Callable[..., None], resident: Callable[[], str | None]):
        self._cv = cv
        self._clock = clock
        self._emit = emit
        self._resident = resident               # the model loading, ready or stopping now
        self.missing: set[str] = set()          # models whose files the downloader found absent
        self.running: dict[str, dict] = {}      # model -> progress of its download
        self._jobs: list[str] = []              # downloads for the downloader to start
        self._started: dict[str, float] = {}

    # ------------------------------------------------- the scheduler's side
    def parks(self, model: str | None) -> bool:
        """Does a request for `model` wait for its download?"""
        return model is not None and model in self.running

    def wanted(self, model: str | None) -> bool:
        """Is `model` missing files, with no download running?"""
        return model is not None and model in self.missing and model not in self.running

    def asked(self, model: str | None) -> None:
        """A request for `model` came (or its load found its files gone): its
        download starts when it is wanted."""
        if self.wanted(model):
            self.start(model)

    def start(self, model: str) -> None:
        self._started[model] = self._clock()
        self.running[model] = {"model": model, "done_bytes": 0,
                               "total_bytes": None, "bytes_per_second": None,
                               "eta_seconds": None, "waiting_for": None}
        self._jobs.append(model)
        self._emit("download_started", model=model)
        self._cv.notify_all()

    def end(self, model: str, error: LoadFailed | None = None) -> None:
        """The download of `model` ended: its files are there now, or `error`
        (a LoadFailed) says why not."""
        d = self.running.pop(model, None)
        if d is None:
            return
        seconds = round(self._clock() - self._started.pop(model, self._clock()), 3)
        if error is not None:
            self._emit("download_failed", model=model, error=str(error), cause=error.kind,
                       seconds=seconds)
        else:
            self.missing.discard(model)
            self._emit("downloaded", model=model, seconds=seconds,
                       total_bytes=d.get("total_bytes"))

    def status(self) -> dict[str, dict]:
        return {m: dict(d) for m, d in self.running.items()}

    # ------------------------------------------------ the downloader's side
    def mark_missing(self, models) -> None:
        """The downloader found these models' files absent: the next request for
        one downloads it first (the model resident now is left alone)."""
        with self._cv:
            resident = self._resident()
            for m in models:
                if m != resident:
                    self.missing.add(m)

    def next_job(self, timeout: float | None = None) -> str | None:
        """The downloader's next model to fetch, waiting up to `timeout`."""
        with self._cv:
            if not self._jobs:
                self._cv.wait_for(lambda: bool(self._jobs), timeout)
            return self._jobs.pop(0) if self._jobs else None

    def progress(self, model: str, done: int, total: int | None,
                 rate: float | None = None, eta: float | None = None,
                 waiting_for: str | None = None) -> None:
        """A download's bytes so far, or (`waiting_for`) the model whose download
        on the same disk it waits for."""
        with self._cv:
            d = self.running.get(model)
            if d is None:
                return
            d.update(done_bytes=done, total_bytes=total,
                     bytes_per_second=None if rate is None else round(rate),
                     eta_seconds=None if eta is None else round(eta, 1),
                     waiting_for=waiting_for)
            self._emit("download_progress", **d)
