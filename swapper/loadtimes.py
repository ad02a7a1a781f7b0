"""How long each model's loads took: the ETA of its next load (`LoadTimes`),
the GPU's time lost to loads (`LoadCost`: the console's loads per hour), and
how long a failing model's next load waits (`Backoff`).

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

import collections
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

    def eta(self, model: str | None, elapsed: float) -> dict:
        """{expected_seconds, eta_seconds} of a load of `model` running `elapsed`
        seconds, from its past loads; {} without any."""
        eta = self.remaining(model, elapsed)
        return {} if eta is None else {"expected_seconds": self.expected(model),
                                       "eta_seconds": eta}

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


class LoadCost:
    """The GPU's time lost to loads, as the scheduler tells it (in memory):
    (when, seconds) of the last hour's loads, all seconds since start, and the
    last swap's seconds (a stop's start to the next model's ready)."""

    def __init__(self, clock):
        self._clock = clock
        self._loaded: collections.deque[tuple[float, float]] = collections.deque(maxlen=10000)
        self.seconds_total = 0.0
        self.last_swap_seconds: float | None = None
        self._stop: tuple[float, str] | None = None    # (when, model) of the last stop

    def stopping(self, since: float, model: str) -> None:
        """`model`, resident since `since`, is stopped: a swap if another model's
        load follows."""
        self._stop = (since, model)

    def no_swap(self) -> None:
        """No load follows the last stop (an unload), or a load failed."""
        self._stop = None

    def loaded(self, model: str, seconds: float) -> None:
        """A load of `model` took `seconds`."""
        self._loaded.append((self._clock(), seconds))
        self.seconds_total += seconds
        if self._stop is not None and self._stop[1] != model:
            self.last_swap_seconds = round(self._clock() - self._stop[0], 3)
        self._stop = None

    def status(self) -> dict:
        """Loads in the last hour and the seconds they took (the console's
        swaps per hour and seconds lost to loads), and all seconds since start."""
        hour_ago = self._clock() - 3600
        while self._loaded and self._loaded[0][0] < hour_ago:
            self._loaded.popleft()
        return {"loads_last_hour": len(self._loaded),
                "load_seconds_last_hour": round(sum(s for _, s in self._loaded), 1),
                "load_seconds_total": round(self.seconds_total, 1)}


class Backoff:
    """A model whose loads fail or whose backend crashes is loaded again after
    an exponential backoff: `base` seconds after its first failure, doubling
    with each failure, at most `most`; an answer it gives starts it afresh."""

    def __init__(self, base: float, most: float):
        self.base = base
        self.most = most
        self.failures: dict[str, int] = {}     # model -> failures since its last answer

    def failed(self, model: str) -> None:
        self.failures[model] = self.failures.get(model, 0) + 1

    def answered(self, model: str) -> None:
        self.failures.pop(model, None)

    def delay(self, model: str) -> float:
        """Seconds before `model`'s next load may start (0.0: it is not failing)."""
        failures = self.failures.get(model, 0)
        return 0.0 if not failures else min(self.base * 2 ** (failures - 1), self.most)
