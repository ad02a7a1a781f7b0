"""A load with the model's files cold and warm in the page cache: what the
swapper's prefetch (swapper/prefetch.py) buys a load.

    tests/perf/run.sh prefetch [--repeats 5]

The real swapper and the real CPU llama-server (thrash_backends' `rx`: the test
bed's SmolLM2 GGUF). Each repeat, paired: the model file is evicted from the
page cache (posix_fadvise DONTNEED on the host) and `/load/rx` timed; then the
file is read the way the prefetcher reads it and `/load/rx` timed again. Prints
the medians of both and of their difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import requests

from swapper.prefetch import Prefetcher
from tests.perf.thrash import BACKENDS, PERF_DIR
from tests.support.swapperproc import SwapperProcess, load_testbed_env


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_load(url: str) -> float:
    t = time.monotonic()
    requests.post(url + "/load/rx", timeout=300).raise_for_status()
    seconds = time.monotonic() - t
    requests.post(url + "/unload", timeout=120).raise_for_status()
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    env = load_testbed_env()
    model = Path(env["TESTBED_MODELS_DIR"]) / env["TESTBED_MODEL_FILE"]
    reader = Prefetcher(lambda m: [model], reserve_bytes=0, spawn=lambda fn, *x: fn(*x))
    cold, warm = [], []
    with SwapperProcess(backends_dir=BACKENDS, PERF_DIR=str(PERF_DIR), LOG_LEVEL="WARNING",
                        PREFETCH="0") as sw:
        timed_load(sw.url)                      # the image and the binary: warm for both
        for _ in range(a.repeats):
            evict(model)
            cold.append(timed_load(sw.url))
            evict(model)
            reader.want("rx")
            warm.append(timed_load(sw.url))
    diff = [c - w for c, w in zip(cold, warm)]
    mb = model.stat().st_size / 1e6
    print(f"| model file | repeats | load, cold page cache | load, prefetched | cold - warm |\n"
          f"|---|---|---|---|---|\n"
          f"| {model.name} ({mb:.0f} MB) | {a.repeats} | {statistics.median(cold):.2f} s | "
          f"{statistics.median(warm):.2f} s | {statistics.median(diff):+.2f} s |")
    print(f"cold {[round(x, 2) for x in cold]} warm {[round(x, 2) for x in warm]}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
