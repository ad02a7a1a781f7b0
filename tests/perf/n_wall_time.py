"""Wall time of one request with n=4 against 4 sequential requests (n=1), on
the real CPU model through the swapper, for each way `n` is served:

    python -m tests.perf.n_wall_time [--runs 5] [--tokens 32]

  tiny-b     1 slot   -> fanned out, one generation at a time
  tiny-a     2 slots  -> fanned out, two at a time
  tiny-wide  8 slots  -> native (llama-server shares the prompt across slots)
Runs alternate between the two shapes; medians are printed. Asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import requests

from tests.support.swapperproc import SwapperProcess


def once(url, model, n, tokens):
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "n": n, "max_tokens": tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}]})
    r.raise_for_status()
    assert len(r.json()["choices"]) == n
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    rows = []
    with SwapperProcess() as sw:
        for model, how in (("tiny-b", "fan-out, 1 slot"), ("tiny-a", "fan-out, 2 slots"),
                           ("tiny-wide", "native, 8 slots")):
            requests.post(sw.url + "/load/" + model, timeout=300).raise_for_status()
            once(sw.url, model, 1, a.tokens)                      # warm-up
            n4, seq = [], []
            for _ in range(a.runs):
                n4.append(once(sw.url, model, 4, a.tokens))
                seq.append(sum(once(sw.url, model, 1, a.tokens) for _ in range(4)))
            rows.append((model, how, statistics.median(n4), statistics.median(seq)))
    print(f"{'model':10} {'path':18} {'n=4 (s)':>9} {'4 x n=1 (s)':>12} {'ratio':>6}")
    for model, how, n4, seq in rows:
        print(f"{model:10} {how:18} {n4:9.3f} {seq:12.3f} {n4 / seq:6.2f}")


if __name__ == "__main__":
    main()
