"""Fleet routing for LiteLLM's proxy: send a request to the stack where its model lives.

LiteLLM loads this module from its config (`litellm_settings.callbacks:
["routing.fleet_router"]`, the file beside config.yaml). It is a LiteLLM CustomLogger
whose `async_filter_deployments` hook (LiteLLM's pre-call deployment filter; it runs
after LiteLLM's own cooldown filter, before its routing strategy) narrows a model
group to the one deployment we choose. Everything else stays LiteLLM's: retries,
cooldowns of failing deployments, fallbacks. It also checks the router's key
(`fleet_auth`, LiteLLM's `general_settings.custom_auth`): the master key or a 401
(on Anthropic Messages in Anthropic's error shape).

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

import hmac
import json
import logging
import os
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


# ------------------------------------------------------------------ the router's key

def check_key(api_key: str | None, master: str | None) -> bool:
    """The presented key (LiteLLM hands over the Authorization or x-api-key value,
    `Bearer ` or not) is the router's master key, compared in constant time."""
    key = (api_key or "").strip()
    if key[:7].lower() == "bearer ":
        key = key[7:].strip()
    return bool(master and key) and hmac.compare_digest(key.encode(), master.encode())


MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")   # Anthropic's routes


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
    """LiteLLM's `general_settings.custom_auth`: the master key (LITELLM_MASTER_KEY)
    or a 401. Without a database LiteLLM's own check answers a wrong key 400 "No
    connected db." (it would look the key up as a virtual key); this router keeps no
    virtual keys (docs/fleet.md, Keys), so a key that is not the master key is
    an authentication error: in the error shape LiteLLM gives its other 401s, and on
    Anthropic Messages in Anthropic's.

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
    error = ProxyException
    if request.url.path.rstrip("/").endswith(MESSAGES_PATHS):
        error = AnthropicAuthError
        handlers = request.scope.get("starlette.exception_handlers")
        if handlers:
            handlers[0].setdefault(AnthropicAuthError, anthropic_auth_error)
    raise error(message="Authentication Error: missing or invalid key (the router's "
                "master key)", type="auth_error", param=None, code=401)


def parse_stacks(text: str) -> dict[str, str]:
    """"A=http://a:11433,B=http://b:11433" -> {"A": "http://a:11433", ...}"""
    out = {}
    for part in text.split(","):
        if "=" in part:
            name, url = part.split("=", 1)
            out[name.strip()] = url.strip()
    return out


fleet_router = FleetRouter()
