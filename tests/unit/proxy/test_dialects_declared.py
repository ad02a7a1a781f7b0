"""The dialects as declared objects: every Wire (common/dialects.py) has its module
in proxy/dialects/ declaring a whole Dialect, and what routes, shapes, counts, lists
or admits a dialect's requests is built from the declarations, never from a
dialect named in its code -- so a fourth dialect is its Wire and its module."""
import ast
import inspect
import pathlib

import pytest

from common import dialects as wires
from common import sse
from proxy import activity, app as proxy_app, dialects, metrics, progress, routes
from proxy.dialects.base import Adapter, Dialect
from swapper import intake

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The code that reads the declarations: none of it may name a dialect.
READERS = ["proxy/routes.py", "proxy/app.py", "proxy/metrics.py", "proxy/activity.py",
           "proxy/dialects/__init__.py", "proxy/progress.py", "swapper/intake.py",
           "common/sse.py"]


def test_every_wire_has_its_declared_dialect_in_order():
    assert [d.wire for d in dialects.ALL] == list(wires.WIRES)
    assert [d.name for d in dialects.ALL] == [w.name for w in wires.WIRES]
    assert len({w.name for w in wires.WIRES}) == len(wires.WIRES)
    assert dialects.BY_NAME == {d.name: d for d in dialects.ALL}


@pytest.mark.parametrize("d", dialects.ALL, ids=lambda d: d.name)
def test_every_dialect_has_every_part(d):
    assert isinstance(d, Dialect)
    w = d.wire
    assert w.paths and all(p.startswith("/v1/") for p in w.paths)
    assert w.usage({}) == (None, None)
    assert w.backend and w.conversation and set(w.conversation) <= set(w.backend)
    assert all(callable(getattr(d, f)) for f in (
        "parse", "system_prompt", "search_tool", "straight_stream", "straight_whole",
        "stream_error", "flatten", "agent_fix"))
    assert d.floor_keys and all(isinstance(k, str) for k in d.floor_keys)
    assert issubclass(d.adapter, Adapter) and d.adapter.path == w.path
    assert issubclass(d.progress, progress.Progress)
    assert d.progress.tick is not progress.Progress.tick
    # its progress events are events with data, which agents' timers count
    events = d.progress({"model": "m"}).tick("loading")
    assert events and all(ev.progress for ev in events)    # not the answer's first token
    tick = b"".join(sse.write([events]))                      # as the writer sends them
    assert tick.endswith(b"\n\n") and b"data: {" in tick


@pytest.mark.parametrize("d", [d for d in dialects.ALL if d.adapter.ON], ids=lambda d: d.name)
def test_a_relay_table_maps_event_types_to_handlers(d):
    ad = d.adapter
    assert all(isinstance(k, str) and callable(v) for k, v in ad.ON.items())
    # each handler is a method of the adapter's own (its table is not inherited)
    assert all(getattr(ad, v.__name__) is v for v in ad.ON.values())


def test_the_readers_are_built_from_the_declarations():
    app = proxy_app.create_app()
    rules = {r.rule: r for r in app.url_map.iter_rules()}
    root = app.test_client().get("/").get_json()["endpoints"]
    for d in dialects.ALL:
        w = d.wire
        for p in w.paths:                        # the proxy serves each route
            assert rules[p].endpoint == f"proxy.{d.name}" and "POST" in rules[p].methods
        assert w.path in root
        assert metrics.route_label(w.path) == w.path
        assert metrics.TOKEN_ROUTES[w.path] is w.usage
        assert activity.DIALECTS[w.path] == w.name
        for route, methods in w.backend.items():   # the swapper admits its routes
            assert intake.V1_ROUTES[route] == methods
        for route, key in w.conversation.items():
            assert intake._CONVERSATION[route] == key
        assert wires.wire_of(w.path) is w
        if w.error_event is not None:
            assert wires.error_event(w.path, "m", 500, "c") == w.error_event("m", 500, "c")
    for alias in (p for d in dialects.ALL for p in d.paths[1:]):
        assert routes._unaliased(alias + "/x").endswith("/x")


def test_an_error_on_a_dialects_route_takes_its_shape():
    from flask import Response
    for w in wires.WIRES:
        resp = dialects.shaped(Response(b'{"error":{"message":"no"}}', status=400),
                               w.paths[-1])
        want = w.error(b'{"error":{"message":"no"}}', 400) if w.error else None
        assert resp.get_data() == (want or b'{"error":{"message":"no"}}')


def _code_strings(path: str) -> set[str]:
    """The string constants of a module's code (its docstrings left out)."""
    tree = ast.parse((ROOT / path).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs}


@pytest.mark.parametrize("path", READERS)
def test_no_reader_names_a_dialect(path):
    named = set()
    for w in wires.WIRES:
        named |= {w.name, *w.paths, *w.backend, *w.conversation}
    assert not _code_strings(path) & named


def test_the_readers_import_no_dialect_module():
    for path in READERS:
        src = (ROOT / path).read_text()
        for m in ("chat", "anthropic", "responses"):
            assert f"import {m}\n" not in src and f"dialects.{m} " not in src, (path, m)
    # the package finds its dialects: it lists none of them
    assert "from . import" not in inspect.getsource(dialects)
