"""The house rules a maintainer relies on, checked on the tree itself (CONTRIBUTING.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_function_in_the_trainer_is_over_60_lines():
    """mta_repro/train reads in one sitting: the loop is run -> build_state / train_steps /
    finish, each a screen at most."""
    long = []
    for p in sorted((ROOT / "mta_repro" / "train").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{p.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_fault_injection_reads_the_environment_in_product_code():
    """Faults are installed by the tests (checkpoint.save_hook), never read from an
    environment variable in the save path."""
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "mta_repro").rglob("*.py") if "MTA_REPRO_FAULT" in p.read_text()]
    assert not hits, hits


def test_scripts_edit_no_sys_path():
    """The scripts import the installed package (and scripts/benchlib.py from their own
    folder): none edits sys.path."""
    hits = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if "sys.path.insert(" in p.read_text()]
    assert not hits, hits


def test_every_environment_variable_the_package_reads_is_in_the_one_table():
    """docs/environment.md lists each MTA_* variable read anywhere in mta_repro."""
    import re

    read = set()
    for p in (ROOT / "mta_repro").rglob("*.py"):
        text = p.read_text()
        read |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"'](MTA_[A-Z_]+)", text))
        read |= set(re.findall(r"_ENV\s*=\s*[\"'](MTA_[A-Z_]+)", text))
    table = set(re.findall(r"^\| `(MTA_[A-Z_]+)", (ROOT / "docs" / "environment.md").read_text(), flags=re.M))
    assert read and read <= table, sorted(read - table)


def test_every_kernel_tuning_field_is_in_the_one_table_and_no_removed_variable():
    """The same table lists each model.kernels field (KernelTuning) as a row, and none of the
    environment variables those fields replaced (they are refused, not read)."""
    import dataclasses
    import re

    from mta_repro.kernels.types import REMOVED_ENV, KernelTuning

    text = (ROOT / "docs" / "environment.md").read_text()
    rows = set(re.findall(r"^\| `model\.kernels\.(\w+)=", text, flags=re.M))
    assert rows == {f.name for f in dataclasses.fields(KernelTuning)}
    env_rows = set(re.findall(r"^\| `(MTA_[A-Z_]+)", text, flags=re.M))
    assert not env_rows & set(REMOVED_ENV), sorted(env_rows & set(REMOVED_ENV))


def _imports(path: Path) -> set[str]:
    """Every mta_repro module a file imports, wherever the import sits: at the top, inside a
    function (lazy) or under ``if TYPE_CHECKING`` (all are arrows of the import graph)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("mta_repro")}


def test_the_kernels_import_neither_the_model_nor_the_estimates():
    """mta_repro.kernels is a leaf: the model picks a kernel and the estimates judge one, never
    the reverse, so no arrow (lazy or TYPE_CHECKING ones included) runs back to them and no
    model <-> kernel circle can form."""
    bad = {f"{p.name} -> {m}" for p in sorted((ROOT / "mta_repro" / "kernels").glob("*.py"))
           for m in _imports(p) if m.startswith(("mta_repro.model", "mta_repro.estimate", "mta_repro.train"))}
    assert not bad, sorted(bad)
    bad = {f"{p.name} -> {m}" for p in sorted((ROOT / "mta_repro" / "model").glob("*.py"))
           for m in _imports(p) if m.startswith(("mta_repro.estimate", "mta_repro.train"))}
    assert not bad, sorted(bad)


def test_the_estimates_live_in_their_own_package():
    """Memory, parameter and FLOP estimates sit in mta_repro/estimate, not at the package root
    or inside the model (the roofline judge of compiled kernels is the experiment's own)."""
    stray = [p for p in ("mta_repro/memory.py", "mta_repro/params.py", "mta_repro/model/flops.py",
                         "mta_repro/model/roofline.py", "mta_repro/estimate/roofline.py") if (ROOT / p).exists()]
    assert not stray, stray
    assert {"memory.py", "params.py", "flops.py"} <= {p.name for p in (ROOT / "mta_repro" / "estimate").glob("*.py")}
    assert (ROOT / "mta_repro" / "experimental" / "fused_triton" / "roofline.py").exists()


def test_the_model_and_the_kernels_import_without_a_cycle():
    """No import cycle among the modules of mta_repro/model and mta_repro/kernels at module
    level (function-local imports and ``if TYPE_CHECKING:`` blocks excluded; the test above
    forbids those from the kernels to the model)."""
    pkg = ROOT / "mta_repro"
    graph = {}
    for f in [*(pkg / "model").glob("*.py"), *(pkg / "kernels").glob("*.py")]:
        deps = set()
        for node in ast.parse(f.read_text()).body:  # module level only
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
                        ("mta_repro.model", "mta_repro.kernels")):
                    sub = n.module.split(".")[1]
                    mod = n.module.split(".")[2] if n.module.count(".") >= 2 else None
                    deps |= {mod} if mod else {a.name for a in n.names if (pkg / sub / f"{a.name}.py").exists()}
        graph[f.stem] = deps - {f.stem}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in graph.get(a, ()))

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, {m: graph[m] for m in cycles}
    assert {"attention_ops", "transformer", "types", "kq_conv_cpu"} <= set(graph)


EXPERIMENTAL = "mta_repro.experimental"
_IMPORT_CALLS = ("import_module", "__import__", "find_spec", "run_module")


def _every_import(path: Path) -> set[str]:
    """Every module a file imports anywhere (top level, inside a function, under ``if
    TYPE_CHECKING``; relative imports resolved against the file's package), and every string
    it hands to importlib.import_module, __import__, find_spec or runpy.run_module."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _IMPORT_CALLS:
                out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_nothing_outside_the_experiments_imports_one():
    """The dependency on an experiment runs one way (mta_repro/experimental/__init__.py): no
    module of the package outside mta_repro/experimental, no script and no test outside
    tests/experimental imports one, by any import statement or import call; an experiment
    is reached by name only (the registry's entry points, pyproject.toml)."""
    files = [p for p in sorted((ROOT / "mta_repro").rglob("*.py")) if "experimental" not in p.relative_to(ROOT).parts]
    files += sorted((ROOT / "scripts").glob("*.py"))
    files += [p for p in sorted((ROOT / "tests").rglob("*.py")) if "experimental" not in p.relative_to(ROOT).parts]
    assert len(files) > 150
    bad = {f"{p.relative_to(ROOT)} -> {m}" for p in files for m in _every_import(p)
           if m == EXPERIMENTAL or m.startswith(EXPERIMENTAL + ".")}
    assert not bad, sorted(bad)
    # the walk sees what it looks for: an experiment's own modules import one another
    seen = _every_import(ROOT / "mta_repro" / "experimental" / "fused_triton" / "impl.py")
    assert any(m.startswith(EXPERIMENTAL + ".") for m in seen), seen
