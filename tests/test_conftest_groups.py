"""The parallel suite builds each shared fixture once: every test module that defines a
module-, package- or session-scoped fixture is listed in conftest.SHARED_FIXTURE_MODULES, so
that pytest-xdist keeps its tests on one worker (a module's fixture is otherwise built again
on every worker that runs one of its tests: minutes for the tiny pipeline)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _root_conftest(pytestconfig):
    """tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's)."""
    return next(p for p in pytestconfig.pluginmanager.get_plugins()
                if getattr(p, "__file__", None) == str(TESTS / "conftest.py"))


def _shared_scope(decorator: ast.expr) -> bool:
    if not (isinstance(decorator, ast.Call) and "fixture" in ast.unparse(decorator.func)):
        return False
    return any(k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in ("module", "package", "session")
               for k in decorator.keywords)


def test_every_module_with_a_shared_fixture_is_one_group(pytestconfig):
    found = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        if any(_shared_scope(d) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               for d in node.decorator_list):
            found.add(path.relative_to(TESTS).as_posix())
    assert found == _root_conftest(pytestconfig).SHARED_FIXTURE_MODULES


def test_a_shared_fixture_module_runs_on_one_xdist_worker():
    """The marks take effect: on two workers with --dist loadgroup, every test of such a
    module carries its group and runs on the same worker (pytest-xdist reads the marks in its
    own collection hook; conftest's must run before it)."""
    import re
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", str(TESTS / "test_train_rundir.py"), "-k", "stale_locks or write_config_is_atomic"],
                       cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ran = re.findall(r"\[(gw\d+)\] .*PASSED (\S+)", p.stdout)
    assert len(ran) == 2, p.stdout[-2000:]
    assert len({w for w, _ in ran}) == 1 and all(n.endswith("@test_train_rundir.py") for _, n in ran), ran
