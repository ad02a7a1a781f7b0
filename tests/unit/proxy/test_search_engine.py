"""The search engine's pure parts: one turn's accumulator, the next-step decision,
and the Searcher's budgets (a stub SearXNG client: no sockets needed here)."""
import concurrent.futures as cf

import pytest

from proxy.search.engine import Call, Searcher, Step, Turn, cited, decide
from proxy.search.results import Source
from proxy.search.searxng import SearchOutcome
from proxy.settings import Settings


def turn(text="", calls=(), finish="stop"):
    t = Turn()
    t.text(text)
    for i, (name, args) in enumerate(calls):
        t.call(i, f"id{i}", name)
        t.args(i, args)
    t.finish = finish
    return t


S = ("web_search", '{"query": "q"}')
B = ("Bash", '{"command": "ls"}')


@pytest.mark.parametrize("t,budget,step", [
    (turn(calls=[S]), True, Step.SEARCH),
    (turn("thinking aloud", calls=[S, S]), True, Step.SEARCH),
    (turn(calls=[S, B]), True, Step.FINAL),             # mixed: the client's turn
    (turn(calls=[B]), True, Step.FINAL),
    (turn("answer"), True, Step.FINAL),
    (turn("answer", calls=[S]), False, Step.FINAL),     # budget spent, has an answer
    (turn(calls=[S]), False, Step.EXHAUSTED),
    (turn(finish=None), True, Step.TRUNCATED),
    (turn(finish="stop"), True, Step.FINAL),            # an empty but finished answer
])
def test_decide(t, budget, step):
    assert decide(t, budget) is step


def test_turn_accumulates_fragments_by_key():
    t = Turn()
    t.call(3, "c1", "web_")
    t.call(3, None, "search")
    for piece in ('{"que', 'ry": "fla', 'sk"}'):
        t.args(3, piece)
    t.call(7, "c2", "Edit")
    t.text("a")
    t.text(None)
    t.text("b")
    t.usage(2)
    t.usage(None)
    t.usage(3)
    assert [c.name for c in t.ours] == ["web_search"] and t.ours[0].query == "flask"
    assert [c.id for c in t.theirs] == ["c2"]
    assert t.content == "ab" and t.usage_out == 5


@pytest.mark.parametrize("args,query", [('{"query": " x "}', " x "), ('{"query": ""}', None),
                                        ("not json", None), ('["x"]', None), ("", None)])
def test_call_query(args, query):
    assert Call(args=args).query == query


class StubSearx:
    def __init__(self):
        self.queries = []

    def search(self, q):
        self.queries.append(q)
        return SearchOutcome(query=q, ok=True, results=[
            {"url": f"https://{h}/{q}", "title": q} for h in ("a.org", "docs.b.org", "c.net")])


class StubMetrics:
    def search(self, kind):
        pass

    def rounds(self, n):
        pass


@pytest.fixture
def make():
    pool = cf.ThreadPoolExecutor(2)

    def make(**kw):
        searx = StubSearx()
        settings = Settings.from_env({}, MAX_SEARCH_ITER=kw.pop("iters", 3))
        return Searcher(settings=settings, searx=searx, metrics=StubMetrics(), executor=pool,
                        **kw), searx
    yield make
    pool.shutdown()


def calls(*queries):
    return [Call(name="web_search", args='{"query": "%s"}' % q) for q in queries]


def test_max_uses_counts_searches_not_rounds(make):
    s, searx = make(max_uses=2)
    done = s.run(calls("a", "b", "c"))
    assert searx.queries == ["a", "b"]
    assert [d.error for d in done] == [None, None, "max_uses_exceeded"]
    assert all(d.call.id for d in done), "ids given to calls that had none"
    assert not s.budget_left and s.searches == 2
    assert "budget is exhausted" in done[-1].text


def test_rounds_bound_and_repeats(make):
    s, searx = make(iters=2)
    s.run(calls("a"))
    assert s.budget_left
    done = s.run(calls("A ", "bad"))
    assert searx.queries == ["a", "bad"]
    assert "already searched" in done[0].text and done[0].outcome is None
    assert not s.budget_left


def test_invalid_arguments(make):
    s, searx = make()
    done = s.run([Call(name="web_search", args="{}")])
    assert done[0].error == "invalid_tool_input" and searx.queries == []


@pytest.mark.parametrize("kw,hosts", [
    ({"allowed": ["b.org"]}, ["docs.b.org"]),
    ({"allowed": ["https://c.net/"]}, ["c.net"]),
    ({"blocked": ["a.org", "c.net"]}, ["docs.b.org"]),
])
def test_domain_filters(make, kw, hosts):
    s, _ = make(**kw)
    done = s.run(calls("q"))
    assert [src.url.split("/")[2] for src in done[0].sources] == hosts


def test_sources_keep_numbers_across_searches_and_cited_order(make):
    s, _ = make()
    first = s.run(calls("x"))[0].sources
    assert [src.n for src in first] == [1, 2, 3]
    srcs = [Source(1, "one", "u1"), Source(2, "two", "u2"), Source(3, "three", "u3")]
    assert [x.n for x in cited("see [3], then [1] and [3] and [9]", srcs)] == [3, 1]
