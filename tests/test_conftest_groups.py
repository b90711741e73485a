"""The parallel suite builds each shared fixture once: the tests of every module that defines
a module-, package- or session-scoped fixture are grouped on one pytest-xdist worker by
tests/conftest.py's rule (a module's fixture is otherwise built again on every worker that
runs one of its tests: minutes for the tiny pipeline)."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _root_conftest(pytestconfig):
    """tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's)."""
    return next(
        p
        for p in pytestconfig.pluginmanager.get_plugins()
        if getattr(p, "__file__", None) == str(TESTS / "conftest.py")
    )


def _shared_scope(decorator: ast.expr) -> bool:
    if not (isinstance(decorator, ast.Call) and "fixture" in ast.unparse(decorator.func)):
        return False
    return any(
        k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in ("module", "package", "session")
        for k in decorator.keywords
    )


def test_every_module_with_a_shared_fixture_is_one_group(pytestconfig, request):
    """Read off the source: each collected module that defines such a fixture (and uses it)
    was grouped by the rule in this session."""
    collected = {Path(str(i.path)).relative_to(TESTS).as_posix() for i in request.session.items}
    found = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(
            _shared_scope(d)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            for d in node.decorator_list
        ):
            found.add(path.relative_to(TESTS).as_posix())
    assert found & collected <= _root_conftest(pytestconfig).GROUPED
    assert len(found) >= 8  # the walk sees the modules it looks for


@pytest.mark.slow
def test_a_shared_fixture_module_runs_on_one_xdist_worker():
    """The marks take effect: on two workers with --dist loadgroup, the tests that use such a
    module's fixture carry its group and run on the same worker (pytest-xdist reads the marks
    in its own collection hook; conftest's must run before it); a test of the module that does
    not use the fixture is free to run on either."""
    import re
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            str(TESTS / "test_train_rundir.py"),
            "-k",
            "stale_locks or live_holder or write_config_is_atomic",
        ],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ran = re.findall(r"\[(gw\d+)\] .*PASSED (\S+)", p.stdout)
    assert len(ran) == 3, p.stdout[-2000:]
    grouped = [(w, n) for w, n in ran if n.endswith("@test_train_rundir.py")]
    assert len(grouped) == 2 and len({w for w, _ in grouped}) == 1, ran
    assert all("stale_locks" in n or "live_holder" in n for _, n in grouped), ran
