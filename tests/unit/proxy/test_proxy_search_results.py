import json

import pytest
import responses

from proxy.search.results import Sources, repeated_query_note
from proxy.search.searxng import SearchOutcome, SearxngClient, classify

R = lambda i, url=None, **kw: {"url": url or f"https://e.com/{i}", "title": f"T{i}",  # noqa
                               "content": f"snippet {i}", "engine": "ddg", **kw}


def ok(q, results, **kw):
    return SearchOutcome(query=q, ok=True, results=results, **kw)


def test_numbering_continues_and_dedupes_across_rounds():
    s = Sources()
    t1 = s.format(ok("a", [R(1), R(2, publishedDate="2024-03-04T00:00:00")]))
    assert "[1] T1\n    URL: https://e.com/1\n    snippet 1" in t1
    assert "[2] T2\n    URL: https://e.com/2\n    Date: 2024-03-04\n" in t1
    t2 = s.format(ok("b", [R(3, "http://www.e.com/2/#frag"), R(4)]))
    assert "[3] T4" in t2 and "T3" not in t2 and "1 result(s) already listed" in t2
    assert [x.n for x in s.items] == [1, 2, 3]


def test_answers_and_infobox_first_and_snippet_capped():
    s = Sources(snippet_chars=20)
    t = s.format(ok("q", [R(1, content="y" * 100)], answers=["42"],
                    infoboxes=[{"infobox": "Python", "content": "A language",
                                "id": "https://py.org",
                                "attributes": [{"label": "Typing", "value": "dynamic"}]}]))
    lines = t.splitlines()
    assert lines[1] == "Direct answer: 42"
    assert lines[2].startswith("Infobox: Python — A language — Typing: dynamic — https://py.org")
    snippet = [l for l in lines if l.strip().startswith("y")][0].strip()
    assert len(snippet) == 20 and snippet.endswith("…")


def test_sources_block_cited_or_all():
    s = Sources()
    s.format(ok("a", [R(1), R(2), R(3)]))
    assert s.block("see [2]") == "\n\nSources:\n[2] T2 — https://e.com/2"
    assert s.block("no cites").count("\n[") == 3
    assert Sources().block("x") == ""


def test_failure_and_empty_texts():
    s = Sources()
    f = SearchOutcome(query="q", ok=False, kind="rate_limited", message="blocked (HTTP 429)")
    assert "failed: blocked (HTTP 429)" in s.format(f)
    e = s.format(ok("q", [], suggestions=["q docs"]))
    assert "No results" in e and "q docs" in e
    assert "already searched" in repeated_query_note("q")


SEARX_OK = {"query": "q", "number_of_results": 1, "results": [R(1)], "answers": [],
            "corrections": [], "infoboxes": [], "suggestions": [], "unresponsive_engines": []}


@pytest.mark.parametrize("status,body,kind,words", [
    (403, b"<h1>Forbidden</h1>", "json_disabled", "search.formats"),
    (429, b"Too Many Requests", "rate_limited", "limiter"),
    (500, b"boom", "bad_response", "HTTP 500"),
    (200, b"<html>", "bad_response", "non-JSON"),
    (200, json.dumps({**SEARX_OK, "results": [], "unresponsive_engines":
                      [["google", "timeout"], ["bing", "CAPTCHA"]]}).encode(),
     "engines_failed", "google (timeout), bing (CAPTCHA)"),
])
def test_classify_failures(status, body, kind, words):
    out = classify("q", status, body)
    assert not out.ok and out.kind == kind and words in out.hint


def test_classify_ok_empty_and_answer_objects():
    out = classify("q", 200, json.dumps(SEARX_OK).encode())
    assert out.ok and len(out.results) == 1
    empty = classify("q", 200, json.dumps({**SEARX_OK, "results": []}).encode())
    assert empty.ok and empty.empty
    ans = classify("q", 200, json.dumps({**SEARX_OK, "results": [],
                                         "answers": [{"answer": "7", "url": None}]}).encode())
    assert ans.ok and ans.answers == ["7"] and not ans.empty
    many = classify("q", 200, json.dumps({**SEARX_OK, "results": [R(i) for i in range(9)]}).encode(), 3)
    assert len(many.results) == 3


@responses.activate
def test_client_headers_and_connection_error():
    responses.get("http://searx.test/search", json=SEARX_OK)
    c = SearxngClient("http://searx.test/", results=5, timeout=3)
    out = c.search("q")
    assert out.ok
    req = responses.calls[0].request
    assert req.headers["User-Agent"].startswith("Mozilla/5.0")
    assert "application/json" in req.headers["Accept"]
    assert "format=json" in req.url and "q=q" in req.url
    down = SearxngClient("http://searx-down.test").search("q")   # no mock registered
    assert not down.ok and down.kind == "unreachable"
