"""A model's status as /v1/models, /models and /events show it (swapper/routes.py):
the shape llama.cpp's router and llama-swap use, {"value": "loaded" | "loading" |
"unloading" | "unloaded" | "failed"}, with the last failure's message while it is
the latest word; ours besides: "downloading" with the download's progress, and a
load's elapsed seconds and ETA (swapper/loadtimes.py).

The scheduler (swapper/scheduler.py) keeps one `Statuses` under its lock, tells
it how each load and download ended (`latest`) and asks it with its own model
and phase (`of`).
"""
from __future__ import annotations

from .downloadqueue import DownloadQueue
from .loadtimes import LoadTimes
from .tickets import LOADING, READY, STOPPING, LoadFailed

# The value of the scheduler's phase for its model (loading, ready, stopping: it
# has none while idle); any other model's: below.
VALUES = {LOADING: "loading", READY: "loaded", STOPPING: "unloading"}


class Statuses:
    def __init__(self, downloads: DownloadQueue, load_times: LoadTimes):
        self._downloads = downloads
        self._load_times = load_times
        self._failures: dict[str, str] = {}     # model -> why its last load or download failed

    def latest(self, model: str, error: LoadFailed | None) -> None:
        """How `model`'s load or download ended: `error`, or well (None)."""
        if error is not None:
            self._failures[model] = str(error)
        else:
            self._failures.pop(model, None)

    def of(self, model: str, resident: str | None, phase: str, elapsed: float) -> dict:
        """`model`'s status; `resident`, `phase`: the scheduler's model and its
        phase, begun `elapsed` seconds ago."""
        download = self._downloads.running.get(model)
        if download is not None:
            return {"value": "downloading", **{k: v for k, v in download.items()
                                               if k != "model"}}
        if model == resident:
            value = VALUES[phase]
        else:
            value = "failed" if model in self._failures else "unloaded"
        out = {"value": value}
        if value == "loading":
            out.update(elapsed_seconds=round(elapsed, 1), **self._load_times.eta(model, elapsed))
        if model in self._failures:
            out["failure"] = self._failures[model]
        return out
