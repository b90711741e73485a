"""The parallel suite builds each shared fixture once: every test module that defines a
module-, package- or session-scoped fixture is listed in conftest.SHARED_FIXTURE_MODULES, so
that pytest-xdist keeps its tests on one worker (a module's fixture is otherwise built again
on every worker that runs one of its tests: minutes for the tiny pipeline)."""

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def _shared_scope(decorator: ast.expr) -> bool:
    if not (isinstance(decorator, ast.Call) and "fixture" in ast.unparse(decorator.func)):
        return False
    return any(k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in ("module", "package", "session")
               for k in decorator.keywords)


def test_every_module_with_a_shared_fixture_is_one_group():
    found = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(_shared_scope(d) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               for d in node.decorator_list):
            found.add(path.relative_to(TESTS).as_posix())
    assert found == conftest.SHARED_FIXTURE_MODULES
