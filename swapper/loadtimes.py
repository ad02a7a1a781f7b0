"""How long each model's loads took: the ETA of its next load.

A small bounded history per model (the last HISTORY successful load durations,
seconds from `loading` to `loaded`); the expected duration of the next load is
their median (one slow cold start, or one warm page-cache start, moves it
little). The scheduler keeps it (it owns loads) and tells it in the `loading`
status, the `load_started` / `progress` events and the waiting stream's
comments (`~N s left`).

Persisted when the swapper has a folder of its own on disk: KV_CACHE_DIR (the
only state the swapper keeps; compose mounts a volume there), as
`load-times.json`, rewritten atomically after each load. Without it, in memory
only (a restart starts without ETAs until each model has loaded once). A file
that cannot be read or written costs the history only, never a load.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import threading
from pathlib import Path

log = logging.getLogger("swapper.loadtimes")

HISTORY = 5                   # loads remembered per model
MAX_MODELS = 256              # models remembered (a registry is far smaller)
FILE_NAME = "load-times.json"


class LoadTimes:
    def __init__(self, path: str | Path | None = None, history: int = HISTORY):
        self.path = Path(path) if path else None
        self.history = history
        self._lock = threading.Lock()
        self._seconds: dict[str, list[float]] = {}
        if self.path is not None:
            self._read()

    @classmethod
    def for_settings(cls, settings) -> "LoadTimes":
        folder = getattr(settings, "KV_CACHE_DIR", None)
        return cls(Path(folder) / FILE_NAME if folder else None)

    def add(self, model: str, seconds: float) -> None:
        """A load of `model` succeeded after `seconds`."""
        if not model or not (seconds >= 0):
            return
        with self._lock:
            xs = self._seconds.pop(model, [])            # re-inserted: most recent last
            xs.append(round(float(seconds), 3))
            del xs[:-self.history]
            self._seconds[model] = xs
            while len(self._seconds) > MAX_MODELS:
                self._seconds.pop(next(iter(self._seconds)))
            snapshot = {m: list(v) for m, v in self._seconds.items()}
        self._write(snapshot)

    def expected(self, model: str | None) -> float | None:
        """The median of `model`'s remembered loads (None: never loaded)."""
        with self._lock:
            xs = self._seconds.get(model or "")
            return round(statistics.median(xs), 1) if xs else None

    def remaining(self, model: str | None, elapsed: float) -> float | None:
        """Seconds the running load of `model` is expected to take still (0 once
        past the median; None without history)."""
        exp = self.expected(model)
        return None if exp is None else round(max(0.0, exp - elapsed), 1)

    def of(self, model: str) -> list[float]:
        with self._lock:
            return list(self._seconds.get(model, []))

    # ------------------------------------------------------------ the file
    def _read(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("load times not read from %s (%s): starting without them",
                        self.path, e)
            return
        models = raw.get("models") if isinstance(raw, dict) else None
        if not isinstance(models, dict):
            return
        for model, xs in list(models.items())[-MAX_MODELS:]:
            if isinstance(model, str) and isinstance(xs, list):
                good = [float(x) for x in xs
                        if isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0]
                if good:
                    self._seconds[model] = good[-self.history:]

    def _write(self, snapshot: dict) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"models": snapshot}))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("load times not saved to %s: %s", self.path, e)
            try:
                tmp.unlink()
            except OSError:
                pass
