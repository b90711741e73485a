"""The house rules a maintainer relies on, checked on the tree itself (CONTRIBUTING.md)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_module_docstrings_outside_the_experiments_are_short():
    """A module docstring says what and why in at most 25 lines; measurement history belongs
    in docs/ (with the command that measured it) or in commit bodies."""
    long = []
    for p in sorted((ROOT / "mta_repro").rglob("*.py")):
        if "experimental" in p.relative_to(ROOT).parts:
            continue
        tree = ast.parse(p.read_text())
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            n = first.end_lineno - first.lineno + 1
            if n > 25:
                long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not long, long


def test_the_prose_cites_nothing_a_reader_does_not_have():
    """No issue-tracker numbers, borrowed machines or notes the repository does not ship, in the
    package, scripts, docs, tests, README or CONTRIBUTING (the history lives in commit bodies)."""
    import re

    notes = "|".join(
        n + "_" + s + ".md"
        for n, s in (("PERF", "NOTES"), ("MTA", "SPEC"), ("GPU", "REVIEW"), ("GPU", "FLOORS"), ("OFFLINE", "NOTES"))
    )
    pattern = re.compile(
        r"\bissues? ?#?\d+\b|#\d{2}\b(?! *\))|\blent\b|\bspec section\b|\bthe spec'?s?\b|" + notes, re.I
    )
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("mta_repro", "scripts", "tests"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md", ".sh", ".c", ".yaml")]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


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


def test_every_kernel_tuning_field_is_in_the_one_table():
    """The same table lists each model.kernels field (KernelTuning) as a row."""
    import dataclasses
    import re

    from mta_repro.kernels.tuning import KernelTuning

    text = (ROOT / "docs" / "environment.md").read_text()
    rows = set(re.findall(r"^\| `model\.kernels\.(\w+)=", text, flags=re.M))
    assert rows == {f.name for f in dataclasses.fields(KernelTuning)}


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


def _import_call_names(path: Path) -> set[str]:
    """The strings a file hands to importlib.import_module, __import__, find_spec or run_module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
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
    bad = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in files
        for m in _every_import(p)
        if m == EXPERIMENTAL or m.startswith(EXPERIMENTAL + ".")
    }
    assert not bad, sorted(bad)
    # the walk sees what it looks for: an experiment's own modules import one another (where
    # the tree has them: scripts/check_without_experimental.sh runs the tests without)
    impl = ROOT / "mta_repro" / "experimental" / "fused_triton" / "impl.py"
    if impl.is_file():
        seen = _every_import(impl)
        assert any(m.startswith(EXPERIMENTAL + ".") for m in seen), seen


# The layers are stated once, as pyproject.toml's import-linter contracts (`make check`;
# test_the_import_contracts_hold runs them under pytest); the tests below read them from there.
def _layers_contract() -> dict:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers


def _layers() -> tuple[list[set[str]], set[str], set[tuple[str, str]]]:
    """(the core layers bottom to top, each a set of top-level names with the root package
    as ``mta_repro``; the leaves; the (leaf, leaf) imports the contract ignores)."""
    rows = _layers_contract()["layers"]  # top to bottom; the first row is the leaves, "|"-separated
    leaves = set(re.split(r"\s*\|\s*", rows[0]))
    core = [set(re.split(r"\s*[|:]\s*", row)) for row in reversed(rows[1:])]
    core[0].add("mta_repro")  # the root package's own __init__ sits with the foundation
    ignored = set()
    for rule in _layers_contract().get("ignore_imports", []):
        src, dst = (x.strip().removeprefix("mta_repro.").split(".")[0] for x in rule.split("->"))
        ignored.add((src, dst))
    return core, leaves, ignored


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mta_repro"


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts (imports point down the layers, no leaf imports
    another, every subpackage placed, no import cycle among the siblings of any package),
    run by import-linter itself on this tree, so that pytest alone enforces them."""
    pytest.importorskip("importlinter")
    import os
    import subprocess
    import sys

    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's package, not an installed copy
    p = subprocess.run(
        [sys.executable, "-c", code, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and "0 broken" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]


def test_modules_named_in_import_calls_point_down_the_layers():
    """What import-linter's graph (grimp) does not see: a module named in a string to
    importlib.import_module, __import__, importlib.util.find_spec or runpy.run_module. Each
    such name must obey the same layers (read from pyproject.toml): not up the layer order,
    no core module naming a leaf, no leaf naming another except where the contract ignores it."""
    core, leaves, ignored = _layers()

    def layer(part):
        return next((i for i, names in enumerate(core) if part in names), None)

    pkg = ROOT / "mta_repro"
    bad = []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(ROOT)
        src = _part(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
        for m in _import_call_names(f):
            if not (m == "mta_repro" or m.startswith("mta_repro.")):
                continue
            dst = _part(m)
            if dst == src:
                continue
            if src in leaves:
                if dst in leaves and (src, dst) not in ignored:
                    bad.append(f"{rel} -> {m} (a leaf names another leaf)")
            elif dst in leaves:
                bad.append(f"{rel} -> {m} (a core layer names a leaf)")
            elif layer(dst) is None or layer(src) is None:
                bad.append(f"{rel} -> {m} (not placed in pyproject.toml's layers)")
            elif layer(dst) > layer(src):
                bad.append(f"{rel} -> {m} (a layer names one above it)")
    assert not bad, "\n".join(bad)


def test_the_import_call_walk_sees_what_it_looks_for(tmp_path):
    """The package names no module in an import call today, so the walk above is shown here
    to find one (and to leave other calls alone)."""
    f = tmp_path / "m.py"
    f.write_text(
        "import importlib, runpy\n"
        "def load():\n"
        "    importlib.import_module('mta_repro.report')\n"
        "    runpy.run_module('mta_repro.pipeline')\n"
        "    print('mta_repro.eval')\n"
    )
    assert _import_call_names(f) == {"mta_repro.report", "mta_repro.pipeline"}


def test_the_layer_order_is_the_one_docs_architecture_draws():
    """docs/architecture.md's table of layers (bottom to top) and its leaves are the
    contract's, so a package added to pyproject.toml is drawn there too."""
    core, leaves, _ = _layers()
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawn = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S).group(1)
    rows = [line.split("|")[2] for line in drawn.strip().splitlines()[2:]]  # | layer | modules | ...
    assert [set(re.findall(r"`([\w.]+)`", mods)) for mods in rows] == core
    after = text.split("<!-- /layers -->", 1)[1].strip().split("\n\n", 1)[0]  # the paragraph on the leaves
    assert set(re.findall(r"`(\w+)`", after)) >= leaves


def test_only_its_main_imports_the_estimate_command_line():
    """``estimate/cli.py`` is the one module that imports above its layer (pyproject.toml's
    contracts name its two imports in ignore_imports): it composes the training config and
    reads release YAMLs for ``python -m mta_repro.estimate``. No other module may import it,
    or the trainer's pre-flight (below ``train``) would reach ``train`` through it."""
    import ast

    pkg = ROOT / "mta_repro"
    importers = set()
    for f in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if "mta_repro.estimate.cli" in names:
                importers.add(f.relative_to(ROOT).as_posix())
    assert importers == {"mta_repro/estimate/__main__.py"}
