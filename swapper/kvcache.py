"""llama.cpp prompt caches across swaps: each slot that holds a prompt is saved
before its backend stops, and restored when that model is next healthy, before
its queue is admitted (the driver calls `save` and `restore`; docs/kv-cache.md).

llama-server does the writing and the reading (`--slot-save-path DIR`, `POST
/slots/{id}?action=save|restore {"filename"}`); this module owns the folder:

- one folder per model under KV_CACHE_DIR, mounted into the backend at
  /kvcache/<model>/ (`backend_mount`, used by the runtime's create);
- a save goes to a temporary name (`tmp-slot<N>-<hex>.bin`); only once the call
  returned 200 and the file holds every byte llama-server says it wrote is it
  renamed to `slot<N>.bin`, its sha256 and what it is tied to in the sidecar
  `slot<N>.json` (written after it, atomically). A backend killed mid-save leaves
  a temporary file only, swept before the next restore;
- a file is restored only when its sidecar matches the backend now running
  (the image and its id, llama.cpp's build, the model file as llama-server
  reports it, the KV-shaping flags: -m, -c, -ctk, -ctv, -np, -fa...), and its
  size and sha256 are those saved: this llama-server ABORTS on a truncated file,
  so nothing unchecked is ever handed to it. A mismatch, a corrupt file or a
  restore the backend refuses discards the file;
- the total is capped (KV_CACHE_MAX_GB): least recently used files go first;
- what a restore bought is read off the first answer after it (`answered`: the
  backend's `timings.cache_n` / `prompt_n`, else its usage's cached tokens), once
  per restore: swapper_kv_cache_first_answer_tokens and a `reused` event.

Nothing here may fail a stop or a load: every failure costs only the cache, is
logged with its reason and counted (swapper_kv_cache_failures). Each direction
is bounded in time (KV_CACHE_SAVE_TIMEOUT, KV_CACHE_RESTORE_TIMEOUT): past it the
remaining slots are skipped (a save in progress is abandoned: the backend is
killed and its temporary file never used).
"""
from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from .conversations import Book, Conversation, Stint, replay_body

log = logging.getLogger("swapper.kvcache")

CONTAINER_ROOT = "/kvcache"      # where backends see the cache folder
CONNECT_SECONDS = 2.0
HASH_CHUNK = 8 << 20             # bytes hashed between two yields (gevent: the hub runs)
DEFAULT_CACHE_RAM_MIB = 8192    # llama-server's --cache-ram when not given
ANSWER_TAIL = 16 << 10           # bytes of the first answer after a restore read for its counts

# Launch flags that shape the KV cache (or the file's meaning): a file saved
# under other values is discarded. Short and long spellings of llama-server.
KV_FLAGS = {
    "-m": "model", "--model": "model",
    "-c": "ctx", "--ctx-size": "ctx",
    "-ctk": "cache_k", "--cache-type-k": "cache_k",
    "-ctv": "cache_v", "--cache-type-v": "cache_v",
    "-np": "parallel", "--parallel": "parallel",
    "-fa": "flash_attn", "--flash-attn": "flash_attn",
    "--override-kv": "override_kv",
    "--kv-unified-per-slot": "per_slot",
    "--rope-scaling": "rope", "--rope-freq-base": "rope_base", "--yarn-orig-ctx": "yarn",
}
KV_SWITCHES = {"--swa-full", "-kvu", "--kv-unified", "--no-kv-unified", "--no-kv-offload"}


def enabled(settings, spec) -> bool:
    return bool(settings.KV_CACHE_DIR) and spec.kind == "llamacpp" and spec.kv_cache


def backend_mount(settings, spec) -> tuple[str, tuple[str, ...]] | None:
    """(volume, extra args) a backend of `spec` is created with, its folder made
    (writable by the backend's user); None when the cache is off for it or its
    folder cannot be made (then it runs without: said once in the log)."""
    if not enabled(settings, spec):
        return None
    folder = Path(settings.KV_CACHE_DIR) / spec.id
    try:
        folder.mkdir(parents=True, exist_ok=True)
        share_with_backend(folder, spec.user)
    except OSError as e:
        log.warning("model %s: no prompt cache across swaps: cannot make %s (%s)",
                    spec.id, folder, e)
        return None
    source = settings.KV_CACHE_VOLUME or settings.KV_CACHE_DIR
    inside = f"{CONTAINER_ROOT}/{spec.id}"
    if "/" in source or source.startswith((".", "~")):     # a path: this model's folder only
        volume = f"{source.rstrip('/')}/{spec.id}:{inside}"
    else:                                                  # a named volume: all of it
        volume = f"{source}:{CONTAINER_ROOT}"
    return volume, ("--slot-save-path", inside + "/")


def backend_ids(user: str | None) -> tuple[int | None, int | None]:
    """(uid, gid) of a registry `user:` ("uid", "uid:gid", or names known to this
    host); None where it cannot be told (no user: the image's, root for ours)."""
    if not user:
        return None, None
    name, _, group = str(user).partition(":")
    uid = gid = None
    try:
        uid = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
        if not group and not name.isdigit():
            gid = pwd.getpwnam(name).pw_gid
    except KeyError:
        pass
    if group:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            pass
    # "uid" alone: Docker gives it the image's group for that uid, else 0: unknown here
    return uid, gid


def share_with_backend(folder: Path, user: str | None) -> None:
    """Make a model's folder writable by its backend and nobody else: the
    backend's group, group-writable, set-group-id (what it writes keeps that
    group), never world-writable (a local user could plant a FIFO or a link
    there). The swapper must be root or a member of that group (its privileges
    drop adds BACKEND_USER's group); it says so when it is not."""
    uid, gid = backend_ids(user)
    mode = 0o700
    if gid is None and uid is not None and os.geteuid() == 0:
        os.chown(folder, uid, -1)           # its group unknown: the backend's own folder
    elif gid is not None and gid != os.getegid():
        try:
            os.chown(folder, -1, gid)
            mode = 0o2770
        except PermissionError:
            log.warning("cannot give %s to the backend's group %s (the swapper, uid %d, is not "
                        "in it): the backend cannot write its prompt cache there", folder, gid,
                        os.geteuid())
    elif gid is not None:
        mode = 0o2770
    os.chmod(folder, mode)


def kv_flags(spec) -> dict:
    """The KV-shaping launch flags of a model (args and LLAMA_ARG_* variables)."""
    out: dict = {}
    args = list(spec.args)
    for i, a in enumerate(args):
        if a in KV_FLAGS and i + 1 < len(args):
            key = KV_FLAGS[a]
            if key == "override_kv":
                out.setdefault(key, []).append(args[i + 1])
            else:
                out[key] = args[i + 1]
        elif a in KV_SWITCHES:
            out[a.lstrip("-")] = True
    for k, v in sorted(spec.env.items()):
        if k.startswith("LLAMA_ARG_"):
            out[k] = v
    return out


@dataclass
class Outcome:
    """What one save or restore did: for the event, the metrics and the tests."""
    slots: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)      # the files' (slot<N>, conv-<key>)
    bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)    # reasons
    died: bool = False           # the backend stopped answering during a restore
    replayed: int = 0            # prompt tokens the replays before the saves processed

    def fields(self) -> dict:
        out = {"slots": self.slots, "saved": self.names, "bytes": self.bytes,
               "tokens": self.tokens, "seconds": round(self.seconds, 3)}
        if self.replayed:
            out["replayed_tokens"] = self.replayed
        if self.failures:
            out["failures"] = self.failures
        return out


class _Skip(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class KvCache:
    def __init__(self, settings, metrics, emit: Callable[..., None] | None = None,
                 image_id: Callable[[str], str | None] | None = None,
                 clock=time.monotonic, wall=time.time, pause=time.sleep):
        self.settings = settings
        self.metrics = metrics
        self._emit = emit or (lambda event, **fields: None)
        self._image_id = image_id
        self._clock = clock
        self._wall = wall
        self._pause = pause                      # time.sleep(0): a gevent yield
        self._http = requests.Session()
        self._http.trust_env = False
        # model -> {conversation (None: of no known one) -> tokens restored}, until
        # the first answer of that conversation after that restore
        self._awaiting: dict[str, dict[str | None, int]] = {}
        # the conversations each model served since its load (what its stop saves)
        self.book = Book(settings.KV_CACHE_CONVERSATIONS)
        # told (model, tokens, seconds) what a restored conversation's first answer
        # still prefilled (swapper/swaps.py's ledger)
        self.on_first_answer: Callable[[str, int, float | None], None] | None = None
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        return Path(self.settings.KV_CACHE_DIR or ".")

    def enabled(self, spec) -> bool:
        return enabled(self.settings, spec)

    def folder(self, model: str) -> Path:
        return self.root / model

    # ------------------------------------------------------------ identity
    def fingerprint(self, spec, backend, timeout: float) -> dict:
        """What a saved file is tied to, as the running backend tells it."""
        props = self._get(backend, "/props", timeout)
        models = self._get(backend, "/v1/models", timeout)
        meta = {}
        data = models.get("data") or [{}]
        for k in ("n_params", "size", "n_vocab", "n_embd", "n_ctx_train", "n_ctx"):
            if k in (data[0].get("meta") or {}):
                meta[k] = data[0]["meta"][k]
        image_id = None
        if self._image_id is not None:
            try:
                image_id = self._image_id(spec.image)
            except Exception:            # the engine may be down: the tag still counts
                image_id = None
        return {"image": spec.image, "image_id": image_id, "build": props.get("build_info"),
                "model_path": props.get("model_path"), "total_slots": props.get("total_slots"),
                "meta": meta, "flags": kv_flags(spec)}

    def _get(self, backend, path: str, timeout: float) -> dict:
        r = self._http.get(backend.url + path, timeout=(CONNECT_SECONDS, max(timeout, 0.1)),
                           headers=_auth(backend))
        if r.status_code != 200:
            raise _Skip("refused", f"GET {path}: HTTP {r.status_code}")
        return r.json()

    # ---------------------------------------------------------------- save
    def served(self, model: str, conv: Conversation | None) -> None:
        """A request of `model` (of conversation `conv`, None: one without) was
        admitted to its backend: what its stop saves."""
        self.book.served(model, conv)

    def save(self, spec, backend) -> Outcome:
        """Save the prompt caches of the running `backend` (it still answers:
        before its stop). One slot: every conversation it served since it was
        loaded, newest first: the slot's own as it is, each other one after its
        last request is replayed for one token (llama-server brings its prompt
        back from its RAM cache). Several slots: each slot that holds a prompt.
        Never raises."""
        out = Outcome()
        stint = self.book.take(spec.id)
        budget = self.settings.KV_CACHE_SAVE_TIMEOUT
        if not self.enabled(spec) or budget <= 0:
            return out
        with self._lock:
            self._awaiting.pop(spec.id, None)    # its restore had no answer: none counts
        t0 = self._clock()
        deadline = t0 + budget
        folder = self.folder(spec.id)
        self._emit("saving", model=spec.id, done=False)
        try:
            fp = self.fingerprint(spec, backend, budget)
            slots = self._get(backend, "/slots", deadline - self._clock())
        except Exception as e:
            self._fail(out, "save", spec.id, _reason(e), f"cannot read its slots: {e}")
            slots, fp = [], None
        slots = [s for s in slots if isinstance(s, dict) and isinstance(s.get("id"), int)] \
            if isinstance(slots, list) else []
        if len(slots) == 1:
            # nothing served since its load: what it holds was restored from its files
            if stint is not None:
                self._save_conversations(spec, backend, folder, slots[0], stint, fp,
                                         deadline, out)
        else:
            self._save_slots(spec, backend, folder, slots, fp, deadline, out)
        return self._ended(spec, "saved", "saving", out, t0, tidy=self.evict)

    def _save_conversations(self, spec, backend, folder: Path, slot: dict, stint: Stint,
                            fp: dict, deadline: float, out: Outcome) -> None:
        """One slot: the slot as it is (the last conversation), then each other
        conversation of the stint, newest first, replayed into it and saved."""
        sid = slot["id"]
        budget = self.settings.KV_CACHE_SAVE_TIMEOUT
        last = stint.last
        todo: list[tuple[Conversation | None, float]] = []
        if not slot.get("is_processing") and slot.get("n_prompt_tokens", 1):
            todo.append((last, stint.last_at))
        others = [(c, at) for c, at in reversed(stint.conversations)
                  if last is None or c.key != last.key]
        todo += others[:max(self.settings.KV_CACHE_CONVERSATIONS - len(todo), 0)]
        for i, (conv, at) in enumerate(todo):
            left = deadline - self._clock()
            name = f"conv-{conv.key}" if conv is not None else f"slot{sid}"
            if left <= 0:
                self._fail(out, "save", spec.id, "timeout",
                           f"{name} not saved: KV_CACHE_SAVE_TIMEOUT ({budget:g} s) spent")
                continue
            try:
                if i > 0 or conv is not last:
                    reused, processed = self._replay(backend, conv, left)
                    out.replayed += processed
                    if processed > reused:
                        # the RAM cache no longer held it (nor, older, the rest): a
                        # re-prefill, which the next ones would repeat
                        raise _Skip("evicted", f"llama-server's RAM prompt cache no longer "
                                               f"held it ({processed} tokens processed); "
                                               "older conversations are not replayed")
                self._save_slot(spec, backend, folder, sid, name, conv, at, fp,
                                deadline - self._clock(), out)
            except _Skip as e:
                self._fail(out, "save", spec.id, e.reason, f"{name} not saved: {e}")
                if e.reason == "evicted":
                    break
            except Exception as e:
                self._fail(out, "save", spec.id, _reason(e), f"{name} not saved: {e}")

    def _save_slots(self, spec, backend, folder: Path, slots: list[dict], fp: dict,
                    deadline: float, out: Outcome) -> None:
        """Several slots: each one that holds a prompt, as slot<N>."""
        budget = self.settings.KV_CACHE_SAVE_TIMEOUT
        # This build lists n_prompt_tokens for a slot once it served a request: one
        # that never did holds nothing. A build that does not say: try them all (an
        # empty slot saves 0 tokens, and that file is dropped).
        told = any("n_prompt_tokens" in s for s in slots)
        for slot in slots:
            sid = slot["id"]
            if slot.get("is_processing") or (told and not slot.get("n_prompt_tokens")):
                continue
            left = deadline - self._clock()
            if left <= 0:
                self._fail(out, "save", spec.id, "timeout",
                           f"slot {sid} not saved: KV_CACHE_SAVE_TIMEOUT ({budget:g} s) spent")
                continue
            try:
                self._save_slot(spec, backend, folder, sid, f"slot{sid}", None, self._wall(),
                                fp, left, out)
            except Exception as e:
                self._fail(out, "save", spec.id, _reason(e), f"slot {sid} not saved: {e}")

    def _replay(self, backend, conv: Conversation | None, left: float) -> tuple[int, int]:
        """Bring `conv` back into the slot: its last request, one token asked.
        Returns the prompt tokens the backend reused and processed for it (a
        few processed when its RAM prompt cache held the conversation)."""
        body = replay_body(conv) if conv is not None else None
        if body is None:
            raise _Skip("replay", "its last request was not kept (too large)")
        r = self._http.post(f"{backend.url}/{conv.path}", data=body,
                            headers={**_auth(backend), "Content-Type": "application/json"},
                            timeout=(CONNECT_SECONDS, max(left, 0.1)))
        if r.status_code != 200:
            raise _Skip("replay", f"its replay was answered HTTP {r.status_code}: "
                                  f"{r.text[:200]}")
        return prompt_counts(r.content[-ANSWER_TAIL:]) or (0, 0)

    def _save_slot(self, spec, backend, folder: Path, sid: int, name: str,
                   conv: Conversation | None, used: float, fp: dict, left: float,
                   out: Outcome) -> None:
        tmp = folder / f"tmp-{name}-{secrets.token_hex(4)}.bin"
        try:
            r = self._http.post(f"{backend.url}/slots/{sid}", params={"action": "save"},
                                json={"filename": tmp.name}, headers=_auth(backend),
                                timeout=(CONNECT_SECONDS, max(left, 0.1)))
            if r.status_code != 200:
                raise _Skip("refused", f"HTTP {r.status_code}: {r.text[:200]}")
            body = r.json()
            saved, written = int(body.get("n_saved", 0)), int(body.get("n_written", -1))
            if saved <= 0:
                return                                   # an empty slot: nothing to keep
            size = written
            digest = self._sha256(tmp, written, self._clock() + left, missing="disk",
                                  short="incomplete")
            final, sidecar = folder / f"{name}.bin", folder / f"{name}.json"
            sidecar.unlink(missing_ok=True)      # an old sidecar never describes the new file
            os.replace(tmp, final)
            _write_json(sidecar, {"name": name, "slot": sid,
                                  "conversation": conv.key if conv is not None else None,
                                  "bytes": size, "tokens": saved, "sha256": digest,
                                  "fingerprint": fp, "saved": self._wall(), "used": used})
            out.slots.append(sid)
            out.names.append(name)
            out.bytes += size
            out.tokens += saved
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    # -------------------------------------------------------------- restore
    def restore(self, spec, backend) -> Outcome:
        """Restore the model's saved prompt caches into the freshly healthy
        `backend` (nothing admitted yet). One slot: every saved conversation
        (at most KV_CACHE_CONVERSATIONS, as many as its RAM prompt cache holds),
        the least recently served first, each moved on into llama-server's RAM
        prompt cache by a one-token request but the last, which stays in the
        slot: whichever comes back first, llama-server finds its prefix. Several
        slots: each slot<N> file into its slot. Never raises; `died` when the
        backend stopped answering meanwhile (its files are discarded)."""
        out = Outcome()
        budget = self.settings.KV_CACHE_RESTORE_TIMEOUT
        if not self.enabled(spec) or budget <= 0:
            return out
        self.book.forget(spec.id)
        folder = self.folder(spec.id)
        self._sweep(folder)
        entries = self._entries(folder)
        if not entries:
            return out
        t0 = self._clock()
        deadline = t0 + budget
        self._emit("restoring", model=spec.id, done=False)
        try:
            fp = self.fingerprint(spec, backend, budget)
        except Exception as e:
            self._fail(out, "restore", spec.id, _reason(e), f"cannot identify the backend: {e}")
            fp = None
            out.died = isinstance(e, requests.ConnectionError)
        if fp is not None and fp.get("total_slots") == 1:
            entries = self._fitting(spec, entries)
        elif fp is not None:
            entries = [e for e in entries if _SLOT.fullmatch(e[0].stem)]
        awaiting: dict[str | None, int] = {}
        for sidecar, meta in entries if fp is not None else []:
            name = sidecar.stem
            sid = meta.get("slot") if fp.get("total_slots") != 1 else 0
            final = folder / f"{name}.bin"
            left = deadline - self._clock()
            try:
                if left <= 0:
                    raise _Skip("timeout", f"KV_CACHE_RESTORE_TIMEOUT ({budget:g} s) spent")
                self._check(meta, final, fp, deadline)
                if out.slots and fp.get("total_slots") == 1:
                    self._stash(backend, deadline - self._clock())
                r = self._http.post(f"{backend.url}/slots/{sid}", params={"action": "restore"},
                                    json={"filename": final.name}, headers=_auth(backend),
                                    timeout=(CONNECT_SECONDS, max(deadline - self._clock(), 0.1)))
                if r.status_code != 200:
                    raise _Skip("refused", f"HTTP {r.status_code}: {r.text[:200]}")
                body = r.json()
                if not _CONV.fullmatch(name):
                    meta["used"] = self._wall()
                    _write_json(sidecar, meta)
                out.slots.append(sid)
                out.names.append(name)
                out.bytes += int(body.get("n_read", meta.get("bytes", 0)))
                restored = int(body.get("n_restored", 0))
                out.tokens += restored
                key = meta.get("conversation")
                key = key if isinstance(key, str) else None
                awaiting[key] = awaiting.get(key, 0) + restored
            except requests.ConnectionError as e:
                self._discard(sidecar, final)
                self._fail(out, "restore", spec.id, "crashed",
                           f"{name}: the backend stopped answering on its restore ({e}); "
                           "its file is discarded")
                out.died = True
                break
            except Exception as e:
                reason = _reason(e)
                if reason not in ("timeout", "stash"):
                    self._discard(sidecar, final)
                self._fail(out, "restore", spec.id, reason, f"{name} not restored: {e}")
                if reason == "stash":
                    break                # the slot's prompt would be lost: the last stays
        if out.slots and not out.died:
            with self._lock:
                self._awaiting[spec.id] = awaiting
        return self._ended(spec, "restored", "restoring", out, t0, tidy=self._disk)

    def _fitting(self, spec, entries: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
        """The saved prompts of a one-slot model to restore, least recently served
        first: the newest KV_CACHE_CONVERSATIONS, as many as its RAM prompt cache
        holds besides the slot's (llama-server's --cache-ram; 0: the newest only)."""
        entries = sorted(entries, key=lambda e: _number(e[1].get("used")))
        entries = entries[-max(self.settings.KV_CACHE_CONVERSATIONS, 1):]
        room = cache_ram_bytes(spec)            # None: no limit
        kept = entries[-1:]                     # the newest stays in the slot
        total = 0                               # what goes to the RAM cache
        for entry in reversed(entries[:-1]):
            size = _number(entry[1].get("bytes"))
            if room is not None and total + size > room:
                break
            total += size
            kept.append(entry)
        return list(reversed(kept))

    def _stash(self, backend, left: float) -> None:
        """Move the slot's restored prompt into llama-server's RAM prompt cache: a
        one-token request unlike it makes the server keep the slot's prompt
        there (server_prompt_cache) before it takes the slot."""
        try:
            r = self._http.post(f"{backend.url}/completion", headers=_auth(backend),
                                json={"prompt": " ", "n_predict": 1, "cache_prompt": True},
                                timeout=(CONNECT_SECONDS, max(left, 0.1)))
        except requests.Timeout:
            raise _Skip("stash", "the request moving the last one to the RAM cache timed "
                                 "out") from None
        if r.status_code != 200:
            raise _Skip("stash", f"the request moving the last one to the RAM cache was "
                                 f"answered HTTP {r.status_code}")

    # ------------------------------------------- what the restore bought
    def awaits_answer(self, model: str, key: str | None = None) -> bool:
        """Was `model` restored and has the first answer of that conversation
        (`key`) not been read since? (The forwarder then keeps the tail of its
        answer for `answered`.)"""
        waiting = self._awaiting.get(model)
        return bool(waiting) and (key in waiting or None in waiting)

    def answered(self, model: str, tail: bytes, key: str | None = None
                 ) -> tuple[int, int] | None:
        """The first complete answer of conversation `key` after a restore of
        `model` (its last bytes): the prompt tokens the backend reused and
        processed, counted once per restored conversation (a later answer, or
        one without the counts, counts nothing; a saved prompt of no known
        conversation counts the first answer of any). Returns (reused,
        processed) when it counted."""
        counts = prompt_counts(tail)
        if counts is None:
            return None
        with self._lock:
            waiting = self._awaiting.get(model) or {}
            which = key if key in waiting else None
            restored = waiting.pop(which, None) if which in waiting else None
            if not waiting:
                self._awaiting.pop(model, None)
        if restored is None:
            return None
        reused, processed = counts
        seconds = prompt_seconds(tail)
        self.metrics.kv_first_answer(model, reused, processed)
        if self.on_first_answer is not None:
            self.on_first_answer(model, processed, seconds)
        log.info("model %s: the first answer of conversation %s after its restore (%d "
                 "tokens) reused %d prompt tokens and processed %d (%.2f s)", model,
                 key or "-", restored, reused, processed, seconds or 0.0)
        self._emit("reused", model=model, conversation=key, restored=restored, reused=reused,
                   processed=processed, prompt_seconds=seconds)
        return counts

    def _ended(self, spec, direction: str, event: str, out: "Outcome", t0: float,
               tidy: Callable[[], object]) -> "Outcome":
        """A save or restore done: its seconds, metrics and log line, then `tidy`
        (the cap's eviction, the disk gauge), then its event."""
        out.seconds = self._clock() - t0
        if out.slots:
            self.metrics.kv_done(spec.id, direction, out.bytes, out.tokens, out.seconds)
            log.info("model %s: %s slot(s) %s (%d tokens, %.1f MB) in %.2f s", spec.id,
                     direction, out.slots, out.tokens, out.bytes / 1e6, out.seconds)
        tidy()
        self._emit(event, model=spec.id, done=True, **out.fields())
        return out

    def _check(self, meta: dict, final: Path, fp: dict, deadline: float) -> None:
        if meta.get("fingerprint") != fp:
            theirs = meta.get("fingerprint") or {}
            diff = sorted(k for k in set(fp) | set(theirs) if fp.get(k) != theirs.get(k))
            raise _Skip("mismatch", f"saved for another backend (differs in {', '.join(diff)})")
        size = meta.get("bytes")
        if not isinstance(size, int) or size <= 0:
            raise _Skip("corrupt", f"its sidecar gives no size ({size!r})")
        if self._sha256(final, size, deadline) != meta.get("sha256"):
            raise _Skip("corrupt", f"{final.name} is not the file saved (sha256 differs)")

    # ---------------------------------------------------------------- files
    def _entries(self, folder: Path) -> list[tuple[Path, dict]]:
        """(sidecar, what it says) of every saved slot: regular files only, read
        without following a link or waiting on a FIFO (_read_regular)."""
        out = []
        for name in sorted(_names(folder)):
            m = _SIDECAR.fullmatch(name)
            if m is None:
                continue
            sidecar = folder / name
            try:
                meta = json.loads(_read_regular(sidecar, SIDECAR_MAX))
                stem = m.group(1)
                if not isinstance(meta, dict) or meta.get("name", f"slot{meta.get('slot')}") \
                        != stem or not isinstance(meta.get("slot"), int):
                    raise ValueError("not the sidecar of that file")
            except (OSError, ValueError, _Skip) as e:
                log.warning("discarding %s: %s", sidecar, e)
                self.metrics.kv_failed("restore", "corrupt")
                self._discard(sidecar, sidecar.with_suffix(".bin"))
                continue
            out.append((sidecar, meta))
        return out

    def _sweep(self, folder: Path) -> None:
        """Before a restore (one backend at a time: none writes now): remove
        everything that is not a saved slot (slot<N>.bin, slot<N>.json, regular
        files): temporary files of saves that never completed, links, FIFOs,
        and files of any other name."""
        for name in _names(folder):
            path = folder / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                log.warning("prompt cache: %s is a folder, not a saved slot (left alone; not "
                            "the swapper's)", path)
                continue
            ours = stat.S_ISREG(st.st_mode) and (_SIDECAR.fullmatch(name) or _BIN.fullmatch(name))
            if not ours:
                if not name.startswith("tmp-"):
                    log.warning("prompt cache: removing %s (not a saved slot)", path)
                self._discard(path)

    def _discard(self, *paths: Path) -> None:
        for p in paths:
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                log.warning("cannot remove %s: %s", p, e)

    def usage(self) -> list[tuple[float, int, Path, Path]]:
        """(last used, bytes, sidecar, file) of every file of every model's
        folder: a saved slot counts its file and its sidecar; any other file (a
        temporary one, a file without its sidecar, one of another name) counts
        as last used never, so it goes first. Nothing is followed or read but
        regular sidecars."""
        out = []
        for model in _names(self.root):
            folder = self.root / model
            try:
                if not stat.S_ISDIR(folder.lstat().st_mode):
                    continue
            except OSError:
                continue
            sizes: dict[str, int] = {}
            for name in _names(folder):
                try:
                    st = (folder / name).lstat()
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    sizes[name] = st.st_size if stat.S_ISREG(st.st_mode) else 0
            for name, size in sizes.items():
                m = _BIN.fullmatch(name)
                sidecar_name = f"{m.group(1)}.json" if m else None
                if _SIDECAR.fullmatch(name) and name[:-5] + ".bin" in sizes:
                    continue                    # counted with its file
                final = folder / name
                used = 0.0
                sidecar = final
                if sidecar_name in sizes:
                    sidecar = folder / sidecar_name
                    size += sizes[sidecar_name]
                    try:
                        used = float(json.loads(_read_regular(sidecar, SIDECAR_MAX)).get("used", 0))
                    except (OSError, ValueError, AttributeError, TypeError, _Skip):
                        used = 0.0
                out.append((used, size, sidecar, final))
        return sorted(out, key=lambda e: (e[0], str(e[3])))

    def kept(self) -> dict | None:
        """What is kept on disk now, for /running and the console: prompts and
        bytes per model, the total and its cap (None: the cache is off)."""
        if not self.settings.KV_CACHE_DIR:
            return None
        models: dict[str, dict] = {}
        total = 0
        try:
            entries = self.usage()
        except OSError:
            entries = []
        for _used, size, _sidecar, final in entries:
            m = models.setdefault(final.parent.name, {"prompts": 0, "bytes": 0})
            m["prompts"] += final.suffix == ".bin"
            m["bytes"] += size
            total += size
        return {"models": models, "bytes": total,
                "max_bytes": int(self.settings.KV_CACHE_MAX_GB * 1e9),
                "conversations_per_model": self.settings.KV_CACHE_CONVERSATIONS}

    def evict(self) -> int:
        """Remove the least recently used files until each model keeps at most
        KV_CACHE_CONVERSATIONS saved prompts and the total fits KV_CACHE_MAX_GB.
        Returns the bytes left on disk."""
        entries = self.usage()
        total = sum(e[1] for e in entries)
        cap = self.settings.KV_CACHE_MAX_GB * 1e9
        count = self.settings.KV_CACHE_CONVERSATIONS
        per_model: dict[Path, int] = {}
        for e in entries:
            per_model[e[3].parent] = per_model.get(e[3].parent, 0) + 1
        for used, size, sidecar, final in entries:
            over = per_model[final.parent] > count
            if total <= cap and not over:
                continue
            log.info("prompt cache over %s: evicting %s (%.1f MB)",
                     f"KV_CACHE_CONVERSATIONS ({count})" if over else
                     f"KV_CACHE_MAX_GB ({self.settings.KV_CACHE_MAX_GB:g})", final, size / 1e6)
            self._discard(sidecar, final)
            per_model[final.parent] -= 1
            total -= size
        self.metrics.kv_disk(total)
        return total

    def _disk(self) -> None:
        try:
            self.metrics.kv_disk(sum(e[1] for e in self.usage()))
        except OSError:
            pass

    def _sha256(self, path: Path, size: int, deadline: float, missing: str = "corrupt",
                short: str = "corrupt") -> str:
        """The sha256 of the regular file `path`, which must hold `size` bytes
        (only those are read: a file that grows never holds the hash up), by
        `deadline` (else _Skip timeout). In a thread of the OS when gevent runs:
        a file read blocks the whole hub, and hashlib lets the GIL go."""
        return _offload(_hash_file, path, size, deadline, self._clock, missing, short)

    def _fail(self, out: Outcome, direction: str, model: str, reason: str, detail: str) -> None:
        log.warning("model %s: prompt cache %s: %s (%s); the %s goes on", model,
                    "save" if direction == "save" else "restore", detail, reason,
                    "stop" if direction == "save" else "load")
        out.failures.append(reason)
        self.metrics.kv_failed(direction, reason)


SIDECAR_MAX = 1 << 20           # bytes: a sidecar is a few hundred
# A saved prompt: <name>.bin and its sidecar <name>.json; the name is the slot's
# (several slots: slot<N>) or the conversation's (one slot: conv-<key>).
_NAME = r"(slot\d+|conv-[0-9a-f]{16})"
_SIDECAR = re.compile(_NAME + r"\.json")
_BIN = re.compile(_NAME + r"\.bin")
_SLOT = re.compile(r"slot\d+")
_CONV = re.compile(r"conv-[0-9a-f]{16}")
# Regular files only: never follow a link, never wait for a FIFO's writer (an open
# for reading blocks until one comes; under gevent, the whole swapper with it).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _open_regular(path: Path, missing: str = "corrupt") -> tuple[int, int]:
    """(fd, size) of `path` if it is a regular file, opened without following a
    link or blocking; else _Skip (`missing` when it is absent)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise _Skip(missing, f"{path.name} is missing") from None
    except OSError as e:
        raise _Skip("corrupt", f"{path.name} cannot be opened as a file: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Skip("corrupt", f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_regular(path: Path, limit: int) -> bytes:
    fd, size = _open_regular(path)
    try:
        if size > limit:
            raise _Skip("corrupt", f"{path.name} holds {size} bytes (at most {limit})")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def _hash_file(path: Path, size: int, deadline: float, clock, missing: str, short: str) -> str:
    fd, have = _open_regular(path, missing)
    try:
        if have != size:
            raise _Skip(short, f"{path.name} has {have} bytes, {size} saved")
        h = hashlib.sha256()
        left = size
        while left > 0:
            if clock() > deadline:
                raise _Skip("timeout", f"hashing {path.name} ran past its deadline")
            chunk = os.read(fd, min(HASH_CHUNK, left))
            if not chunk:
                raise _Skip(short, f"{path.name} ended {left} bytes early")
            h.update(chunk)
            left -= len(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _offload(fn, *args):
    """fn(*args) in a thread of the OS when gevent patched threading (the
    swapper's worker), else here."""
    try:
        from gevent import monkey
        patched = monkey.is_module_patched("threading")
    except ImportError:
        patched = False
    if not patched:
        return fn(*args)
    import gevent

    def run():
        try:
            return fn(*args), None
        except Exception as e:          # raised here, not logged by the pool's thread
            return None, e
    result, error = gevent.get_hub().threadpool.apply(run)
    if error is not None:
        raise error
    return result


def _auth(backend) -> dict:
    """The backend's key (swapper.runtime.Backend.key), when it has one."""
    key = getattr(backend, "key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _reason(e: Exception) -> str:
    if isinstance(e, _Skip):
        return e.reason
    if isinstance(e, requests.Timeout):
        return "timeout"
    if isinstance(e, requests.ConnectionError):
        return "unreachable"
    if isinstance(e, OSError):
        return "disk"
    return "refused"


_TIMINGS = re.compile(rb'"cache_n"\s*:\s*(\d+)|"prompt_n"\s*:\s*(\d+)')
_USAGE = re.compile(rb'"(prompt_tokens|input_tokens|cached_tokens|cache_read_input_tokens)"'
                    rb'\s*:\s*(\d+)')


_PROMPT_MS = re.compile(rb'"prompt_ms"\s*:\s*([0-9.eE+-]+)')


def prompt_seconds(tail: bytes) -> float | None:
    """The seconds llama-server spent on the prompt (its last `timings.prompt_ms`)."""
    found = _PROMPT_MS.findall(tail)
    try:
        return float(found[-1]) / 1000 if found else None
    except ValueError:
        return None


def cache_ram_bytes(spec) -> int | None:
    """llama-server's RAM prompt cache for `spec` in bytes (--cache-ram /
    -cram / LLAMA_ARG_CACHE_RAM, MiB; its default 8192): 0 when off, None when
    unbounded (-1)."""
    value = spec.env.get("LLAMA_ARG_CACHE_RAM")
    args = list(spec.args)
    for i, a in enumerate(args[:-1]):
        if a in ("--cache-ram", "-cram"):
            value = args[i + 1]
    try:
        mib = int(value) if value is not None else DEFAULT_CACHE_RAM_MIB
    except ValueError:
        mib = DEFAULT_CACHE_RAM_MIB
    return None if mib < 0 else mib << 20


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def prompt_counts(tail: bytes) -> tuple[int, int] | None:
    """(reused, processed) prompt tokens from the end of a llama-server answer,
    streamed or not: its `timings` (cache_n, prompt_n; the last ones given),
    else its usage (OpenAI: prompt_tokens with cached_tokens among them;
    Anthropic: input_tokens beside cache_read_input_tokens). None: neither."""
    cache_n = prompt_n = None
    for m in _TIMINGS.finditer(tail):
        if m.group(1) is not None:
            cache_n = int(m.group(1))
        else:
            prompt_n = int(m.group(2))
    if cache_n is not None and prompt_n is not None:
        return cache_n, prompt_n
    usage = {m.group(1).decode(): int(m.group(2)) for m in _USAGE.finditer(tail)}
    if "cache_read_input_tokens" in usage and "input_tokens" in usage:
        return usage["cache_read_input_tokens"], usage["input_tokens"]
    if "cached_tokens" in usage:
        total = usage.get("prompt_tokens", usage.get("input_tokens"))
        if total is not None:
            return usage["cached_tokens"], max(total - usage["cached_tokens"], 0)
    return None


def _write_json(path: Path, data: dict) -> None:
    """Atomically: a temporary file renamed into place."""
    tmp = path.with_name(f"tmp-{path.name}-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)
