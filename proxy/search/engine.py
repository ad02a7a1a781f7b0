"""The search engine every dialect shares: one model turn as a pure accumulator, the
one "what next" decision, and the searches themselves (budget, repeated-query guard,
failure classification, sources).

A dialect adapter (chat completions in loop.py, Anthropic Messages and OpenAI
Responses in proxy/dialects/) only maps its wire shapes onto these:

    turn = Turn()                  # fed from a streamed or a whole backend answer
    turn.text(...); turn.call(key, id, name); turn.args(key, ...); turn.finish = ...
    step = decide(turn, searcher.budget_left)
    if step is Step.SEARCH:
        done = searcher.run(turn.ours)      # or start()/finish() to keep a stream alive
"""
from __future__ import annotations

import concurrent.futures as cf
import enum
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .results import Source, Sources, bad_arguments_note, repeated_query_note
from .searxng import SearchOutcome, SearxngClient

log = logging.getLogger("proxy.search")

TOOL_NAME = "web_search"
TOOL_DESCRIPTION = (
    "Search the web. Use it when the answer depends on information you may not "
    "know or that may have changed: current versions, release notes, API docs, "
    "error messages, news, facts you are unsure of. Do not use it for things you "
    "already know well. Write a few precise keywords (e.g. 'flask 3.1 changelog "
    "stream_with_context'), not a sentence or a question. Results come numbered; "
    "cite them as [n].")
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "search keywords"}},
    "required": ["query"],
}


# ================================================================= one model turn

@dataclass
class Call:
    id: str | None = None
    name: str = ""
    args: str = ""
    client_id: str | None = None    # the id the client sees for our call (srvtoolu_, ws_)

    @property
    def query(self) -> str | None:
        try:
            a = json.loads(self.args) if self.args.strip() else {}
        except ValueError:
            return None
        q = a.get("query") if isinstance(a, dict) else None
        return q if isinstance(q, str) and q.strip() else None


@dataclass
class Turn:
    """What one backend answer (one round) said, in any dialect. Pure: no I/O."""
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict = field(default_factory=dict)        # dialect's key -> Call, in order
    finish: str | None = None                        # the backend's own finish/stop reason
    usage_out: int = 0                               # output tokens the backend counted

    def text(self, s: str | None) -> None:
        if s:
            self.texts.append(s)

    def think(self, s: str | None) -> None:
        if s:
            self.reasoning.append(s)

    def call(self, key, id: str | None = None, name: str | None = None) -> Call:
        c = self.calls.setdefault(key, Call())
        if id:
            c.id = id
        if name:
            c.name += name
        return c

    def args(self, key, s: str | None) -> None:
        if s:
            self.call(key).args += s

    def usage(self, out=None) -> None:
        if isinstance(out, int):
            self.usage_out += out

    @property
    def content(self) -> str:
        return "".join(self.texts)

    @property
    def ours(self) -> list[Call]:
        return [c for c in self.calls.values() if c.name == TOOL_NAME]

    @property
    def theirs(self) -> list[Call]:
        return [c for c in self.calls.values() if c.name and c.name != TOOL_NAME]


class Step(enum.Enum):
    SEARCH = "search"          # answer our web_search calls, call the model again
    FINAL = "final"            # give the client this turn (answer and/or its own tool calls)
    EXHAUSTED = "exhausted"    # the model still wants to search, budget spent, no answer
    TRUNCATED = "truncated"    # the backend's answer ended with nothing and no finish


def decide(turn: Turn, budget_left: bool) -> Step:
    """The one next-step decision, for every dialect, streamed or not.

    A turn that calls a client tool is the client's: our calls in it are dropped
    (the model may search again on its next turn)."""
    ours, theirs = turn.ours, turn.theirs
    if ours and not theirs and budget_left:
        return Step.SEARCH
    if turn.finish is None and not turn.content and not theirs and not ours:
        return Step.TRUNCATED
    if ours and not theirs and not turn.content:
        return Step.EXHAUSTED
    return Step.FINAL


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


# ================================================================= the searches

@dataclass
class Search:
    """One answered web_search call: what the model reads and what the client sees."""
    call: Call
    query: str | None
    text: str                                   # the tool result for the model
    outcome: SearchOutcome | None = None        # None: not run (bad args, repeat, budget)
    error: str | None = None                    # Anthropic-style error code when not ok
    sources: list[Source] = field(default_factory=list)


def _host_matches(url: str, domains) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    for d in domains:
        d = str(d).lower().strip().lstrip(".")
        if d.startswith("http"):
            d = (urlsplit(d).hostname or "").lower()
        if d and (host == d or host.endswith("." + d)):
            return True
    return False


class Searcher:
    """The searches of one client request: numbering, dedupe, budgets, metrics.

    max_iter bounds rounds (MAX_SEARCH_ITER); max_uses (Anthropic's per-tool limit)
    bounds individual searches. allowed/blocked filter results by domain."""

    def __init__(self, *, settings, searx: SearxngClient, metrics, executor: cf.Executor,
                 max_uses: int | None = None, allowed=None, blocked=None):
        self.settings = settings
        self.searx = searx
        self.metrics = metrics
        self.executor = executor
        self.max_iter = settings.MAX_SEARCH_ITER
        self.max_uses = max_uses
        self.allowed = list(allowed or [])
        self.blocked = list(blocked or [])
        self.sources = Sources(settings.SEARCH_SNIPPET_CHARS)
        self.seen: set[str] = set()
        self.rounds = 0          # search rounds done
        self.searches = 0        # SearXNG requests made
        self.empty = 0           # of which came back with nothing usable
        self.record = None       # the request's (proxy/record.py): told the rounds

    @property
    def budget_left(self) -> bool:
        if self.rounds >= self.max_iter:
            return False
        return self.max_uses is None or self.searches < self.max_uses

    def start(self, calls: list[Call]) -> list:
        """One entry per call: a Search (answered without searching) or a Future."""
        planned, this_turn = [], set()
        uses = self.searches
        for c in calls:
            if not c.id:
                c.id = new_id("call_")
            q = c.query
            if q is None:
                planned.append(Search(c, None, bad_arguments_note(c.args),
                                      error="invalid_tool_input"))
                continue
            key = re.sub(r"\s+", " ", q).strip().lower()
            if key in self.seen or key in this_turn:
                planned.append(Search(c, q, repeated_query_note(q)))
                continue
            if self.max_uses is not None and uses >= self.max_uses:
                planned.append(Search(c, q, (
                    f"web_search was not run: the limit of {self.max_uses} searches for this "
                    "request is reached. Answer with what you have."),
                    error="max_uses_exceeded"))
                continue
            uses += 1
            this_turn.add(key)
            planned.append(self.executor.submit(self.searx.search, q))
        self.seen |= this_turn
        return planned

    @staticmethod
    def futures(planned: list) -> list:
        return [p for p in planned if isinstance(p, cf.Future)]

    def finish(self, calls: list[Call], planned: list) -> list[Search]:
        out: list[Search] = []
        for c, p in zip(calls, planned):
            if isinstance(p, Search):
                out.append(p)
                continue
            res = self._filter(p.result())
            self.searches += 1
            self.metrics.search(res.kind)
            if res.empty:
                self.empty += 1
            if not res.ok:
                log.warning("web search %r failed (%s): %s", res.query, res.kind, res.hint)
            text, shown = self.sources.format_with(res)
            err = None
            if not res.ok:
                err = "too_many_requests" if res.kind == "rate_limited" else "unavailable"
            out.append(Search(c, res.query, text, res, err, shown))
        self.rounds += 1
        if not self.budget_left and out:
            out[-1].text += (
                f"\n\nNote: the web search budget is exhausted ({self.rounds} rounds, "
                f"{self.searches} searches, {self.empty} empty). web_search is no longer "
                "available: answer now with what you have.")
        return out

    def run(self, calls: list[Call]) -> list[Search]:
        return self.finish(calls, self.start(calls))

    def _filter(self, res: SearchOutcome) -> SearchOutcome:
        if not res.ok or not (self.allowed or self.blocked):
            return res
        keep = [r for r in res.results
                if (not self.allowed or _host_matches(str(r.get("url")), self.allowed))
                and not _host_matches(str(r.get("url")), self.blocked)]
        res.results = keep
        return res

    def done(self) -> None:
        self.metrics.rounds(self.rounds)
        if self.record is not None:
            self.record.rounds = self.rounds

    def exhausted_message(self) -> str:
        return (f"the web search budget is exhausted ({self.searches} searches ran, "
                f"{self.empty} came back empty) and the model gave no final answer")


def cited(text: str, sources: list[Source]) -> list[Source]:
    """The sources a text cites as [n], in order of first citation."""
    by_n = {s.n: s for s in sources}
    out, seen = [], set()
    for m in re.finditer(r"\[(\d{1,3})\]", text or ""):
        n = int(m.group(1))
        if n in by_n and n not in seen:
            seen.add(n)
            out.append(by_n[n])
    return out
