"""No import circle among the modules of mta_repro: a module that imports another which
imports it back (directly or around a longer loop) at module level half-initialises one of
them, whichever is imported first. Function-local imports and ``if TYPE_CHECKING:`` blocks
are left out, as Python leaves them out at import time; the layer rule (tests/test_house.py)
covers which way an import may point, this test that no loop closes, in any package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(top: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under ``top``."""
    out = {}
    for p in sorted(top.rglob("*.py")):
        parts = p.relative_to(top.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _module_level(tree: ast.Module):
    """The import statements Python runs when it imports the module: everything outside
    function bodies and ``if TYPE_CHECKING:`` blocks (class bodies and try blocks included)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo += list(ast.iter_child_nodes(node))


def import_graph(top: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports at module level. ``from a import
    b`` points at ``a.b`` where that is a module, else at ``a``; ``import a.b.c`` at the
    longest prefix that is one (relative imports resolved against the module's package)."""
    mods = _modules(top)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    graph = import_graph(ROOT / "mta_repro")
    assert len(graph) > 100 and "mta_repro.mta.hf_insertion" in graph
    # the walk sees the imports it looks for
    assert "mta_repro.mta.modeling_mta" in graph["mta_repro.mta.hf_insertion"]
    assert "mta_repro.mta.hf_layers" in graph["mta_repro.mta.modeling_mta"]
    found = cycles(graph)
    assert not found, "import circles (module-level imports): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_finds_a_circle_and_ignores_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("try:\n    import pkg.sub.c\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "c.py").write_text("class C:\n    from ..a import x\n")  # a -> b -> sub.c -> a
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\ndef f():\n    import pkg.e\n"
    )
    (pkg / "e.py").write_text("import pkg.d\n")  # e -> d only: d's imports of e are lazy or typing-only
    graph = import_graph(pkg)
    assert graph["pkg.e"] == {"pkg.d"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
