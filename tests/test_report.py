"""Reports: tables with the paper's numbers alongside (by stage), differences to the
baseline, comparability, labels, local task copies, CSV/LaTeX/JSON, and the PNG plots."""

import csv
import io
import json
import math
from pathlib import Path

import pytest
from eval_helpers import make_run
from omegaconf import OmegaConf

from mta_repro.report.__main__ import build_report, main
from mta_repro.report.plots import loss_series
from mta_repro.report.runs import load_run
from mta_repro.report.tables import describe_mta
from mta_repro.train.config import compose


def write_evals(
    run_dir: Path,
    variant: str,
    ppl_scale: float,
    step: int = 7,
    bench_names=None,
    babilong_source="generated",
    window=2048,
    metrics=None,
):
    ev = run_dir / "eval"
    ev.mkdir(parents=True, exist_ok=True)
    doms = {"book": 20.0 * ppl_scale, "github": 8.0 * ppl_scale}
    ppl = {
        "domains": {d: {"ppl": p, "loss": math.log(p), "tokens": 100} for d, p in doms.items()},
        "average": sum(doms.values()) / 2,
        "seq_len": window,
    }
    common = {"variant": variant, "step": step}
    (ev / "ppl.json").write_text(json.dumps({"task": "ppl", **common, "results": ppl}))
    needle = {
        "accuracy": {
            "2048": {
                "2": {"by_depth": {"0": 1.0, "50": 0.5, "100": 0.0}, "mean": 0.5},
                "4": {"by_depth": {"0": 0.5, "50": 0.25, "100": 0.0}, "mean": 0.25},
            }
        }
    }
    (ev / "needle.json").write_text(json.dumps({"task": "needle", **common, "results": needle}))
    bab = {
        "accuracy": {"qa1": {"0k": 0.5, "1k": 0.25}, "qa2": {"0k": 0.75, "1k": 0.5}},
        "mean": {"0k": 0.625, "1k": 0.375},
        "settings": {"source": babilong_source},
    }
    (ev / "babilong.json").write_text(json.dumps({"task": "babilong", **common, "results": bab}))
    names = bench_names or {"piqa": 60.0 * ppl_scale, "hellaswag": 30.0, "mmlu": 25.0}
    bench = {
        "tasks": {
            n: ({"acc,none": 0.1, "acc_norm,none": v / 100} if n.startswith("hellaswag") else {"acc,none": v / 100})
            for n, v in names.items()
        },
        "summary": {**names, "average": sum(names.values()) / len(names)},
        **({"metrics": metrics} if metrics else {}),
    }
    (ev / "benchmarks.json").write_text(json.dumps({"task": "benchmarks", **common, "results": bench}))
    lam = {
        "tasks": {},
        "summary": {"lambada_standard": {"ppl": 50.0, "acc": 10.0}, "lambada_openai": {"ppl": 30.0, "acc": 12.0}},
    }
    (ev / "lambada.json").write_text(json.dumps({"task": "lambada", **common, "results": lam}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, 21):
            f.write(json.dumps({"step": s, "loss": 6.0 * ppl_scale / s**0.3, "lr": 1e-3}) + "\n")


def _csv(path):
    rows = list(csv.reader(io.StringIO(path.read_text())))
    return rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}


def test_report_tables_and_plots(tmp_path):
    mta_dir, _ = make_run(tmp_path / "mta_run", attention="mta")
    base_dir, _ = make_run(tmp_path / "base_run", attention="baseline")
    m = {"piqa": "acc_norm", "hellaswag": "acc_norm", "mmlu": "acc"}
    write_evals(mta_dir, "mta", 1.0, metrics=m)
    write_evals(base_dir, "baseline", 1.1, metrics=m)
    out = tmp_path / "report"
    assert main([str(base_dir), str(mta_dir), "--out", str(out), "--label", f"{mta_dir}=MTA tiny"]) == 0
    md = (out / "report.md").read_text()
    # per-domain ppl, the difference to the baseline of the same stage, the paper's pretraining average
    head, ppl = _csv(out / "ppl.csv")
    assert head == [
        "run",
        "model",
        "stage",
        "trained",
        "window",
        "book",
        "github",
        "avg",
        "Δ vs baseline",
        "paper avg",
        "paper Δ",
        "vs paper",
    ]
    m, b = ppl["MTA tiny"], ppl["base_run"]
    assert float(m["book"]) == pytest.approx(20.0) and float(m["avg"]) == pytest.approx(14.0)
    assert float(m["Δ vs baseline"]) == pytest.approx(14.0 - 15.4) and float(b["Δ vs baseline"]) == 0.0
    assert float(m["paper avg"]) == 10.91 and float(b["paper avg"]) == 11.25
    assert float(m["paper Δ"]) == pytest.approx(10.91 - 11.25)
    assert m["stage"] == "pretrain"
    # a 2-layer model after 7 steps is not the paper's 880M / 400k-step run, and says so
    assert m["vs paper"].startswith("no: model dim 64 x 2 layers, paper 880M; 7 of the paper's 400,000 steps")
    assert "the paper's 880M, 105B tokens" in md
    lam_head, lam = _csv(out / "lambada.csv")
    assert float(lam["MTA tiny"]["paper standard"]) == 13.2 and float(lam["base_run"]["paper OpenAI"]) == 9.5
    bh, bench = _csv(out / "benchmarks.csv")
    assert bh[3:6] == ["piqa (acc_norm)", "hellaswag (acc_norm)", "mmlu (acc)"]
    assert float(bench["MTA tiny"]["paper avg"]) == 44.9
    assert float(bench["MTA tiny"]["Δ vs baseline"]) == pytest.approx((60 + 30 + 25) / 3 - (66 + 30 + 25) / 3)
    assert "avg over 3 of the paper's 9 tasks" in bench["MTA tiny"]["vs paper"]
    assert (
        "Metric per task (lm-eval), the one the paper's table reports: piqa acc_norm, hellaswag acc_norm, mmlu acc"
        in md
        and "not the paper's metric" not in md
    )
    # one MTA configuration, not the release's: no ablation table (the ppl table has every run)
    assert not (out / "ablations.csv").exists()
    for name in ("ppl", "benchmarks", "lambada", "needle", "babilong"):
        tex = (out / f"{name}.tex").read_text()
        assert "\\begin{tabular}" in tex and "\\_" not in tex.split("\\caption")[0]
    assert "| MTA tiny | MTA | pretrain | 256 | 2048 | 20.00 | 8.00 | 14.00 | -1.40 | 10.91 | -0.34 |" in md
    # one name per variant in every table (the runs table too), and the sizes of the two validations said
    assert "| MTA tiny | `" in md and "| MTA | pretrain | 7 | 256 |" in md and "| mta |" not in md
    assert "not the validation logged during training" in md
    # BabiLong says its source and gets no paper column
    bab_head, _ = _csv(out / "babilong.csv")
    assert bab_head[:4] == ["run", "model", "source", "task"]
    assert "| MTA tiny | MTA | generated | mean | 62.50 | 37.50 |" in md and "not comparable with the paper" in md
    # results.json: everything in the tables
    res = json.loads((out / "results.json").read_text())
    assert {r["label"]: r["stage"] for r in res["runs"]} == {"base_run": "pretrain", "MTA tiny": "pretrain"}
    assert res["runs"][1]["comparable"] is False
    row = next(r for r in res["tables"]["ppl"]["rows"] if r["run"] == "MTA tiny")
    assert row["avg"] == pytest.approx(14.0) and row["paper avg"] == 10.91
    assert set(res["tables"]) == {"ppl", "benchmarks", "lambada", "needle", "babilong"}
    for png in (
        "needle.png",
        "babilong.png",
        "loss_curves.png",
        "kernels_MTA_tiny_pre-softmax.png",
        "kernels_MTA_tiny_post-softmax.png",
    ):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert not (out / "kernels_base_run_pre-softmax.png").exists()


def _fake_run(path: Path, overrides, variant, avg, step=400_000, init_from=None, window=2048):
    cfg = compose(overrides + ([f"checkpoint.init_from={init_from}"] if init_from else []))
    path.mkdir(parents=True)
    OmegaConf.save(OmegaConf.to_container(cfg, resolve=True), path / "config.yaml")
    (path / "eval").mkdir()
    ppl = {"domains": {"book": {"ppl": avg, "loss": math.log(avg), "tokens": 1}}, "average": avg, "seq_len": window}
    (path / "eval" / "ppl.json").write_text(
        json.dumps({"task": "ppl", "variant": variant, "step": step, "results": ppl})
    )
    return path


def test_table5_number_only_on_matching_rows(tmp_path):
    base = ["model=880m", "attention=mta", "trainer.steps=400000"]
    runs = {
        "release": (base, 10.90),
        "rescale": (base + ["model.mta.layer_norm_rescale=true"], 10.92),
        "curse_norm": (base + ["model.mta.curse_norm=true"], 11.41),
        "rescale_nogate": (base + ["model.mta.layer_norm_rescale=true", "model.mta.add_gating=false"], None),
        "nogate": (base + ["model.mta.add_gating=false"], None),
        "kernel_4x7": (
            base
            + [
                "model.mta.query_kernel_size=4",
                "model.mta.key_kernel_size=7",
                "model.mta.after_sm_query_kernel_size=4",
                "model.mta.after_sm_key_kernel_size=7",
            ],
            None,
        ),
        "every8": (base + ["model.mta.mta_layers='2,10,18'"], None),
    }
    dirs = [_fake_run(tmp_path / n, o, "mta", 11.0) for n, (o, _) in runs.items()]
    out = tmp_path / "rep"
    build_report(dirs, out, kernels=False)
    _, abl = _csv(out / "ablations.csv")
    for name, (_, want) in runs.items():
        got = abl[name]["paper (Table 5)"]
        assert (float(got) if got else None) == want, name
        assert abl[name]["vs paper"] == "yes"  # 880M, 400k steps
    assert describe_mta(None) == ("?", None)


def test_paper_columns_follow_the_stage(tmp_path):
    pre_b = _fake_run(tmp_path / "pre_b", ["model=880m", "attention=baseline"], "baseline", 11.3)
    pre_m = _fake_run(tmp_path / "pre_m", ["model=880m", "attention=mta"], "mta", 11.0)
    lc = ["model=880m", "model.rope_theta=500000", "data.seq_len=4096"]
    lc_b = _fake_run(tmp_path / "lc_b", lc + ["attention=baseline"], "baseline", 11.1, 40_054, pre_b, window=4096)
    lc_m = _fake_run(tmp_path / "lc_m", lc + ["attention=mta"], "mta", 10.7, 40_054, pre_m, window=4096)
    ins = _fake_run(
        tmp_path / "ins",
        [
            "model=1b",
            "attention=mta",
            "model.mta.group_norm=false",
            "model.mta.add_gating=false",
            "checkpoint.init_mode=baseline_to_mta",
        ],
        "mta",
        10.6,
        100,
        pre_b,
    )
    ctl = _fake_run(tmp_path / "ctl", ["model=1b", "attention=baseline"], "baseline", 10.7, 40_054, pre_b)
    out = tmp_path / "rep"
    build_report([pre_b, pre_m, lc_b, lc_m, ins, ctl], out, kernels=False)
    _, ppl = _csv(out / "ppl.csv")
    assert [ppl[n]["stage"] for n in ("pre_b", "lc_m", "ins")] == ["pretrain", "4K finetune", "MTA insertion"]
    assert float(ppl["pre_m"]["paper avg"]) == 10.91 and float(ppl["lc_m"]["paper avg"]) == 10.65
    assert float(ppl["lc_b"]["paper avg"]) == 11.02 and float(ppl["ins"]["paper avg"]) == 10.61
    # the difference is taken against the baseline of the same stage
    assert float(ppl["lc_m"]["Δ vs baseline"]) == pytest.approx(10.7 - 11.1)
    assert float(ppl["pre_m"]["Δ vs baseline"]) == pytest.approx(11.0 - 11.3)
    # Appendix I: the inserted MTA against its control (the 1B baseline trained on alike)
    assert ppl["ctl"]["stage"] == "continued training" and float(ppl["ctl"]["paper avg"]) == 10.69
    assert float(ppl["ins"]["Δ vs baseline"]) == pytest.approx(10.6 - 10.7)
    assert float(ppl["ins"]["paper Δ"]) == pytest.approx(10.61 - 10.69)
    assert ppl["lc_m"]["vs paper"] == "yes" and ppl["ins"]["vs paper"] == "no: 100 of the paper's 40,054 steps"
    _, abl = _csv(out / "ablations.csv")
    assert set(abl) == {"pre_m"}  # Table 5 is about pretraining: finetuned and Appendix I runs are not in it
    assert "1.4B" in _paper_note_text(out) and "paper 1B" not in (out / "report.md").read_text()


def _paper_note_text(out):
    return (out / "report.md").read_text()


def test_paper_numbers_only_at_the_same_window(tmp_path):
    """A 4K-finetuned model measured at 2048-token windows is not set beside the paper's
    finetuned number (the paper's is at 4096); at 4096 it is."""
    pre_m = _fake_run(tmp_path / "pre_m", ["model=880m", "attention=mta"], "mta", 11.0)
    lc = ["model=880m", "model.rope_theta=500000", "data.seq_len=4096", "attention=mta"]
    at2k = _fake_run(tmp_path / "at2k", lc, "mta", 10.7, 40_054, pre_m, window=2048)
    at4k = _fake_run(tmp_path / "at4k", lc, "mta", 10.6, 40_054, pre_m, window=4096)
    out = tmp_path / "rep"
    build_report([pre_m, at2k, at4k], out, kernels=False)
    _, ppl = _csv(out / "ppl.csv")
    assert ppl["at2k"]["trained"] == "4096" and ppl["at2k"]["window"] == "2048"
    assert ppl["at2k"]["paper avg"] == "" and ppl["at2k"]["vs paper"] == "no: window 2048 tokens, paper 4096"
    assert float(ppl["at4k"]["paper avg"]) == 10.65 and ppl["at4k"]["vs paper"] == "yes"
    small = _fake_run(tmp_path / "small", ["model=880m", "attention=mta"], "mta", 11.0, window=512)
    build_report([small], tmp_path / "rep2", kernels=False)
    _, ppl = _csv(tmp_path / "rep2" / "ppl.csv")
    assert ppl["small"]["paper avg"] == "" and "window 512 tokens, paper 2048" in ppl["small"]["vs paper"]


def test_local_task_copies_and_old_names(tmp_path):
    d, _ = make_run(tmp_path / "r", attention="baseline")
    write_evals(d, "baseline", 1.0, bench_names={"arc_easy_local": 40.0, "siqa": 35.0, "hellaswag_local": 30.0})
    lam = {"tasks": {}, "summary": {"lambada_standard_local": {"ppl": 50.0, "acc": 10.0}}}
    (d / "eval" / "lambada.json").write_text(
        json.dumps({"task": "lambada", "variant": "baseline", "step": 7, "results": lam})
    )
    out = tmp_path / "rep"
    build_report([d], out, kernels=False)
    head, bench = _csv(out / "benchmarks.csv")
    # results written before the metric was recorded: read as acc, and said not to be the paper's
    assert head[3:6] == ["social_iqa (acc)", "hellaswag (acc_norm)", "arc_easy (acc)"]
    assert "not the paper's metric for arc_easy (acc, paper acc_norm): re-evaluate" in (out / "report.md").read_text()
    assert float(bench["r"]["arc_easy (acc)"]) == 40.0 and float(bench["r"]["avg"]) == pytest.approx(35.0)
    _, lam_rows = _csv(out / "lambada.csv")
    assert float(lam_rows["r"]["standard"]) == 50.0
    md = (out / "report.md").read_text()
    assert "r: arc_easy_local, hellaswag_local counted as arc_easy, hellaswag (local copies" in md
    assert "r: lambada_standard_local counted as lambada_standard" in md


def test_babilong_source_and_loss_series(tmp_path):
    d, _ = make_run(tmp_path / "hf_run", attention="baseline")
    write_evals(d, "baseline", 1.0, babilong_source="hf")
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "val_loss": 5.5}) + "\n")
        f.write(json.dumps({"step": 20, "val_loss": 5.0, "val_ppl": math.e**5, "val_loss/book": 4.0}) + "\n")
    run = load_run(d)
    s = loss_series(run)
    # one validation line per run (the mean over domains); ln(ppl) only without val_loss
    assert s["val_loss"] == [(10, 5.5), (20, 5.0)] and set(s) == {"train", "val_loss"}
    run.metrics = [m for m in run.metrics if "val_loss" not in m] + [{"step": 30, "val_ppl": math.e**4}]
    assert loss_series(run)["val_ppl (ln)"] == [(30, pytest.approx(4.0))]
    assert len(s["train"]) == 20
    out = tmp_path / "rep"
    build_report([d], out, kernels=False)
    md = (out / "report.md").read_text()
    assert "| hf_run | Transformer | hf | qa1 |" in md and "compare the 'hf' rows with it" in md


def test_report_errors_and_missing_eval(tmp_path, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        build_report([tmp_path / "missing"], tmp_path / "out")
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="no eval/\\*.json results and no metrics.jsonl.*python -m mta_repro.eval"):
        build_report([tmp_path / "bare"], tmp_path / "out")
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    assert main([str(trained), "--out", str(tmp_path / "o2")]) == 0
    err = capsys.readouterr().err
    assert f"no evaluation results in {trained / 'eval'}; run: python -m mta_repro.eval {trained}" in err
    assert "python -m mta_repro.eval" in (tmp_path / "o2" / "report.md").read_text()
    assert main([str(trained), "--label", "nope"]) == 2
    assert "--label expects DIR=NAME" in capsys.readouterr().err


def test_a_config_yaml_that_is_no_mapping_is_read_as_no_config(tmp_path, capsys):
    """A run whose config.yaml holds a YAML list (overwritten by hand) is reported as a run
    without a config (no size, stage pretrain), not met with a traceback."""
    run = tmp_path / "listed"
    run.mkdir()
    (run / "config.yaml").write_text("- model\n- data\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    loaded = load_run(run)
    assert loaded.config is None and loaded.shape is None and loaded.stage == "pretrain"
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "| listed | " in (tmp_path / "out" / "report.md").read_text()


def _fake_import(path: Path, model: str) -> Path:
    """What ``python -m mta_repro.hf import`` writes, without weights: {model, config, step, source}."""
    import torch

    cfg = OmegaConf.to_container(compose([f"model={model}"]), resolve=True)  # data: the default (256), not trained
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {}, "config": cfg, "step": 0, "source": f"/checkpoints/{model}"}, path)
    return path


def test_appendix_i_rows_compare_with_their_own_models_pair(tmp_path):
    """Appendix I of the paper: each insertion and control row beside its own model's
    average perplexity (MTA vs control): 1.4B 10.61 / 10.69, Llama 3.2 1B 10.46 / 10.53,
    3.2 3B 8.89 / 8.93, 3.1 8B 8.48 / 8.53 (values written out here, not read from the code)."""
    want = {
        "1b": (10.61, 10.69),
        "llama3_2_1b": (10.46, 10.53),
        "llama3_2_3b": (8.89, 8.93),
        "llama3_1_8b": (8.48, 8.53),
    }
    # the paper's budgets: its own 1.4B 10.5B tokens, each public Llama 5.3B (262,144 tokens a step)
    steps = {"1b": 40_054, "llama3_2_1b": 20_218, "llama3_2_3b": 20_218, "llama3_1_8b": 20_218}
    pre_b = _fake_run(tmp_path / "pre_b", ["data.seq_len=2048", "model=1b", "attention=baseline"], "baseline", 11.3)
    dirs = []
    for m, (p_mta, p_ctl) in want.items():
        src = pre_b if m == "1b" else _fake_import(tmp_path / "imports" / f"{m}.pt", m)
        ins = [
            "data.seq_len=2048",
            f"model={m}",
            "attention=mta",
            "model.mta.group_norm=false",
            "model.mta.add_gating=false",
            "checkpoint.init_mode=baseline_to_mta",
        ]
        dirs.append(_fake_run(tmp_path / f"{m}_mta", ins, "mta", p_mta - 0.01, steps[m], src))
        dirs.append(
            _fake_run(
                tmp_path / f"{m}_ctl",
                ["data.seq_len=2048", f"model={m}", "attention=baseline"],
                "baseline",
                p_ctl + 0.02,
                steps[m],
                src,
            )
        )
    # a control whose imported .pt is not on this machine: Llama 3's RoPE scaling says it is one
    gone = _fake_run(
        tmp_path / "gone_ctl",
        ["data.seq_len=2048", "model=llama3_2_3b", "attention=baseline"],
        "baseline",
        9.0,
        20_218,
        tmp_path / "elsewhere" / "llama3_2_3b.pt",
    )
    out = tmp_path / "rep"
    build_report([pre_b, *dirs, gone], out, kernels=False)
    _, ppl = _csv(out / "ppl.csv")
    for m, (p_mta, p_ctl) in want.items():
        r_mta, r_ctl = ppl[f"{m}_mta"], ppl[f"{m}_ctl"]
        assert r_mta["stage"] == "MTA insertion" and r_ctl["stage"] == "continued training", m
        assert float(r_mta["paper avg"]) == p_mta and float(r_ctl["paper avg"]) == p_ctl, m
        assert float(r_mta["paper Δ"]) == pytest.approx(p_mta - p_ctl), m
        # against its own control (same model), not another model's
        assert float(r_mta["Δ vs baseline"]) == pytest.approx((p_mta - 0.01) - (p_ctl + 0.02)), m
        assert r_mta["vs paper"] == "yes" and r_ctl["vs paper"] == "yes", m
    assert ppl["gone_ctl"]["stage"] == "continued training" and float(ppl["gone_ctl"]["paper avg"]) == 8.93
    md = (out / "report.md").read_text()
    for what in (
        "MTA insertion: the paper's Llama 3.2 1B + 5.3B tokens (Appendix I)",
        "MTA insertion: the paper's Llama 3.1 8B + 5.3B tokens (Appendix I)",
        "continued training: the paper's Llama 3.2 3B trained on for 5.3B tokens (Appendix I control)",
        "MTA insertion: the paper's 1.4B + 10.5B tokens (Appendix I)",
    ):
        assert what in md, what
    # fewer steps than the appendix's budget for that model: not comparable, and why
    short = _fake_run(
        tmp_path / "short",
        [
            "data.seq_len=2048",
            "model=llama3_1_8b",
            "attention=mta",
            "model.mta.group_norm=false",
            "model.mta.add_gating=false",
            "checkpoint.init_mode=baseline_to_mta",
        ],
        "mta",
        8.6,
        100,
        tmp_path / "imports" / "llama3_1_8b.pt",
    )
    build_report([short], tmp_path / "rep2", kernels=False)
    _, ppl = _csv(tmp_path / "rep2" / "ppl.csv")
    assert float(ppl["short"]["paper avg"]) == 8.48
    assert ppl["short"]["vs paper"] == "no: 100 of the paper's 20,218 steps"


def test_a_run_is_placed_by_its_recorded_stage_even_where_rope_theta_says_otherwise(tmp_path):
    """A run's own record (run.stage, run.variant, set by the pipeline) places it; the
    inference from RoPE theta and context is only for runs that recorded none."""
    pre_b = _fake_run(tmp_path / "pre_b", ["model=880m", "attention=baseline"], "baseline", 11.3)
    lc = ["model=880m", "model.rope_theta=500000", "data.seq_len=4096", "attention=baseline"]
    # trained on from pre_b at theta 500,000 and 4096 tokens, which would read as the 4K finetune
    kept = _fake_run(
        tmp_path / "kept", lc + ["run.stage=continued", "run.variant=baseline"], "baseline", 11.2, 10, pre_b
    )
    # no source and the default theta, which would read as pretraining
    said = _fake_run(
        tmp_path / "said", ["model=880m", "attention=baseline", "run.stage=long_context"], "baseline", 11.1
    )
    out = tmp_path / "rep"
    build_report([pre_b, kept, said], out, kernels=False)
    _, ppl = _csv(out / "ppl.csv")
    assert ppl["kept"]["stage"] == "continued training" and ppl["said"]["stage"] == "4K finetune"
    assert ppl["pre_b"]["stage"] == "pretrain"
    runs = {r["label"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["kept"]["stage"] == "continued" and runs["kept"]["placed_by"] == {
        "stage": "recorded",
        "variant": "recorded",
    }
    assert runs["said"]["placed_by"] == {"stage": "recorded", "variant": "inferred"}
    prov = json.loads((out / "results.json").read_text())["tables"]["ppl"]["provenance"]
    assert prov["kept"]["stage"] == "continued training (recorded)"
    assert prov["pre_b"]["stage"] == "pretrain (inferred: no run.stage)"


def test_a_run_dir_from_before_the_record_is_inferred_as_before_and_says_so(tmp_path):
    """An older run's config.yaml has no ``run`` section: its stage comes from its config
    (a source, a longer context, theta 500,000: the 4K finetune), marked inferred."""
    pre_m = _fake_run(tmp_path / "pre_m", ["model=880m", "attention=mta"], "mta", 11.0)
    lc = ["model=880m", "model.rope_theta=500000", "data.seq_len=4096", "attention=mta"]
    old = _fake_run(tmp_path / "old", lc, "mta", 10.7, 40_054, pre_m, window=4096)
    cfg = OmegaConf.load(old / "config.yaml")
    del cfg["run"]
    OmegaConf.save(cfg, old / "config.yaml")
    out = tmp_path / "rep"
    build_report([pre_m, old], out, kernels=False)
    _, ppl = _csv(out / "ppl.csv")
    assert ppl["old"]["stage"] == "4K finetune" and float(ppl["old"]["paper avg"]) == 10.65
    md = (out / "report.md").read_text()
    assert "4K finetune (inferred: no run.stage)" in md
    # said once for the report (not per table or per run), naming the run
    assert md.count("stage (inferred)") == 1 and "- stage (inferred) for pre_m, old: made before runs recorded" in md
    # a record the report cannot read is one line naming the file and the field
    cfg["run"] = {"stage": "finetune"}
    OmegaConf.save(cfg, old / "config.yaml")
    with pytest.raises(ValueError, match=r"^report: .*old/config.yaml: run.stage is 'finetune'; expected one of"):
        load_run(old)
