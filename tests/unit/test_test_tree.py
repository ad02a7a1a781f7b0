"""The test tree's own rules (issue 34): helpers live in tests/support/ or in
fixtures, never imported from another test module, and each exists once."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LEVELS = ("unit", "integration", "e2e", "reliability")


def modules():
    for path in sorted(TESTS.rglob("*.py")):
        yield path.relative_to(TESTS.parent), ast.parse(path.read_text(), str(path))


def imported(tree: ast.AST):
    """(line, module) of every import in a module, nested ones included; a relative
    import as written (dots first)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or "")


def test_no_module_imports_from_a_test_folder():
    bad = []
    for rel, tree in modules():
        in_support = rel.parts[:2] == ("tests", "support")
        for line, name in imported(tree):
            if name.split(".")[:2] in [["tests", level] for level in LEVELS]:
                bad.append(f"{rel}:{line}: {name}")
            elif name.startswith(".") and not in_support:
                bad.append(f"{rel}:{line}: {name} (relative)")
    assert not bad, "helpers belong in tests/support/ or a fixture:\n" + "\n".join(bad)


def test_one_wait_helper_and_one_unit_env():
    waits, envs = [], []
    for rel, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("wait_for", "wait_until"):
                waits.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "TESTBED_BASE_IMAGE"
                    for k in node.value.keys):
                envs.append(f"{rel}:{node.lineno}")
    assert [w.split(":")[0] for w in waits] == ["tests/support/servers.py"], waits
    assert [e.split(":")[0] for e in envs] == ["tests/support/swapperproc.py"], envs


def test_the_heavy_files_scheduled_first_exist_and_go_first():
    """tests/conftest.py's HEAVY names files: a renamed one would silently lose
    its place at the front of the workers' queue."""
    from types import SimpleNamespace

    from tests.conftest import HEAVY, heavy_first
    assert len(set(HEAVY)) == len(HEAVY)
    for path in HEAVY:
        assert (TESTS.parent / path).is_file(), path
    items = [SimpleNamespace(nodeid=n) for n in (
        "tests/unit/a.py::t1", "tests/unit/a.py::t2", HEAVY[1] + "::x", "tests/unit/b.py::t",
        HEAVY[0] + "::y", HEAVY[1] + "::z")]
    heavy_first(items)
    assert [i.nodeid for i in items] == [
        HEAVY[0] + "::y", HEAVY[1] + "::x", HEAVY[1] + "::z", "tests/unit/a.py::t1",
        "tests/unit/a.py::t2", "tests/unit/b.py::t"]
