"""Reports: tables with the paper's numbers alongside, CSV/LaTeX, and the PNG plots."""

import csv
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "eval"))
from eval_helpers import make_run  # noqa: E402

from mta_repro.report.__main__ import build_report, main  # noqa: E402


def write_evals(run_dir: Path, variant: str, ppl_scale: float):
    ev = run_dir / "eval"
    ev.mkdir(parents=True, exist_ok=True)
    doms = {"book": 20.0 * ppl_scale, "github": 8.0 * ppl_scale}
    import math

    ppl = {"domains": {d: {"ppl": p, "loss": math.log(p), "tokens": 100} for d, p in doms.items()},
           "average": sum(doms.values()) / 2}
    common = {"variant": variant, "step": 7}
    (ev / "ppl.json").write_text(json.dumps({"task": "ppl", **common, "results": ppl}))
    needle = {"accuracy": {"2048": {"2": {"by_depth": {"0": 1.0, "50": 0.5, "100": 0.0}, "mean": 0.5},
                                    "4": {"by_depth": {"0": 0.5, "50": 0.25, "100": 0.0}, "mean": 0.25}}}}
    (ev / "needle.json").write_text(json.dumps({"task": "needle", **common, "results": needle}))
    bab = {"accuracy": {"qa1": {"0k": 0.5, "1k": 0.25}, "qa2": {"0k": 0.75, "1k": 0.5}},
           "mean": {"0k": 0.625, "1k": 0.375}}
    (ev / "babilong.json").write_text(json.dumps({"task": "babilong", **common, "results": bab}))
    bench = {"tasks": {}, "summary": {"piqa": 60.0, "hellaswag": 30.0, "mmlu": 25.0, "average": 115 / 3}}
    (ev / "benchmarks.json").write_text(json.dumps({"task": "benchmarks", **common, "results": bench}))
    lam = {"tasks": {}, "summary": {"lambada_standard": {"ppl": 50.0, "acc": 10.0},
                                    "lambada_openai": {"ppl": 30.0, "acc": 12.0}}}
    (ev / "lambada.json").write_text(json.dumps({"task": "lambada", **common, "results": lam}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, 21):
            f.write(json.dumps({"step": s, "loss": 6.0 * ppl_scale / s ** 0.3, "lr": 1e-3}) + "\n")


def test_report_tables_and_plots(tmp_path):
    mta_dir, _ = make_run(tmp_path / "mta_run", attention="mta")
    base_dir, _ = make_run(tmp_path / "base_run", attention="baseline")
    write_evals(mta_dir, "mta", 1.0)
    write_evals(base_dir, "baseline", 1.1)
    out = tmp_path / "report"
    assert main([str(base_dir), str(mta_dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    # per-domain ppl next to the paper's averages for that variant
    rows = list(csv.reader(io.StringIO((out / "ppl.csv").read_text())))
    assert rows[0] == ["run", "model", "book", "github", "avg", "paper avg", "paper avg (4K ft)"]
    by_run = {r[0]: r for r in rows[1:]}
    assert float(by_run["mta_run"][2]) == pytest.approx(20.0) and float(by_run["mta_run"][4]) == pytest.approx(14.0)
    assert float(by_run["mta_run"][5]) == 10.91 and float(by_run["base_run"][5]) == 11.25
    assert float(by_run["base_run"][6]) == 11.02
    lam = {r[0]: r for r in csv.reader(io.StringIO((out / "lambada.csv").read_text()))}
    assert float(lam["mta_run"][3]) == 13.2 and float(lam["base_run"][5]) == 9.5
    bench = {r[0]: r for r in csv.reader(io.StringIO((out / "benchmarks.csv").read_text()))}
    assert bench["run"][2:] == ["piqa", "hellaswag", "mmlu", "avg", "paper avg"]
    assert float(bench["mta_run"][-1]) == 44.9
    abl = {r[0]: r for r in csv.reader(io.StringIO((out / "ablations.csv").read_text()))}
    assert float(abl["mta_run"][3]) == 10.90 and abl["base_run"][3] == ""
    for name in ("ppl", "benchmarks", "lambada", "ablations", "needle", "babilong"):
        tex = (out / f"{name}.tex").read_text()
        assert "\\begin{tabular}" in tex and "\\_" not in tex.split("\\caption")[0]
        assert "### " in md
    assert "| mta_run | MTA | 20.00 | 8.00 | 14.00 | 10.91 | 10.65 |" in md
    for png in ("needle.png", "babilong.png", "loss_curves.png", "kernels_mta_run_pre-softmax.png",
                "kernels_mta_run_post-softmax.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert not (out / "kernels_base_run_pre-softmax.png").exists()


def test_report_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_report([tmp_path / "missing"], tmp_path / "out")
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="no eval/\\*.json results and no metrics.jsonl"):
        build_report([tmp_path / "bare"], tmp_path / "out")
