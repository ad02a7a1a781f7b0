"""Fleet routing for LiteLLM's proxy: send a request to the stack where its model lives.

LiteLLM loads this module from its config (`litellm_settings.callbacks:
["routing.fleet_router"]`, the file beside config.yaml). It is a LiteLLM CustomLogger
whose `async_filter_deployments` hook (LiteLLM's pre-call deployment filter; it runs
after LiteLLM's own cooldown filter, before its routing strategy) narrows a model
group to the one deployment we choose. Everything else stays LiteLLM's: retries,
cooldowns of failing deployments, fallbacks. It also checks the router's key
(`fleet_auth`, LiteLLM's `general_settings.custom_auth`): the master key or a 401
(on Anthropic Messages in Anthropic's error shape); a person's key (`cs-...`, from
the stacks' shared key store) is passed on to the stack, which checks it
(`async_pre_call_hook`), and the stack's refusal is the answer, never retried on
another stack (`pick`).

Two parts, each testable alone:
- `choose()`: a pure function: the stacks that declare the model, their status, the
  session's previous stack for that model -> the stack to use.
- `StatusPoller`: a thread reading each stack's `/healthz` and `/v1/models` (never a
  completion: nothing it does can start a load).

Deployments carry `model_info.fleet_stack` (the stack's name), `model_info.fleet_url`
(its base URL) and `model_info.fleet_api` ("openai": chat, Responses, completions;
"anthropic": Messages) -- scripts/fleet.py writes them. A wildcard deployment (an
agent's own model names, `claude-*`, `gpt-5*`, `codex-*`, answered by the stack's
`model_patterns`) carries `model_info.fleet_pattern` and `model_info.fleet_use` (what
the stack maps it to: "@resident", or a model id).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict

import requests

try:                                   # inside LiteLLM's proxy
    from litellm.integrations.custom_logger import CustomLogger
except ImportError:                    # unit tests of the choice, without LiteLLM
    class CustomLogger:                # type: ignore[no-redef]
        def __init__(self, *a, **kw):
            pass
try:
    from litellm.proxy._types import ProxyException
except ImportError:
    ProxyException = Exception         # type: ignore[misc,assignment]

log = logging.getLogger("fleet.routing")

# Session ids the agents send, in the order they are looked for (headers lower-case).
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-id", "session_id", "session-id",
                   "conversation_id", "x-codex-session-id")


class StackStatus:
    """What a stack said on its last poll. (A plain class, not a dataclass: LiteLLM
    loads this file without registering it in sys.modules, which dataclasses need.)"""

    def __init__(self, up: bool = False, resident: str | None = None, state: str = "idle",
                 busy: int = 0, models: dict | None = None, seen: float = 0.0):
        self.up = up
        self.resident = resident        # the model loaded or loading (None: nothing)
        self.state = state              # the swapper's phase: idle, loading, ready, stopping
        self.busy = busy                # in flight + queued
        self.models = models or {}      # id -> status value (loaded, unloaded, ...)
        self.seen = seen                # monotonic time of the last answer

    def __repr__(self):
        return (f"StackStatus(up={self.up}, resident={self.resident!r}, state={self.state!r}, "
                f"busy={self.busy}, models={self.models!r})")


# ------------------------------------------------------------------ the choice

RESIDENT = "@resident"          # a pattern's `use`: whatever is resident (never a swap)


def rank(model: str | None, st: StackStatus) -> tuple:
    """Smaller is better: the model loaded here, then loading here (join that load),
    then nothing resident (a load, no swap), then another model resident (a swap);
    ties by how busy the stack is. `model` None: any model (a name the stack maps to
    its resident one): something loaded, then loading, then nothing (its default
    loads) -- never a swap."""
    if model is None:
        where = 0 if st.resident and st.state == "ready" else 1 if st.resident else 2
        return (where, st.busy)
    value = st.models.get(model)
    if value == "loaded" or (st.resident == model and st.state == "ready"):
        where = 0
    elif value in ("loading", "downloading") or st.resident == model:
        where = 1
    elif st.resident is None:
        where = 2
    else:
        where = 3
    return (where, st.busy)


def choose(model: str | None, stacks: list[str], status: dict[str, StackStatus],
           session_stack: str | None = None,
           per_stack: dict[str, str | None] | None = None) -> str | None:
    """The stack (of `stacks`, those declaring `model`) to send the request to.

    - the stack that served this session's previous turn for this model, while it is
      up (its prompt cache is there);
    - else the best ranked stack that is up (see `rank`), the first named on a tie;
    - None when no stack is known to be up (let LiteLLM try them all).
    `per_stack` overrides `model` per stack (a pattern each stack maps its own way)."""
    live = [s for s in stacks if status.get(s, StackStatus()).up]
    if not live:
        return None
    if session_stack in live:
        return session_stack
    want = per_stack or {}
    return min(live, key=lambda s: (rank(want.get(s, model), status[s]), stacks.index(s)))


# ------------------------------------------------------------------ the poller

class StatusPoller:
    """Polls every stack's `/healthz` (liveness, resident model, phase, queue) and
    `/v1/models` (each model's status) each `interval` seconds, on one daemon thread.
    A stack is up when its proxy answers and its swapper behind it does."""

    def __init__(self, stacks: dict[str, str], interval: float = 1.0, timeout: float = 2.0,
                 api_keys: dict[str, str] | None = None):
        self.stacks = dict(stacks)          # name -> base URL
        self.interval = interval
        self.timeout = timeout
        self.api_keys = api_keys or {}
        self.status: dict[str, StackStatus] = {n: StackStatus() for n in self.stacks}
        self.polls = 0
        self._session = requests.Session()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_one(self, name: str) -> StackStatus:
        base = self.stacks[name].rstrip("/")
        headers = {"Authorization": f"Bearer {self.api_keys[name]}"} if self.api_keys.get(name) else {}
        st = StackStatus()
        try:
            h = self._session.get(base + "/healthz", timeout=self.timeout, headers=headers)
            body = h.json() if h.status_code == 200 else {}
            # The proxy's /healthz carries the swapper's under "upstream"; a bare swapper's is flat.
            sw = body.get("upstream", {}).get("body") if "upstream" in body else body
            if not isinstance(sw, dict) or sw.get("status") != "ok":
                return st
            m = self._session.get(base + "/v1/models", timeout=self.timeout, headers=headers)
            if m.status_code != 200:
                return st
            models = {}
            for d in m.json().get("data", []):
                s = d.get("status")
                models[d["id"]] = s.get("value") if isinstance(s, dict) else None
            st = StackStatus(up=True, resident=sw.get("model"), state=sw.get("state") or "idle",
                             busy=int(sw.get("in_flight") or 0) + int(sw.get("queued") or 0),
                             models=models, seen=time.monotonic())
        except (requests.RequestException, ValueError, KeyError, TypeError):
            pass
        return st

    def poll(self) -> None:
        for name in self.stacks:
            self.status[name] = self.poll_one(name)
        self.polls += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a poller that dies routes blind forever
                log.exception("fleet status poll failed")
            self._stop.wait(self.interval)

    def start(self) -> "StatusPoller":
        if self._thread is None:
            self.poll()
            self._thread = threading.Thread(target=self._run, name="fleet-poller", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


# ------------------------------------------------------------------ LiteLLM's hook

def session_id(request_kwargs: dict | None) -> str | None:
    """The agent's session id: a session header (Claude Code's
    `X-Claude-Code-Session-Id`, `x-session-id`, Codex's `session_id`), Claude Code's
    `metadata.user_id` (JSON with a session_id, or a plain string), Codex's
    `client_metadata.session_id` / `prompt_cache_key` (Responses body); LiteLLM's own
    `litellm_session_id` last."""
    kw = request_kwargs or {}
    headers: dict = {}
    for bucket in (kw.get("proxy_server_request"), kw.get("metadata"), kw.get("litellm_metadata")):
        if isinstance(bucket, dict) and isinstance(bucket.get("headers"), dict):
            headers.update({str(k).lower(): v for k, v in bucket["headers"].items()})
    for h in SESSION_HEADERS:
        if headers.get(h):
            return f"h:{headers[h]}"
    for bucket in (kw.get("metadata"), (kw.get("proxy_server_request") or {}).get("body")):
        if not isinstance(bucket, dict):
            continue
        if "metadata" in bucket and isinstance(bucket["metadata"], dict):   # the request body
            bucket = bucket["metadata"]
        uid = bucket.get("user_id")
        if isinstance(uid, str) and uid:
            try:
                parsed = json.loads(uid)
                if isinstance(parsed, dict) and parsed.get("session_id"):
                    return f"s:{parsed['session_id']}"
            except ValueError:
                pass
            return f"u:{uid}"
    # Codex (Responses): client_metadata.session_id, else its prompt_cache_key (the same id)
    for bucket in (kw, (kw.get("proxy_server_request") or {}).get("body")):
        if not isinstance(bucket, dict):
            continue
        cm = bucket.get("client_metadata")
        if isinstance(cm, dict) and cm.get("session_id"):
            return f"c:{cm['session_id']}"
        if isinstance(bucket.get("prompt_cache_key"), str) and bucket["prompt_cache_key"]:
            return f"c:{bucket['prompt_cache_key']}"
    for bucket in (kw.get("metadata"), kw.get("litellm_metadata")):
        if isinstance(bucket, dict) and bucket.get("litellm_session_id"):
            return f"l:{bucket['litellm_session_id']}"
    return kw.get("litellm_session_id") and f"l:{kw['litellm_session_id']}"


def wanted_api(request_kwargs: dict | None) -> str:
    """"anthropic" for an Anthropic Messages request, else "openai"."""
    kw = request_kwargs or {}
    url = str((kw.get("proxy_server_request") or {}).get("url") or "")
    path = url.split("?", 1)[0]
    return "anthropic" if path.endswith("/messages") else "openai"


def tried_deployments(request_kwargs: dict | None) -> set[str]:
    """Deployment ids that already failed this request (LiteLLM's retry breadcrumbs,
    `metadata.previous_models`)."""
    out = set()
    kw = request_kwargs or {}
    for bucket in (kw.get("metadata"), kw.get("litellm_metadata")):
        if isinstance(bucket, dict):
            for rec in bucket.get("previous_models") or []:
                if isinstance(rec, dict) and rec.get("deployment_id"):
                    out.add(rec["deployment_id"])
    return out


def retry_after(error: Exception) -> str | None:
    """The Retry-After of the stack's answer an exception of LiteLLM's carries."""
    for headers in (getattr(getattr(error, "response", None), "headers", None),
                    getattr(error, "litellm_response_headers", None),
                    getattr(error, "headers", None)):
        try:
            value = headers.get("retry-after") if headers is not None else None
        except AttributeError:
            value = None
        if value:
            return str(value)
    return None


class Attempts:
    """A request's failed attempts (one carrying a person's key): the stacks that
    failed it, and the stack's refusal that is its answer."""

    def __init__(self):
        self.stacks: set[str] = set()
        self.refused: Exception | None = None


class FleetRouter(CustomLogger):
    """Narrows a model group to the deployment on the chosen stack."""

    def __init__(self, stacks: dict[str, str] | None = None, interval: float | None = None,
                 sessions: int = 10000, models_per_session: int = 16):
        super().__init__()
        self._stacks = stacks
        self._interval = interval
        self.poller: StatusPoller | None = None
        # session id -> {"models": {model: stack}, "last": stack}, LRU. Per model: a
        # session's prompt cache for a model is on the stack that served that model,
        # so a turn for a second model (only on another stack) must not move the next
        # turn of the first one. "last": the stack of its latest turn (an agent's own
        # names follow it).
        self.sessions: OrderedDict[str, dict] = OrderedDict()
        self.max_sessions = sessions
        self.models_per_session = models_per_session
        self.choices = 0
        self._lock = threading.Lock()
        # LiteLLM's call id -> the failed attempts of a request with a person's key
        self.failed: OrderedDict[str, Attempts] = OrderedDict()
        self.max_failed = 1000

    def ensure_poller(self, deployments: list[dict] | None = None) -> StatusPoller:
        """Started on first use: the stacks from FLEET_STACKS (name=url,...) or, failing
        that, from the deployments' model_info."""
        with self._lock:
            if self.poller is None:
                stacks = self._stacks or parse_stacks(os.environ.get("FLEET_STACKS", ""))
                if not stacks and deployments:
                    stacks = {d["model_info"]["fleet_stack"]: d["model_info"]["fleet_url"]
                              for d in deployments if "fleet_stack" in d.get("model_info", {})}
                keys = {n: os.environ.get(f"FLEET_KEY_{n.upper().replace('-', '_')}", "")
                        for n in stacks}
                interval = self._interval or float(os.environ.get("FLEET_POLL_INTERVAL", "1.0"))
                self.poller = StatusPoller(stacks, interval=interval, api_keys=keys).start()
            return self.poller

    def remember(self, sid: str, model: str, stack: str) -> None:
        """Session `sid`'s turn for `model` went to `stack`."""
        with self._lock:
            s = self.sessions.pop(sid, None) or {"models": {}, "last": None}
            s["models"].pop(model, None)
            s["models"][model] = stack
            while len(s["models"]) > self.models_per_session:
                s["models"].pop(next(iter(s["models"])))
            s["last"] = stack
            self.sessions[sid] = s
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def session_stack(self, sid: str | None, model: str | None) -> str | None:
        """The stack that served session `sid`'s last turn for `model` (None: for any
        model, its latest turn)."""
        with self._lock:
            s = self.sessions.get(sid) if sid else None
            if s is None:
                return None
            return s["last"] if model is None else s["models"].get(model)

    def pick(self, model: str, deployments: list[dict], request_kwargs: dict | None) -> list[dict]:
        ours = [d for d in deployments if "fleet_stack" in (d.get("model_info") or {})]
        if not ours:
            return deployments
        poller = self.ensure_poller(ours)
        api = wanted_api(request_kwargs)
        fitting = [d for d in ours if d["model_info"].get("fleet_api", "openai") == api] or ours
        by_stack: dict[str, dict] = {}
        for d in fitting:
            by_stack.setdefault(d["model_info"]["fleet_stack"], d)
        # A retry (LiteLLM's num_retries) goes to another stack than the ones that just
        # failed this request -- e.g. a 503 "queue full": busy beyond its queue.
        failed = tried_deployments(request_kwargs)
        failed_stacks = {d["model_info"]["fleet_stack"] for d in ours
                         if d["model_info"].get("id") in failed}
        attempts = self.attempts(request_kwargs)
        if attempts is not None:
            # A person's key (passed on): LiteLLM names its attempts by per-request ids
            # (client-side credential deployments), so its failed stacks are ours to
            # note. A stack's refusal of the key (401, 403, 429) is the answer: every
            # stack checks it against the one database and would answer the same, so
            # LiteLLM's retry (it retries these on another deployment) ends here, with
            # that answer, before any other stack sees the request.
            if attempts.refused is not None:
                raise attempts.refused
            failed_stacks |= attempts.stacks
        if failed_stacks and set(by_stack) - failed_stacks:
            by_stack = {s: d for s, d in by_stack.items() if s not in failed_stacks}
        model_id = fitting[0]["model_info"].get("fleet_model") or model
        # An agent's own name (claude-haiku-*, gpt-5*): each stack maps it to its resident
        # model (or a fixed one); rank by that. It follows the session's stack but never
        # sets it: Claude Code's first background call (a title) can arrive before the
        # main model's first turn, and must not pull the session onto a stack where the
        # main model is not resident.
        pattern = "fleet_pattern" in fitting[0]["model_info"]
        per_stack = {s: (None if d["model_info"].get("fleet_use", RESIDENT) == RESIDENT
                         else d["model_info"]["fleet_use"])
                     for s, d in by_stack.items()} if pattern else None
        # A model's turn follows the session's stack for that model; an agent's own name
        # the stack of the session's latest turn.
        sid = session_id(request_kwargs)
        chosen = choose(model_id, list(by_stack), poller.status,
                        self.session_stack(sid, None if pattern else model_id), per_stack)
        self.choices += 1
        if chosen is None:                  # none known up: LiteLLM's own choice and retries
            return fitting
        if sid and not pattern:
            self.remember(sid, model_id, chosen)
        return [by_stack[chosen]]

    async def async_filter_deployments(self, model, healthy_deployments, messages,
                                       request_kwargs=None, parent_otel_span=None):
        return self.pick(model, healthy_deployments, request_kwargs)

    # -------------------------------------------------------------- a person's key

    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):
        """A request `fleet_auth` let through with a person's key (`cs-...`, from the
        stacks' key store): the key goes on to the stack as this request's `api_key`,
        LiteLLM's per-request credential (router.py `_handle_clientside_credential`:
        it takes the place of the deployment's FLEET_KEY, for `openai/` and
        `anthropic/` deployments alike, and LiteLLM keeps it out of its logged copies
        of the request). The key is read from the request's headers as LiteLLM keeps
        them for such uses (`secret_fields.raw_headers`, never logged): the one whose
        digest `fleet_auth` recorded."""
        want = passed_digest(user_api_key_dict)
        if want is None or not isinstance(data, dict):
            return data
        raw = (data.get("secret_fields") or {}).get("raw_headers") or {}
        for value in raw.values():
            key = person_key(value) if isinstance(value, str) else None
            if key and hmac.compare_digest(key_digest(key), want):
                data["api_key"] = key
                return data
        raise ProxyException(message="Authentication Error: the key is not in the request's "
                             "headers", type="auth_error", param=None, code=401)

    def attempts(self, request_kwargs, create: bool = False, pop: bool = False):
        """The record of a request that carries a person's key (None for others): by
        LiteLLM's call id, bounded (a request's record ends with its answer)."""
        kw = request_kwargs if isinstance(request_kwargs, dict) else dict(request_kwargs or {})
        call = kw.get("litellm_call_id")
        if not call or not person_key(kw.get("api_key")):
            return None
        with self._lock:
            if pop:
                return self.failed.pop(call, None)
            found = self.failed.get(call)
            if found is None and create:
                found = self.failed[call] = Attempts()
                while len(self.failed) > self.max_failed:
                    self.failed.popitem(last=False)
            return found

    async def async_post_call_failure_deployment_hook(self, request_data, exception, call_type,
                                                      fallback_depth=None):
        """A stack failed a request that carries a person's key: LiteLLM calls this once
        per failed attempt, before it decides on a retry (`exception`: a copy of its
        own). Its stack is noted (a retry goes elsewhere: `pick`), and a refusal of the
        key (401, 403, 429) is kept to be the request's answer."""
        attempts = self.attempts(request_data, create=True)
        if attempts is None:
            return
        for name in ("litellm_metadata", "metadata"):
            md = request_data.get(name)
            stack = ((md.get("model_info") or {}).get("fleet_stack")
                     if isinstance(md, dict) else None)
            if stack:
                attempts.stacks.add(stack)
                break
        if getattr(exception, "status_code", None) in REFUSED and attempts.refused is None:
            attempts.refused = exception

    async def async_post_call_response_headers_hook(self, data, user_api_key_dict, response,
                                                    request_headers=None, litellm_call_info=None):
        """The answer's headers on the OpenAI routes (LiteLLM calls this once per
        answer, an error's too): a stack's refusal keeps its Retry-After (LiteLLM
        passes a stack's headers on as `llm_provider-*` only). The request's record
        ends here."""
        attempts = self.attempts(data, pop=True)
        if response is not None or attempts is None or attempts.refused is None:
            return None
        wait = retry_after(attempts.refused)
        return {"retry-after": wait} if wait else None

    async def async_post_call_failure_hook(self, request_data, original_exception,
                                           user_api_key_dict, traceback_str=None):
        """A failed Messages request's record ends here: LiteLLM's Messages route
        answers an error without the headers hook (and without a stack's headers:
        no Retry-After there)."""
        if wanted_api(request_data) == "anthropic":
            self.attempts(request_data, pop=True)
        return None


# ------------------------------------------------------------------ the router's key

def check_key(api_key: str | None, master: str | None) -> bool:
    """The presented key (LiteLLM hands over the Authorization or x-api-key value,
    `Bearer ` or not) is the router's master key, compared in constant time."""
    key = (api_key or "").strip()
    if key[:7].lower() == "bearer ":
        key = key[7:].strip()
    return bool(master and key) and hmac.compare_digest(key.encode(), master.encode())


MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")   # Anthropic's routes

# A person's key: the stacks' key store's tokens (proxy/keys/store.py: `cs-` and 43
# URL-safe characters). The router cannot check one (the stacks' database holds only
# their digests): it passes it on, on the model routes that reach a stack.
PERSON_KEY = re.compile(r"cs-[A-Za-z0-9_-]{43}")
PASS_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
              "/v1/responses", "/responses", "/v1/messages", "/v1/embeddings", "/embeddings")
PASSED = "fleet-passed:"        # UserAPIKeyAuth.api_key of a passed key: this + its digest
REFUSED = (401, 403, 429)       # a stack's refusals of a person's key


def person_key(api_key) -> str | None:
    """The presented key when it has the form of a person's key (`Bearer ` or not)."""
    key = (api_key or "").strip() if isinstance(api_key, str) else ""
    if key[:7].lower() == "bearer ":
        key = key[7:].strip()
    return key if PERSON_KEY.fullmatch(key) else None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def passed_digest(user_api_key_dict) -> str | None:
    """The digest `fleet_auth` recorded for a person's key it let through, else None."""
    passed = getattr(user_api_key_dict, "api_key", None)
    return passed[len(PASSED):] if isinstance(passed, str) and passed.startswith(PASSED) else None


class AnthropicAuthError(ProxyException):
    """The router's 401 on an Anthropic Messages path (see `fleet_auth`)."""


async def anthropic_auth_error(request, exc: AnthropicAuthError):
    """Its answer in Anthropic's error shape, by LiteLLM's own mapping (as its
    Messages route answers its other errors): {"type": "error", "error": {"type":
    "authentication_error", "message": ...}}."""
    from fastapi.responses import JSONResponse
    from litellm.anthropic_interface.exceptions import AnthropicExceptionMapping
    return JSONResponse(AnthropicExceptionMapping.create_error_response(401, exc.message),
                        status_code=401, headers=exc.headers)


async def fleet_auth(request, api_key: str):
    """LiteLLM's `general_settings.custom_auth`: the master key (LITELLM_MASTER_KEY),
    a person's key passed on, or a 401. Without a database LiteLLM's own check
    answers a wrong key 400 "No connected db." (it would look the key up as a virtual
    key); this router keeps no virtual keys (docs/fleet.md, Keys), so a key that is
    neither is an authentication error: in the error shape LiteLLM gives its other
    401s, and on Anthropic Messages in Anthropic's.

    A person's key (`cs-` and 43 characters: a key of the stacks' store, which the
    router cannot check) passes on a model route that reaches a stack (PASS_PATHS,
    POST): FleetRouter.async_pre_call_hook sends it to the stack, whose door checks
    it against the stacks' shared database and whose refusal (401, 403, 429) is the
    answer. On any other route it is a 401 here: nothing passes unchecked.

    LiteLLM calls this in its routes' auth dependency, before a route's own error
    handling; what it raises reaches the app's exception handlers as a ProxyException
    (a subclass kept as it is: auth/auth_exception_handler.py `_as_proxy_exception`),
    and LiteLLM's handler for ProxyException writes OpenAI's shape (proxy_server.py
    `openai_exception_handler`). The app's handlers are fixed when it starts, before
    this module is imported (LiteLLM's start-up reads the config), so
    `app.add_exception_handler` would come too late: the Messages paths' error, a
    subclass, gets its handler in the running app's table instead (the request's
    `starlette.exception_handlers`; Starlette picks a handler by the exception's
    class, the subclass's before ProxyException's). Without that table it is the
    same 401, OpenAI-shaped."""
    from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth
    master = os.environ.get("LITELLM_MASTER_KEY", "")
    if check_key(api_key, master):
        return UserAPIKeyAuth(api_key=master, user_role=LitellmUserRoles.PROXY_ADMIN)
    path = request.url.path.rstrip("/")
    key = person_key(api_key)
    if key and request.method == "POST" and path in PASS_PATHS:
        # A person's key on a model route: passed on to the stack (FleetRouter's
        # async_pre_call_hook), which checks it. Recorded by its digest only: LiteLLM
        # logs and shows this object's api_key.
        return UserAPIKeyAuth(api_key=PASSED + key_digest(key),
                              user_role=LitellmUserRoles.INTERNAL_USER)
    error = ProxyException
    if path.endswith(MESSAGES_PATHS):
        error = AnthropicAuthError
        handlers = request.scope.get("starlette.exception_handlers")
        if handlers:
            handlers[0].setdefault(AnthropicAuthError, anthropic_auth_error)
    message = "Authentication Error: missing or invalid key (the router's master key)"
    if key:
        message = ("Authentication Error: a person's key (cs-...) is passed on to the stacks "
                   "with model requests only (POST /v1/chat/completions, /v1/completions, "
                   "/v1/responses, /v1/messages, /v1/embeddings); this route takes the "
                   "router's master key")
    raise error(message=message, type="auth_error", param=None, code=401)


def parse_stacks(text: str) -> dict[str, str]:
    """"A=http://a:11433,B=http://b:11433" -> {"A": "http://a:11433", ...}"""
    out = {}
    for part in text.split(","):
        if "=" in part:
            name, url = part.split("=", 1)
            out[name.strip()] = url.strip()
    return out


fleet_router = FleetRouter()
