"""Downloads on first use, on the fake runtime with the real download code
(swapper.fetch's fetch_model over HTTP) against a stand-in Hub (HF_ENDPOINT):
one download however many requests wait for it, other models served meanwhile,
progress in the waiting stream and the model status, AUTO_DOWNLOAD=0's clear
error, and failures (401, a full disk, a connection cut mid-file) that end the
wait with their cause and never leave a partial file under the final name."""
from __future__ import annotations

import threading
import time

import pytest

from swapper.app import create_app
from swapper.settings import Settings
from tests.support.chat import Reply, ScriptedChat
from tests.support.fake_runtime import FakeHub, FakeRuntime
from tests.support.swapperproc import ENV, FIXTURE_BACKENDS

DATA = bytes(range(256)) * (4 * 4096)          # 4 MiB
MANIFEST = """
[tiny-a]
source = "hf"
repo = "org/tiny-GGUF"
files = [ { local = "tiny/tiny-a.gguf", remote = "tiny-a.gguf" } ]
"""


@pytest.fixture
def chat():
    with ScriptedChat() as c:
        yield c


@pytest.fixture
def hub():
    with FakeHub({"org/tiny-GGUF/tiny-a.gguf": DATA}, rate=4 * 2 ** 20) as h:
        yield h


def make_app(tmp_path, hub, urls, **settings):
    manifest = tmp_path / "models.toml"
    manifest.write_text(MANIFEST)
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    s = Settings.from_env({**ENV, "HF_ENDPOINT": hub.url, "MODELS_DIR": str(models)},
                          BACKENDS_DIR=str(FIXTURE_BACKENDS),
                          WATCH_INTERVAL=0.05, CRASH_BACKOFF=0.01, KEEPALIVE_INTERVAL=0.1,
                          MODELS_MANIFEST=str(manifest), **settings)
    runtime = FakeRuntime(urls)
    return create_app(s, runtime=runtime), runtime, models / "tiny" / "tiny-a.gguf"


def body(model, stream=True):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def gets(hub):
    return [r for r in hub.requests if r[0] == "GET"]


def test_missing_file_is_downloaded_once_for_two_requests_then_loaded(tmp_path, hub, chat):
    chat.script(Reply("one"), Reply("two"))
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    sched = app.extensions["swapper"].scheduler
    assert sched.model_status("tiny-a")["value"] == "unloaded"
    answers = {}

    def ask(i):
        answers[i] = app.test_client().post("/v1/chat/completions", json=body("tiny-a"),
                                            buffered=True).data.decode()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 5
    while sched.model_status("tiny-a")["value"] != "downloading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads[1].start()                                   # joins the running download
    for t in threads:
        t.join(30)
    for text in answers.values():
        assert ": downloading tiny-a: " in text          # progress comments while waiting
        assert " / 4.2 MB" in text
        assert "data: [DONE]" in text
    assert len(gets(hub)) == 1, hub.requests             # one download for both
    assert target.read_bytes() == DATA
    assert not target.with_name("tiny-a.gguf.part").exists()
    assert [c for c in runtime.calls if c[0] == "start"] == [("start", "tiny-a")]
    assert sched.model_status("tiny-a")["value"] == "loaded"


def test_progress_reaches_the_model_status(tmp_path, hub, chat):
    hub.rate = 2 * 2 ** 20                                # ~2 s
    chat.script(Reply("one"))
    app, _, _ = make_app(tmp_path, hub, {"tiny-a": chat.url})
    c = app.test_client()
    t = threading.Thread(target=lambda: app.test_client().post(
        "/load/tiny-a", buffered=True))
    t.start()
    seen = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        st = next(m for m in c.get("/v1/models").json["data"] if m["id"] == "tiny-a")["status"]
        if st["value"] == "downloading" and st.get("done_bytes") and st.get("eta_seconds"):
            seen = st
            break
        time.sleep(0.05)
    assert seen is not None
    assert seen["total_bytes"] == len(DATA) and 0 < seen["done_bytes"] < len(DATA)
    assert seen["bytes_per_second"] > 0
    t.join(30)
    st = next(m for m in c.get("/v1/models").json["data"] if m["id"] == "tiny-a")["status"]
    assert st["value"] == "loaded"


def test_another_model_is_served_during_a_download(tmp_path, hub, chat):
    hub.rate = 1 * 2 ** 20                                # ~4 s
    chat.script(Reply("b-first"), Reply("a-after"), Reply("b-meanwhile"))
    app, runtime, _ = make_app(tmp_path, hub, {"tiny-a": chat.url, "tiny-b": chat.url})
    c = app.test_client()
    sched = app.extensions["swapper"].scheduler
    assert c.post("/v1/chat/completions", json=body("tiny-b", False), buffered=True).status_code == 200
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("a", app.test_client().post(
        "/v1/chat/completions", json=body("tiny-a"), buffered=True).data))
    t.start()
    deadline = time.monotonic() + 5
    while sched.model_status("tiny-a")["value"] != "downloading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The resident model stays, and answers while tiny-a downloads.
    assert sched.model_status("tiny-b")["value"] == "loaded"
    r = c.post("/v1/chat/completions", json=body("tiny-b", False), buffered=True)
    # answered while tiny-a still downloads: it did not wait for the download
    assert r.status_code == 200
    assert sched.model_status("tiny-a")["value"] == "downloading"
    t.join(30)
    assert b"data: [DONE]" in done["a"]
    starts = [c for c in runtime.calls if c[0] == "start"]
    assert starts == [("start", "tiny-b"), ("start", "tiny-a")]


def test_auto_download_off_is_a_clear_409(tmp_path, hub, chat):
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url}, AUTO_DOWNLOAD=False)
    r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False), buffered=True)
    assert r.status_code == 409
    msg = r.json["error"]["message"]
    assert "./download-model.sh tiny-a" in msg and "AUTO_DOWNLOAD=0" in msg
    assert r.json["error"]["code"] == "model_not_downloaded"
    assert hub.requests == [] and not target.exists()
    assert not [c for c in runtime.calls if c[0] == "start"]
    st = app.extensions["swapper"].scheduler.model_status("tiny-a")
    assert st["value"] == "failed" and "download-model.sh" in st["failure"]


def failed_stream(app) -> str:
    return app.test_client().post("/v1/chat/completions", json=body("tiny-a"),
                                  buffered=True).data.decode()


def no_partial_loaded(runtime, target):
    assert not target.exists()                           # nothing under the final name
    assert not [c for c in runtime.calls if c[0] == "start"]


def test_gated_repo_401_ends_the_wait_with_the_token_advice(tmp_path, hub, chat):
    hub.token = "hf_right"
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    text = failed_stream(app)
    assert "needs a Hugging Face token" in text and "HF_TOKEN" in text
    assert "download_failed" in text
    no_partial_loaded(runtime, target)
    # non-streamed: the same cause, a 502
    r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False), buffered=True)
    assert r.status_code == 502 and "needs a Hugging Face token" in r.json["error"]["message"]


def test_a_full_disk_ends_the_wait_with_that_cause(tmp_path, hub, chat, monkeypatch):
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    models = app.extensions["swapper"].driver.downloads.models
    monkeypatch.setattr(models.shutil, "disk_usage",
                        lambda p: type("U", (), {"free": 1000, "total": 10 ** 9})())
    r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False), buffered=True)
    assert r.status_code == 507
    assert "the disk is full" in r.json["error"]["message"]
    assert gets(hub) == []
    no_partial_loaded(runtime, target)


def test_a_connection_cut_mid_file_fails_then_the_next_request_resumes(tmp_path, hub, chat):
    hub.reset_after = 1 * 2 ** 20
    chat.script(Reply("whole"))
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    text = failed_stream(app)
    assert "download failed" in text and ("connection" in text or "arrived" in text), text
    no_partial_loaded(runtime, target)
    part = target.with_name("tiny-a.gguf.part")
    assert 0 < part.stat().st_size < len(DATA)          # kept aside, to resume
    hub.reset_after = None
    ok = failed_stream(app)
    assert "data: [DONE]" in ok, ok
    assert gets(hub)[-1][2] == f"bytes={part.stat().st_size if part.exists() else 0}-" or \
        gets(hub)[-1][2].startswith("bytes=")           # resumed with a Range request
    assert target.read_bytes() == DATA and not part.exists()


# ----------------------------------------------------------------- issue 28
DATA2 = bytes(reversed(range(256))) * (4 * 4096)      # another version, the same size


def test_a_file_changed_upstream_between_two_attempts_is_never_stitched(tmp_path, hub, chat):
    """A resume sent Range against the moving `main` with no If-Range: a file
    changed upstream between two attempts was stitched from two versions (its
    size still right) and loaded. The .part is tied to its commit and ETag now."""
    hub.reset_after = 1 * 2 ** 20
    chat.script(Reply("whole"))
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    assert "download failed" in failed_stream(app)
    part = target.with_name("tiny-a.gguf.part")
    assert 0 < part.stat().st_size < len(DATA)
    hub.reset_after = None
    hub.replace("org/tiny-GGUF/tiny-a.gguf", DATA2)   # a new version upstream
    ok = failed_stream(app)
    assert "data: [DONE]" in ok, ok
    assert target.read_bytes() == DATA2               # whole, of one version
    assert gets(hub)[-1][2] is None                   # fetched whole, not resumed
    assert f"/resolve/{FakeHub.commit(DATA2)}/" in gets(hub)[-1][1]    # pinned to its commit
    assert not part.exists() and not target.with_name("tiny-a.gguf.part.json").exists()


def test_a_resume_is_pinned_to_the_version_it_started_from(tmp_path, hub, chat):
    hub.reset_after = 1 * 2 ** 20
    chat.script(Reply("whole"))
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    failed_stream(app)
    have = target.with_name("tiny-a.gguf.part").stat().st_size
    hub.reset_after = None
    assert "data: [DONE]" in failed_stream(app)
    method, path, rng = gets(hub)[-1]
    assert rng == f"bytes={have}-" and f"/resolve/{FakeHub.commit(DATA)}/" in path
    assert target.read_bytes() == DATA


def test_a_file_whose_sha256_is_not_the_hubs_is_refused_and_removed(tmp_path, hub, chat):
    hub.lie = True
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False), buffered=True)
    assert r.status_code == 502 and "sha256" in r.json["error"]["message"], r.json
    no_partial_loaded(runtime, target)
    assert not target.with_name("tiny-a.gguf.part").exists()


def test_the_headroom_is_kept_free(tmp_path, hub, chat, monkeypatch):
    """Free space enough for the file but not for the file and 5 % of the disk."""
    app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    models = app.extensions["swapper"].driver.downloads.models
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: type(
        "U", (), {"free": len(DATA) + 1000, "total": 100 * len(DATA)})())
    r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False), buffered=True)
    assert r.status_code == 507 and "DOWNLOAD_HEADROOM_PCT" in r.json["error"]["message"]
    assert gets(hub) == []
    no_partial_loaded(runtime, target)


TWO = MANIFEST + """
[tiny-b]
source = "hf"
repo = "org/tiny-GGUF"
files = [ { local = "tiny/tiny-b.gguf", remote = "tiny-b.gguf" } ]
"""


def test_two_models_on_one_disk_download_one_at_a_time(tmp_path, hub, chat):
    hub.files["org/tiny-GGUF/tiny-b.gguf"] = DATA2
    hub.rate = 8 * 2 ** 20                                # ~0.5 s each
    chat.script(Reply("a"), Reply("b"))
    app, runtime, _ = make_app(tmp_path, hub, {"tiny-a": chat.url, "tiny-b": chat.url},
                               SWAP_POLICY="fifo")         # no hold between the two loads
    (tmp_path / "models.toml").write_text(TWO)
    dl = app.extensions["swapper"].driver.downloads
    dl.manifest = dl.models.load_manifest(tmp_path / "models.toml")
    dl.scan(["tiny-a", "tiny-b"])
    answers = {}
    threads = [threading.Thread(target=lambda m=m: answers.setdefault(m, app.test_client().post(
        "/v1/chat/completions", json=body(m, False), buffered=True).status_code))
        for m in ("tiny-a", "tiny-b")]
    for t in threads:
        t.start()
    seen = set()                # what tiny-b's status said while it waited
    while any(t.is_alive() for t in threads):
        st = app.test_client().get("/v1/models/tiny-b").json["status"]
        seen.add(st.get("waiting_for"))
        time.sleep(0.02)
    for t in threads:
        t.join(30)
    assert answers == {"tiny-a": 200, "tiny-b": 200}
    assert hub.peak_sending == 1, "two downloads wrote to one disk at once"
    # Whichever went first, the other said whose download it waited for.
    assert seen & {"tiny-a", "tiny-b"}, seen
    assert len(gets(hub)) == 2
    assert (tmp_path / "models" / "tiny" / "tiny-b.gguf").read_bytes() == DATA2


def test_a_disk_that_fills_mid_file_loses_the_partial_file(tmp_path, hub, chat, monkeypatch):
    """The disk fills while the file arrives (something else wrote meanwhile: the
    free-space check said yes): the `.part` was left, so the disk stayed full.
    A 2 MB tmpfs for a 4 MB file, its free space reported as plenty."""
    import subprocess
    models = tmp_path / "models"
    models.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(models)], check=True)
    try:
        app, runtime, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
        mod = app.extensions["swapper"].driver.downloads.models
        monkeypatch.setattr(mod.shutil, "disk_usage", lambda p: type(
            "U", (), {"free": 10 ** 12, "total": 10 ** 13})())
        r = app.test_client().post("/v1/chat/completions", json=body("tiny-a", False),
                                   buffered=True)
        assert r.status_code == 507 and "the disk is full" in r.json["error"]["message"]
        assert gets(hub)                                  # it did start writing
        no_partial_loaded(runtime, target)
        assert list(models.rglob("*.part*")) == []        # nothing left filling the disk
    finally:
        subprocess.run(["umount", "-l", str(models)], check=False)


def test_the_hubs_own_headers_are_read_on_its_redirect(hub):
    """The Hub puts X-Repo-Commit, X-Linked-Etag (an LFS file's sha256) and
    X-Linked-Size on its redirect to the CDN, whose own ETag is another thing:
    they are read there, not after the redirect is followed; the GET then goes
    where the redirect points, at the commit."""
    from swapper import fetch as m
    from tests.support.servers import Scripted
    sha, commit = FakeHub.sha256(DATA), FakeHub.commit(DATA)
    cdn = f"{hub.url}/org/tiny-GGUF/resolve/main/tiny-a.gguf"
    redirect = (b"HTTP/1.1 302 Found\r\nLocation: %s\r\nX-Repo-Commit: %s\r\n"
                b"X-Linked-Etag: \"%s\"\r\nX-Linked-Size: %d\r\nETag: \"cdn-etag\"\r\n"
                b"Content-Length: 0\r\n\r\n" % (cdn.encode(), commit.encode(), sha.encode(),
                                                len(DATA)))
    srv = Scripted(redirect)
    try:
        info = m.remote_info(f"{srv.url}/org/tiny-GGUF/resolve/main/tiny-a.gguf",
                             "org/tiny-GGUF", "tiny-a.gguf", {})
    finally:
        srv.close()
    assert (info.size, info.etag, info.commit, info.sha256) == (len(DATA), sha, commit, sha)
    assert srv.heads[0].startswith(b"HEAD ") and len(srv.heads) == 1    # not followed
    assert not [r for r in hub.requests if r[0] == "HEAD"]


def test_downloads_on_one_disk_take_their_turns_in_the_order_asked(tmp_path):
    """The place in a disk's line is taken when the download is asked for, not
    when its thread gets there: CI once saw the second model's thread (its Hub
    lookups quicker) overtake the first's, so the first, asked for first, was
    the one refused for want of space. A thread that arrives early waits; a
    place left without its turn (an early return, an exception) frees the line."""
    from swapper.download import DiskTurns
    from swapper.lease import downloading_text
    turns = DiskTurns()
    first, second, gone = (turns.line_up(str(tmp_path), m) for m in ("a", "b", "c"))
    entered, told = [], []

    def take(place):
        with turns.turn(place, told.append):
            entered.append(place.model)
    late = threading.Thread(target=take, args=(second,))
    late.start()
    time.sleep(0.2)
    assert entered == [], "the second download went before the first"
    assert told == ["a"], "the waiting download did not say what it waits for"
    take(first)
    late.join(5)
    assert entered == ["a", "b"] and told == ["a"]
    turns.leave(gone)                       # never took its turn
    turns.leave(gone)                       # leaving twice is harmless
    assert turns._lines == {}
    assert downloading_text("b", {"done_bytes": 0, "waiting_for": "a"}) == \
        "download of b waits for the download of a on the same disk"


def test_a_download_run_by_hand_goes_first_and_the_wait_says_so(tmp_path, hub, chat):
    """./download-model.sh (another process) holds MODELS_DIR's download lock: the
    swapper's download on first use waits for it (its free-space check would
    otherwise count on space the other is filling), says so in the stream and the
    model status, and goes on as soon as the lock is free (also when its holder
    dies: the lock goes with its descriptor)."""
    import subprocess
    import sys
    chat.script(Reply("after"))
    app, _, target = make_app(tmp_path, hub, {"tiny-a": chat.url})
    lock = target.parents[1] / ".download.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDONLY | os.O_CREAT, 0o666)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        answer = {}
        t = threading.Thread(target=lambda: answer.setdefault("a", app.test_client().post(
            "/v1/chat/completions", json=body("tiny-a"), buffered=True).data.decode()))
        t.start()
        sched = app.extensions["swapper"].scheduler
        deadline = time.monotonic() + 10
        while sched.model_status("tiny-a").get("waiting_for") != "another process":
            assert time.monotonic() < deadline, sched.model_status("tiny-a")
            time.sleep(0.02)
        time.sleep(0.3)
        assert gets(hub) == [], "it downloaded while the other process held the folder"
    finally:
        holder.kill()
        holder.wait()
    t.join(30)
    assert ": download of tiny-a waits for another process's download into MODELS_DIR" \
        in answer["a"]
    assert "data: [DONE]" in answer["a"] and target.read_bytes() == DATA
