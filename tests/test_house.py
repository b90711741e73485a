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
                    ("mta_repro.model", "mta_repro.kernels")
                ):
                    sub = n.module.split(".")[1]
                    mod = n.module.split(".")[2] if n.module.count(".") >= 2 else None
                    deps |= {mod} if mod else {a.name for a in n.names if (pkg / sub / f"{a.name}.py").exists()}
        graph[f.stem] = deps - {f.stem}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in graph.get(a, ()))

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, {m: graph[m] for m in cycles}
    assert {"attention_ops", "transformer", "interface", "kq_conv_cpu"} <= set(graph)


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


# The layers, bottom to top (docs/architecture.md draws the same order): a module imports only
# modules of its own layer or of the layers below it. The leaves are imported by no core
# module; each imports the core freely, and another leaf only as LEAF_DEPS says.
LAYERS = [
    (
        "foundation",
        {"mta_repro", "errors", "device", "files", "dataclass_config", "cli", "resolvers", "resources", "slurm"},
    ),
    ("kernels", {"kernels"}),
    ("model", {"model"}),
    ("weights", {"weights"}),
    ("data", {"data"}),
    ("estimate", {"estimate"}),
    ("train", {"train"}),
    ("eval", {"eval"}),
    ("report", {"report"}),
    ("pipeline", {"pipeline"}),
]
LEAVES = {"hf", "release", "toy", "mta", "experimental"}
LEAF_DEPS: dict[str, set[str]] = {}
# An entry point's module that imports above its layer, and only these modules: nothing but the
# package's __main__ imports it (python -m mta_repro.estimate composes the training config and
# reads release YAMLs; the trainer calls the estimate's pre-flight, so estimate sits below train)
ENTRY_DEPS = {"estimate.cli": {"release", "train.config"}}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mta_repro"


def _layer(part: str):
    for i, (_, names) in enumerate(LAYERS):
        if part in names:
            return i
    return None


def test_every_import_of_the_package_points_down_the_layers():
    """Walk every import of every module (top level, lazy, TYPE_CHECKING, relative, importlib
    calls): none points up the layer order, no core module imports a leaf, and a leaf imports
    another leaf only where LEAF_DEPS says. No allow-list of known cycles.

    pyproject.toml's import-linter contracts (`make check`) check the same layers, and more:
    indirect chains and cycles inside each package. The walk stays for what grimp, import-linter's
    graph, does not see: a module named in a string to importlib.import_module, __import__,
    importlib.util.find_spec or runpy.run_module. It also runs in pytest without import-linter."""
    pkg = ROOT / "mta_repro"
    files = sorted(pkg.rglob("*.py"))
    parts = {p.relative_to(pkg).parts[0].removesuffix(".py") for p in files}
    parts.discard("__init__")
    unknown = parts - {n for _, names in LAYERS for n in names} - LEAVES
    assert not unknown, f"place these in LAYERS or LEAVES (and docs/architecture.md): {sorted(unknown)}"
    bad = []
    for f in files:
        rel = f.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        src = _part(module)
        for m in _every_import(f):
            if not (m == "mta_repro" or m.startswith("mta_repro.")):
                continue
            if module.removeprefix("mta_repro.") in ENTRY_DEPS:
                allowed = ENTRY_DEPS[module.removeprefix("mta_repro.")]
                if any(m == f"mta_repro.{a}" or m.startswith(f"mta_repro.{a}.") for a in allowed):
                    continue
            elif any(m == f"mta_repro.{e}" for e in ENTRY_DEPS) and rel.name != "__main__.py":
                bad.append(f"{rel} -> {m} (an entry point's module, imported only by its __main__)")
            dst = _part(m)
            if dst == src or dst not in parts | {"mta_repro"}:
                continue  # its own part, or a name imported from the root package (__version__)
            if src in LEAVES:
                if dst in LEAVES and dst not in LEAF_DEPS.get(src, ()):
                    bad.append(f"{rel} -> {m} (a leaf imports another leaf)")
            elif dst in LEAVES:
                bad.append(f"{rel} -> {m} (a core layer imports a leaf)")
            elif _layer(dst) > _layer(src):
                bad.append(f"{rel} -> {m} ({LAYERS[_layer(src)][0]} imports {LAYERS[_layer(dst)][0]}, above it)")
    assert not bad, "\n".join(bad)


def test_the_layer_order_is_the_one_docs_architecture_draws():
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    drawn = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S).group(1)
    rows = [line.split("|")[1:3] for line in drawn.strip().splitlines()[2:]]  # | layer | modules | ...
    assert [(name.strip(), set(re.findall(r"`([\w.]+)`", mods))) for name, mods in rows] == LAYERS


def test_the_import_linter_contract_has_the_same_layers():
    """pyproject.toml's [tool.importlinter] layers contract (top to bottom) is LAYERS (bottom to
    top) under the leaves, with LEAF_DEPS and ENTRY_DEPS as its only ignored imports."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    rows = [set(re.split(r"\s*[|:]\s*", row)) for row in layers["layers"]]
    core = [names - {"mta_repro"} for _, names in LAYERS]  # the root package is the container
    assert rows == [LEAVES, *reversed(core)]
    assert layers["layers"][0].count("|") == len(LEAVES) - 1  # the leaves are independent
    assert layers["exhaustive"] is True
    ignored = {tuple(i.split(" -> ")) for i in layers["ignore_imports"]}
    assert ignored == {(f"mta_repro.{a}.**", f"mta_repro.{b}") for a, deps in LEAF_DEPS.items() for b in deps} | {
        (f"mta_repro.{a}", f"mta_repro.{b}") for a, deps in ENTRY_DEPS.items() for b in deps
    }
    assert any(c["type"] == "acyclic_siblings" and c["ancestors"] == ["mta_repro"] for c in config["contracts"])
