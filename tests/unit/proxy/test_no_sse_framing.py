"""No SSE framing in proxy/ (issue 34, part 1): a stream's bytes are framed in
common/sse.py alone, by its reader where they come in and its writer where they go
out; every stage of the proxy sees Events. So no code of proxy/ holds a literal of
the wire's framing (a `data:` or `event:` field, a comment line, the line ends that
end an event) or calls the byte-level helpers of common/sse.py (emit, event,
comment, DONE, KEEPALIVE, Parser, split, batches, events, parse_event...): only the
events' API below."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROXY = sorted((ROOT / "proxy").rglob("*.py"))

# What proxy/ may use of common/sse.py: events, the reader, the writer (Body).
EVENTS_API = {"Event", "Body", "read", "events_of", "keepalive", "done"}
# A field or a comment at the start of a line, or an event's end, in a literal.
FRAMING = re.compile(rb"(^|\n)(data|event|id|retry)\s*:|(^|\n):|\n\n|\r\n|\A\n\Z")


def framing(source: str) -> list[str]:
    """The SSE framing in a module's code: framed literals (docstrings left out)
    and the byte-level helpers of common/sse.py it uses."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and id(n) not in docs:
            v = n.value
            if isinstance(v, bytes) and FRAMING.search(v) or \
                    isinstance(v, str) and re.search(r"(^|\n)(data|event):", v):
                found.append(f"line {n.lineno}: literal {v!r}")
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "sse" and n.attr not in EVENTS_API:
            found.append(f"line {n.lineno}: sse.{n.attr}")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").endswith("sse"):
            found += [f"line {n.lineno}: from {n.module} import {a.name}"
                      for a in n.names if a.name not in EVENTS_API]
        elif isinstance(n, ast.Import):
            found += [f"line {n.lineno}: import {a.name}" for a in n.names
                      if a.name.endswith(".sse")]
    return found


def test_the_check_finds_framing():
    """The check is not vacuous: each way framing crept into proxy/ before is found."""
    for src in ('x = b"data: " + y', 'if b"data:" in piece: pass', 'k = b": keep-alive\\n\\n"',
                'n = whole.count(b"\\n\\n")', 'parts = raw.split(b"\\n")',
                'out = sse.emit(obj) + sse.DONE', 'from common.sse import KEEPALIVE',
                'for w in sse.batches(body): pass', 'ev = sse.parse_event(raw)',
                's = "event: x\\ndata: {}"', 'import common.sse'):
        assert framing(src), src
    assert not framing('evs = [sse.Event.of(obj, "x"), sse.done()]\n'
                       'b = sse.Body(sse.events_of(body))\nok = b\'"usage"\' in ev.raw\n'
                       'text = "\\n\\nSources:\\n" + s\n')


@pytest.mark.parametrize("path", PROXY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sse_framing_in_the_proxy(path):
    assert framing(path.read_text()) == [], \
        f"{path.relative_to(ROOT)} frames SSE itself: leave it to common/sse.py " \
        f"(its reader and its writer) and work on sse.Event"
