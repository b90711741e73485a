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
