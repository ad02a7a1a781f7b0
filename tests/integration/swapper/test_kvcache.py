"""Prompt caches across swaps with the real swapper, the real Docker engine and
the real llama-server (test bed image, SmolLM2): a few hundred tokens of prompt
on tiny-a, a swap to tiny-b, back to tiny-a: the same prompt's answer shows the
restored prefix reused (`timings.cache_n`), where a swapper without the cache
reprocesses all of it; a truncated or corrupted file is never handed to the
backend (this llama-server aborts on a truncated one) and the answer still comes."""
import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import threading
import time

import pytest
import requests

from tests.support.swapperproc import SwapperProcess, stack_containers

PROMPT = "Remember this list of facts. " + " ".join(
    f"Fact {i}: the {w} of item {i} is {i * 7 % 13}." for i, w in
    enumerate(["colour", "weight", "size", "price", "origin", "age"] * 8))


def ask(sw, model, content=PROMPT):
    r = requests.post(sw.url + "/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text[:500]
    return r.json()


@pytest.fixture(scope="module")
def kv_swapper(docker_client, tmp_path_factory):
    root = tmp_path_factory.mktemp("kvcache")
    with SwapperProcess(KV_CACHE_DIR=str(root)) as sw:
        sw.kv_root = root
        yield sw
    assert stack_containers(docker_client, sw.stack) == [], "a backend container leaked"


def metric(sw, name, **labels):
    text = requests.get(sw.url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def round_trip(sw, tamper=None, content=PROMPT):
    """tiny-a answers `content`, tiny-b one request, tiny-a `content` again: its timings."""
    first = ask(sw, "tiny-a", content)["timings"]
    ask(sw, "tiny-b", "Hi.")                 # the swap: tiny-a's slots saved before its stop
    if tamper is not None:
        tamper(sw.kv_root / "tiny-a")
    t0 = time.monotonic()
    again = ask(sw, "tiny-a", content)       # the swap back: restored before admission
    return first, again["timings"], time.monotonic() - t0


def test_the_prefix_survives_a_swap(kv_swapper):
    first, again, _ = round_trip(kv_swapper)
    assert first["prompt_n"] > 300
    saved = json.loads(next((kv_swapper.kv_root / "tiny-a").glob("slot*.json")).read_text())
    assert saved["tokens"] >= first["prompt_n"]
    assert saved["fingerprint"]["flags"]["ctx"] == "2048"
    # all of the prompt but the last token or so comes from the restored slot
    assert again["cache_n"] >= first["prompt_n"] - 8, again
    assert again["prompt_n"] <= 8
    assert metric(kv_swapper, "swapper_kv_cache_bytes_total", model="tiny-a",
                  direction="restored") > 0
    assert metric(kv_swapper, "swapper_kv_cache_bytes_total", model="tiny-a",
                  direction="saved") > 0


def truncate(folder):
    for p in folder.glob("slot*.bin"):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def corrupt(folder):
    for p in folder.glob("slot*.bin"):
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0x5A
        p.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper", [truncate, corrupt])
def test_a_damaged_file_is_not_restored_and_the_answer_still_comes(kv_swapper, tamper):
    before = metric(kv_swapper, "swapper_kv_cache_failures_total", direction="restore",
                    reason="corrupt")
    first, again, _ = round_trip(kv_swapper, tamper, f"{tamper.__name__}: {PROMPT}")
    assert first["prompt_n"] > 300
    assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8
    assert metric(kv_swapper, "swapper_kv_cache_failures_total", direction="restore",
                  reason="corrupt") > before
    assert not list((kv_swapper.kv_root / "tiny-a").glob("tmp-*"))


def test_without_the_cache_the_swap_back_reprocesses_everything(docker_client):
    with SwapperProcess() as sw:
        first = ask(sw, "tiny-a")["timings"]
        ask(sw, "tiny-b", "Hi.")
        again = ask(sw, "tiny-a")["timings"]
        requests.post(sw.url + "/unload", timeout=120)
    assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8


def test_stopping_the_swapper_saves_the_resident_backends_cache(docker_client, tmp_path):
    """`docker compose down` (SIGTERM to the swapper): the resident llama.cpp
    backend's slots are saved before it is removed, and restored by the next
    swapper that loads the model."""
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        first = ask(sw, "tiny-a")["timings"]
    assert stack_containers(docker_client, sw.stack) == []
    (sidecar,) = (tmp_path / "tiny-a").glob("slot*.json")
    assert json.loads(sidecar.read_text())["tokens"] >= first["prompt_n"]
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        again = ask(sw, "tiny-a")["timings"]
    assert again["cache_n"] >= first["prompt_n"] - 8, again


# ------------------------------------------------------------ two slots, kills, full disks
OTHER = "Keep these numbers in mind. " + " ".join(
    f"Box {i} holds {i * 11 % 17} {w}." for i, w in
    enumerate(["apples", "nails", "coins", "shells", "stones", "beads"] * 8))


def ask_slot(sw, model, content, slot):
    """`content` answered by slot `slot` of the backend (llama-server's id_slot)."""
    r = requests.post(sw.url + "/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 4, "temperature": 0, "id_slot": slot,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text[:500]
    return r.json()["timings"]


def test_two_slots_are_each_saved_and_each_restored(docker_client, tmp_path):
    """tiny-a runs --parallel 2: a prompt in each slot, a swap, and back: both
    slots saved (slot0, slot1), both restored into their own slot."""
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        first = [ask_slot(sw, "tiny-a", PROMPT, 0), ask_slot(sw, "tiny-a", OTHER, 1)]
        assert all(t["prompt_n"] > 300 for t in first), first
        ask(sw, "tiny-b", "Hi.")
        folder = tmp_path / "tiny-a"
        saved = {json.loads(p.read_text())["slot"]: json.loads(p.read_text())
                 for p in folder.glob("slot*.json")}
        assert sorted(saved) == [0, 1]
        assert sorted(p.name for p in folder.glob("slot*.bin")) == ["slot0.bin", "slot1.bin"]
        for sid in (0, 1):
            assert saved[sid]["tokens"] >= first[sid]["prompt_n"]
        again = [ask_slot(sw, "tiny-a", PROMPT, 0), ask_slot(sw, "tiny-a", OTHER, 1)]
        for before, after in zip(first, again):
            assert after["cache_n"] >= before["prompt_n"] - 8, (before, after)
            assert after["prompt_n"] <= 8
        assert metric(sw, "swapper_kv_cache_tokens_total", model="tiny-a",
                      direction="restored") >= sum(t["prompt_n"] for t in first)
        requests.post(sw.url + "/unload", timeout=120)


class HeldOpens:
    """Every open of a file in `folder` waits for this test's word (fanotify's
    FAN_OPEN_PERM, root only): `on_open(name, pid)` runs first, then the open is
    allowed. Unlike a notification after the fact (inotify: the first version of
    this test), the opener cannot go on meanwhile: llama-server, told to save,
    is frozen before it has written a byte, however fast the save (a ~10 MB save
    could be written and answered before an inotify watcher woke: CI saw the
    file renamed after the freeze). Closing it allows whatever still waits."""
    FAN_CLASS_CONTENT, FAN_CLOEXEC, FAN_MARK_ADD = 0x04, 0x01, 0x01
    FAN_OPEN_PERM, FAN_EVENT_ON_CHILD, FAN_ALLOW, AT_FDCWD = 0x10000, 0x8000000, 0x01, -100
    EVENT = struct.Struct("IBBHQii")        # struct fanotify_event_metadata

    def __init__(self, folder, on_open):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                       ctypes.c_int, ctypes.c_char_p]
        self.fd = libc.fanotify_init(self.FAN_CLASS_CONTENT | self.FAN_CLOEXEC, os.O_RDONLY)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert libc.fanotify_mark(self.fd, self.FAN_MARK_ADD,
                                  self.FAN_OPEN_PERM | self.FAN_EVENT_ON_CHILD,
                                  self.AT_FDCWD, str(folder).encode()) == 0, \
            os.strerror(ctypes.get_errno())
        self.on_open, self.closed = on_open, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.closed.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 4096)
            except OSError:
                return
            at = 0
            while at + self.EVENT.size <= len(data):
                size, _v, _r, _m, _mask, fd, pid = self.EVENT.unpack_from(data, at)
                at += size
                if fd < 0:
                    continue
                try:
                    self.on_open(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), pid)
                finally:
                    os.write(self.fd, struct.pack("iI", fd, self.FAN_ALLOW))
                    os.close(fd)

    def close(self):
        self.closed.set()
        self.thread.join(5)
        os.close(self.fd)


def test_a_backend_killed_mid_save_leaves_nothing_that_is_restored(docker_client, tmp_path):
    """The moment llama-server opens its new save file (the save POST in flight,
    before it could answer) its process is frozen, then its container killed:
    the swap goes on, no slot file is kept from that save, the temporary file
    is swept, and the way back restores nothing (a full prefill, a 200)."""
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        first = ask(sw, "tiny-a")["timings"]
        (container,) = stack_containers(docker_client, sw.stack, running_only=True)
        pid = container.attrs["State"]["Pid"]           # llama-server: the container's init
        folder = tmp_path / "tiny-a"
        seen = {}

        def freeze_on_create(name, opener):
            if name.startswith("tmp-slot") and "name" not in seen:
                os.kill(pid, signal.SIGSTOP)           # mid-save: it cannot answer now
                seen["name"], seen["opener"] = name, opener
                seen["kept"] = sorted(p.name for p in folder.glob("slot*"))
                threading.Thread(target=container.kill, daemon=True).start()

        watch = HeldOpens(folder, freeze_on_create)
        try:
            ask(sw, "tiny-b", "Hi.")                    # the swap goes on
        finally:
            watch.close()
        assert seen.get("name", "").startswith("tmp-slot"), seen
        assert seen["kept"] == [], seen            # nothing renamed while the POST was open
        assert list(folder.glob("slot*")) == []    # nor after: the save never completed
        assert metric(sw, "swapper_kv_cache_failures_total", direction="save") >= 1
        again = ask(sw, "tiny-a")["timings"]       # the way back: nothing to restore
        assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8, again
        assert list(folder.glob("tmp-*")) == []    # swept before the restore
        assert metric(sw, "swapper_kv_cache_bytes_total", model="tiny-a",
                      direction="restored") == 0
        requests.post(sw.url + "/unload", timeout=120)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MB tmpfs (a slot of tiny-a's prompt is ~10 MB): a disk that fills mid-save."""
    where = tmp_path / "full"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0777", "tmpfs", str(where)],
                   check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_during_a_save_does_not_block_the_swap(docker_client, tiny_disk):
    with SwapperProcess(KV_CACHE_DIR=str(tiny_disk)) as sw:
        first = ask(sw, "tiny-a")["timings"]
        t0 = time.monotonic()
        ask(sw, "tiny-b", "Hi.")                    # the swap: its save hits ENOSPC
        swap_seconds = time.monotonic() - t0
        folder = tiny_disk / "tiny-a"
        assert list(folder.glob("slot*")) == [], list(folder.iterdir())
        assert metric(sw, "swapper_kv_cache_failures_total", direction="save") >= 1
        assert metric(sw, "swapper_kv_cache_bytes_total", model="tiny-a",
                      direction="saved") == 0
        again = ask(sw, "tiny-a")["timings"]        # back: a full prefill, and a 200
        assert again["cache_n"] == 0 and again["prompt_n"] >= first["prompt_n"] - 8, again
        assert list(folder.glob("tmp-*")) == []
        requests.post(sw.url + "/unload", timeout=120)
    print(f"swap with a full disk: {swap_seconds:.2f} s")


def test_the_first_answer_after_a_restore_tells_the_tokens_it_reused(docker_client, tmp_path):
    """Streamed, through the real swapper: the first answer after the restore is
    read for llama-server's timings (cache_n / prompt_n), counted once in
    swapper_kv_cache_first_answer_tokens and told in a `reused` event."""
    def counted(sw, prompt):
        return metric(sw, "swapper_kv_cache_first_answer_tokens_total", model="tiny-a",
                      prompt=prompt)

    with SwapperProcess(KV_CACHE_DIR=str(tmp_path)) as sw:
        events = requests.get(sw.url + "/events", stream=True, timeout=300)
        first = ask(sw, "tiny-a")["timings"]
        ask(sw, "tiny-b", "Hi.")
        r = requests.post(sw.url + "/v1/chat/completions", timeout=300, stream=True, json={
            "model": "tiny-a", "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]})
        lines = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                 if line.startswith("data: {")]
        del r               # its kept-alive socket would hold the swapper's stop 5 s
        timings = [e["timings"] for e in lines if "timings" in e][-1]
        assert timings["cache_n"] >= first["prompt_n"] - 8, timings
        assert counted(sw, "reused") == timings["cache_n"]
        assert counted(sw, "processed") == timings["prompt_n"]
        ask(sw, "tiny-a")                            # a second answer counts nothing more
        assert counted(sw, "reused") == timings["cache_n"]
        seen = None
        for line in events.iter_lines(decode_unicode=True):
            if line.startswith("data: {") and '"event": "reused"' in line.replace('":"', '": "'):
                seen = json.loads(line[6:])
                break
        events.close()
        assert seen["model"] == "tiny-a" and seen["reused"] == timings["cache_n"], seen
        assert seen["processed"] == timings["prompt_n"] and seen["restored"] >= first["prompt_n"]
        requests.post(sw.url + "/unload", timeout=120)


# ------------------------------------------------ issue 28: no side doors, no freeze
def test_slot_actions_are_the_swappers_alone(kv_swapper):
    """The issue's reproductions, with the real llama-server loaded: through
    /upstream a client saved a file of its choosing into the KV folder, erased
    a slot, and built a prefix oracle from save, restore and probe (cache_n 47
    for the right secret vs 29/40 for wrong guesses). Each step is refused now,
    and the published port answers none of it without the backend's own key."""
    sw = kv_swapper
    ask(sw, "tiny-a", "The secret is swordfish. Say OK.")
    folder = sw.kv_root / "tiny-a"
    before = sorted(p.name for p in folder.iterdir())
    for action, body in (("save", {"filename": "evil.bin"}),
                         ("restore", {"filename": "slot0.bin"}), ("erase", {})):
        r = requests.post(f"{sw.url}/upstream/tiny-a/slots/0?action={action}", json=body,
                          timeout=30)
        assert r.status_code == 403, (action, r.status_code, r.text[:300])
        assert "slot actions" in r.json()["error"]["message"]
        # the published port: no key, no action (a page's fetch carries none)
        d = requests.post(f"{sw.backend_url}/slots/0?action={action}", json=body, timeout=30,
                          headers={"Origin": "https://evil.example",
                                   "Content-Type": "text/plain"})
        assert d.status_code == 401, (action, d.status_code, d.text[:300])
    assert sorted(p.name for p in folder.iterdir()) == before        # nothing written
    # the prefix oracle's probe needs the slot restored: the slot still holds the prompt
    slots = requests.get(f"{sw.url}/upstream/tiny-a/slots", timeout=30)
    assert slots.status_code == 200 and slots.json()[0]["id"] == 0
    # read-only paths still serve; the backend's own key opens the port
    assert requests.post(f"{sw.url}/upstream/tiny-a/tokenize", json={"content": "hi"},
                         timeout=30).json()["tokens"]
    assert requests.get(f"{sw.backend_url}/health", timeout=10).status_code == 200
    assert requests.get(f"{sw.backend_url}/props", timeout=10).status_code == 401
    direct = requests.post(f"{sw.backend_url}/v1/chat/completions", timeout=60,
                           headers={"Origin": "https://evil.example"},
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
    assert direct.status_code == 401, direct.text[:300]
    keyed = requests.post(f"{sw.backend_url}/v1/chat/completions", timeout=60,
                          headers=sw.backend_headers,
                          json={"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2})
    assert keyed.status_code == 200, keyed.text[:300]


def test_the_published_port_answers_no_foreign_origin(kv_swapper):
    """Issue 35: llama-server answered a foreign Origin's preflight with that origin
    in Access-Control-Allow-Origin and credentials allowed (and echoed it on every
    answer, /health's readable one included). Its kind now starts it with
    `--cors-origins none --no-cors-credentials`: the header names no origin a browser
    sends, so a page's read fails in the browser (tests/integration/test_console.py
    drives one); requests with the backend's key, as curl and SDKs send them, answer."""
    sw = kv_swapper
    ask(sw, "tiny-a", "Hi.")
    evil = {"Origin": "http://evil.example"}
    pre = requests.options(f"{sw.backend_url}/v1/chat/completions", timeout=30, headers={
        **evil, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.headers.get("Access-Control-Allow-Origin") == "none", dict(pre.headers)
    assert pre.headers.get("Access-Control-Allow-Credentials") == "false", dict(pre.headers)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, headers, status in (
            ("GET", "/health", evil, 200),
            ("GET", "/v1/models", evil, 401),
            ("POST", "/v1/chat/completions", {**evil, "Content-Type": "text/plain"}, 401),
            ("POST", "/v1/chat/completions", {**evil, **sw.backend_headers}, 200)):
        r = requests.request(method, sw.backend_url + path, headers=headers, timeout=60,
                             data=json.dumps(body) if method == "POST" else None)
        assert r.status_code == status, (path, r.status_code, r.text[:300])
        assert r.headers.get("Access-Control-Allow-Origin") == "none", (path, dict(r.headers))
        assert "Access-Control-Allow-Credentials" not in r.headers, (path, dict(r.headers))
    # direct access with the key, no Origin (curl, SDKs): unchanged
    keyed = requests.post(f"{sw.backend_url}/v1/chat/completions", timeout=60,
                          headers=sw.backend_headers, json=body)
    assert keyed.status_code == 200 and keyed.json()["choices"], keyed.text[:300]


def test_a_fifo_in_the_folder_never_freezes_the_swapper(kv_swapper):
    """A FIFO named slot7.json froze the whole swapper (gevent blocked in its
    read on the restore); the folders were 0777 (anyone could plant one)."""
    sw = kv_swapper
    folder = sw.kv_root / "tiny-a"
    ask(sw, "tiny-a")
    assert os.stat(folder).st_mode & 0o002 == 0, oct(os.stat(folder).st_mode)
    ask(sw, "tiny-b", "Hi.")                        # tiny-a saved
    os.mkfifo(folder / "slot7.json")
    os.mkfifo(folder / "slot8.bin")
    (folder / "stray.bin").write_bytes(b"x" * 4096)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("timings", ask(sw, "tiny-a")["timings"]),
                         daemon=True)
    t.start()                                       # the swap back: its restore
    t0 = time.monotonic()
    while t.is_alive() and time.monotonic() - t0 < 60:
        r = requests.get(sw.url + "/healthz", timeout=5)    # the swapper still answers
        assert r.status_code == 200
        time.sleep(0.2)
    t.join(1)
    assert "timings" in done, "the swap back never answered"
    assert done["timings"]["cache_n"] > 300          # the saved slot was restored
    names = sorted(p.name for p in folder.iterdir())
    assert "slot7.json" not in names and "slot8.bin" not in names and "stray.bin" not in names


def test_a_huge_slot_file_is_hashed_within_the_restore_deadline(docker_client, tmp_path):
    """A huge (or endless) slotN.bin was hashed with no deadline: the swap back
    waited for all of it (minutes for this one). Its sidecar naming 64 GB (a
    sparse file), a restore budget of 1 s: the restore gives up at its deadline
    (a timeout, not a corrupt file found after the whole read) and the load goes
    on (then a full prefill)."""
    with SwapperProcess(KV_CACHE_DIR=str(tmp_path), KV_CACHE_RESTORE_TIMEOUT="1",
                        KV_CACHE_MAX_GB="1000", SWAP_POLICY="fifo") as sw:
        ask(sw, "tiny-a", "Say OK.")
        ask(sw, "tiny-b", "Hi.")                    # tiny-a saved
        (sidecar,) = (tmp_path / "tiny-a").glob("slot*.json")
        meta = json.loads(sidecar.read_text())
        big = 64 << 30
        with open(sidecar.with_suffix(".bin"), "ab") as f:
            f.truncate(big)
        meta["bytes"] = big
        sidecar.write_text(json.dumps(meta))
        t0 = time.monotonic()
        ask(sw, "tiny-a", "Say OK.")                # the swap back: its restore
        took = time.monotonic() - t0
        assert metric(sw, "swapper_kv_cache_failures_total", direction="restore",
                      reason="timeout") >= 1
        assert took < 30, f"the swap back took {took:.1f} s"
        requests.post(sw.url + "/unload", timeout=120)
    print(f"swap back with a 64 GB slot file and a 1 s restore budget: {took:.2f} s")
