"""docs/mta_op.md's examples run as written: every ```python block of the page, in order,
each in a fresh namespace, in a temporary working directory (the Hugging Face example saves
a folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "mta_op.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def test_the_page_has_the_two_examples():
    found = blocks()
    assert len(found) == 2, len(found)
    assert "MultiTokenAttention(" in found[0] and "apply_mta(" in found[1]
    for code in found:  # about twenty lines each, as the page promises
        assert len(code.strip().splitlines()) <= 30


def test_the_custom_model_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks()[0], f"{PAGE}:example 1", "exec"), {"__name__": "__docs__"})
    assert "mta_kernel" in capsys.readouterr().out


def test_the_hugging_face_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks()[1], f"{PAGE}:example 2", "exec"), {"__name__": "__docs__"})
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines() if re.match(r"\d ", line)]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert (tmp_path / "llama_mta" / "modeling_mta.py").is_file()
