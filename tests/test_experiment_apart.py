"""The experiments stay apart from the core: nothing in the package outside
mta_repro/experimental/ nor in configs/ names the experimental fused Triton kernels (their
module, their options, a config asking for them), so deleting mta_repro/experimental/ leaves
nothing dead behind. The one link is the entry point in pyproject.toml, by name; what a tree
without the experiments does with it, and its fast tier there, is
scripts/check_without_experimental.sh (run by .ci/run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mta_repro.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# What only the experiment defines: its package, its options (as the core's fields were once
# named and as they are set now), and a config or command asking for the implementation.
NAMES = re.compile(
    r"fused_triton|triton_frame|triton_programs|triton_slab_rows|impl_options\.triton|"
    r"attn_impl\s*[=:]\s*['\"]?triton\b|mta_repro\.experimental\.\w"
)


def _core_files() -> list[Path]:
    package = [
        p
        for p in (ROOT / "mta_repro").rglob("*")
        if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".c", ".txt")
        if "experimental" not in p.relative_to(ROOT).parts
    ]
    return sorted(package) + sorted(p for p in (ROOT / "configs").rglob("*") if p.is_file())


def test_the_core_and_its_configs_do_not_name_the_experiment():
    files = _core_files()
    assert len(files) > 100 and any(p.suffix == ".yaml" for p in files)
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if NAMES.search(line)
    ]
    assert not found, "\n".join(found)
    # the pattern finds what it looks for: the experiment's own code names itself (where the
    # tree has it: scripts/check_without_experimental.sh runs this without)
    impl = ROOT / "mta_repro" / "experimental" / "fused_triton" / "impl.py"
    assert NAMES.search(impl.read_text()) if impl.is_file() else True


def test_the_one_link_is_the_documented_entry_point():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["mta_repro.attn_impls"] == {
        "triton": "mta_repro.experimental.fused_triton.impl:IMPL"
    }


def test_an_entry_point_naming_a_missing_module_fails_only_when_asked_for(monkeypatch):
    """A tree without the experiment still has the installed entry point: importing the
    registry, listing the names and building a model that does not ask for it work; asking
    for it is one line naming model.attn_impl and the missing module."""
    import importlib.metadata as md

    from mta_repro.model import ModelArgs, attention_registry

    gone = md.EntryPoint(
        name="gone", value="no_such_experiment_module.impl:IMPL", group=attention_registry.ENTRY_POINTS
    )
    monkeypatch.setattr(md, "entry_points", lambda **selection: md.EntryPoints([gone]))
    assert "gone" in attention_registry.attn_impl_names()
    assert ModelArgs().attn_impl == "blocked"
    with pytest.raises(UserError) as e:
        ModelArgs(attn_impl="gone")
    message = str(e.value)
    assert message.startswith("model.attn_impl='gone': its implementation no_such_experiment_module.impl:IMPL")
    assert "does not load: No module named 'no_such_experiment_module'" in message and "\n" not in message
