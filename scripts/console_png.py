"""docs/console.png, made again: the console as an admin key sees it, Keys section
included, on the test bed's stack (tests/testbed/setup.sh).

A real swapper (Docker, the test bed's CPU llama-server and SmolLM2) with two of
the test registry's models, the real proxy with API_KEY and a key store (SQLite
in a temporary folder), three keys made through the admin API and a little usage
(four chat requests, two swaps); then Debian's headless Chromium, 1280 wide,
logged in with the admin key, shoots the whole page once every section has its
data.

    source tests/testbed/testbed.env && .venv/bin/python -m scripts.console_png [OUT]

OUT defaults to docs/console.png. The PNG is written as Chromium makes it, then
rewritten with a palette of at most 256 colours when that is smaller (a page of
text and flat colours has few: the file stays under ~150 KB).
"""
from __future__ import annotations

import argparse
import shutil
import struct
import sys
import tempfile
import zlib
from collections import Counter
from pathlib import Path

import requests
import yaml

from tests.support.proxyproc import ProxyProcess
from tests.support.swapperproc import FIXTURE_BACKENDS, SwapperProcess

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
API_KEY = "console-png-admin-key"
MODELS = ("tiny-a", "tiny-b")
WAIT_MS = 90_000


def backends(folder: Path) -> Path:
    """The test registry (its kinds, and MODELS of its models) in `folder`."""
    shutil.copytree(FIXTURE_BACKENDS / "kinds", folder / "kinds")
    (folder / "models").mkdir()
    every = yaml.safe_load((FIXTURE_BACKENDS / "models" / "test.yaml").read_text())
    some = {"models": {m: every["models"][m] for m in MODELS}}
    (folder / "models" / "console.yaml").write_text(yaml.safe_dump(some, sort_keys=False))
    return folder


def keys_and_usage(url: str) -> str:
    """Three keys and a few requests; the admin key's token."""
    admin = {"Authorization": f"Bearer {API_KEY}"}
    tokens = {}
    for body in ({"name": "ops", "role": "admin"},
                 {"name": "alice", "models": ["tiny-*"], "max_concurrent": 2, "weight": 2},
                 {"name": "ci", "models": ["tiny-b"], "rpm": 30, "tokens_per_day": 200000}):
        r = requests.post(url + "/admin/keys", headers=admin, json=body, timeout=10)
        r.raise_for_status()
        tokens[body["name"]] = r.json()["token"]
    for who, model, stream in (("alice", "tiny-a", True), ("alice", "tiny-a", False),
                               ("ci", "tiny-b", False), ("alice", "tiny-a", True)):
        r = requests.post(url + "/v1/chat/completions", timeout=WAIT_MS / 1000,
                          headers={"Authorization": f"Bearer {tokens[who]}"},
                          json={"model": model, "max_tokens": 24, "stream": stream,
                                "messages": [{"role": "user",
                                              "content": "Name three prime numbers."}]})
        r.raise_for_status()
    return tokens["ops"]


def shoot(url: str, token: str, out: Path) -> None:
    from playwright import sync_api
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url + "/ui")
        page.fill("#key", token)
        page.click("#key-save")
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'",
                               timeout=WAIT_MS)
        page.wait_for_function("() => document.querySelectorAll('#activity tbody tr').length >= 4"
                               " && document.querySelectorAll('#usage tbody tr').length >= 2"
                               " && /slot/.test(document.getElementById('log').textContent)"
                               " && S.samples.length >= 5", timeout=WAIT_MS)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


# ------------------------------------------------------------------ a palette PNG
# The standard library only: read Chromium's PNG (8-bit RGB or RGBA, not
# interlaced), keep its 256 most frequent colours, map every other to the nearest
# of them, write an indexed PNG.

def _chunks(data: bytes):
    pos = 8
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        yield kind, data[pos + 8:pos + 8 + n]
        pos += 12 + n


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the rows as RGB bytes."""
    idat = b""
    for kind, body in _chunks(data):
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or ctype not in (2, 6) or interlace:
                raise ValueError(f"not an 8-bit RGB(A) PNG: depth {depth}, type {ctype}")
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            for i in range(stride):
                line[i] = (line[i] + prev[i]) & 255
        elif f == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(
            v for i in range(0, stride, 4) for v in line[i:i + 3]))
    return w, h, rows


def palette_png(w: int, h: int, rows: list[bytes]) -> bytes:
    counts = Counter(row[i:i + 3] for row in rows for i in range(0, len(row), 3))
    palette = [c for c, _ in counts.most_common(256)]
    index = {c: i for i, c in enumerate(palette)}
    near: dict[bytes, int] = {}

    def nearest(c: bytes) -> int:
        got = index.get(c)
        if got is None:
            got = near.get(c)
            if got is None:
                got = near[c] = min(range(len(palette)), key=lambda i: sum(
                    (x - y) ** 2 for x, y in zip(c, palette[i])))
        return got

    raw = bytearray()
    for row in rows:
        raw.append(0)
        raw.extend(nearest(row[i:i + 3]) for i in range(0, len(row), 3))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0))
            + chunk(b"PLTE", b"".join(palette)) + chunk(b"IDAT", zlib.compress(bytes(raw), 9))
            + chunk(b"IEND", b""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, default=REPO / "docs" / "console.png")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="console-png-") as tmp:
        tmp = Path(tmp)
        with SwapperProcess(backends_dir=backends(tmp / "backends")) as sw, \
                ProxyProcess(BACKEND_URL=sw.url, WEB_SEARCH="0", API_KEY=API_KEY,
                             KEYS_DB=str(tmp / "keys.db")) as px:
            token = keys_and_usage(px.url)
            shot = tmp / "shot.png"
            shoot(px.url, token, shot)
            requests.post(sw.url + "/unload", timeout=WAIT_MS / 1000)
        data = shot.read_bytes()
        small = palette_png(*read_png(data))
        args.out.write_bytes(small if len(small) < len(data) else data)
    print(f"{args.out}: {args.out.stat().st_size:,} bytes (Chromium's: {len(data):,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
