"""Appendix I on a Llama you downloaded, as one pipeline: import -> first-batch
check -> finetune MTA + control -> evaluate -> report, on a tiny random LlamaForCausalLM
saved by transformers in a temporary folder (llama3 RoPE scaling, grouped-query attention);
the local launcher end to end (CPU, about a minute), reruns that skip what is done."""

import csv
import io
import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from mta_repro.errors import UserError
from mta_repro.pipeline.done import done, imported_from
from mta_repro.pipeline.plan import Plan
from mta_repro.pipeline.run import run_local

ROOT = Path(__file__).resolve().parents[1]

# The tiny Llama's shape as training overrides (tests/test_hf_llama3.py builds the same
# model): the runs start from its imported weights, so the model fields must be its own.
TINY_LLAMA = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=16",
    "model.vocab_size=258",
    "model.multiple_of=16",
    "model.ffn_dim_multiplier=1.0",
    "model.rope_theta=500000",
    "model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
    "original_max_position_embeddings: 64}",
    "model.weight_tying=true",
    "model.norm_order=hf",
    "model.kq_conv_layers=1",
    "data.tokenizer.name=bytes",
    "data.seq_len=64",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.device=cpu",
    "trainer.steps=2",
    "optim.warmup=1",
    "checkpoint.every=2",
    "logging.every=1",
    "trainer.eval_max_batches=1",
    "logging.progress_bar=false",
    "logging.wandb_mode=disabled",
]


def _tiny_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    kw = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=257,
    )
    if "rope_parameters" in LlamaConfig().to_dict():
        kw["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    else:
        kw.update(rope_theta=500000.0, rope_scaling=scaling)
    hf = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.15)
    hf.save_pretrained(folder, max_shard_size="100KB")  # sharded, with an index
    return folder


def _spec(folder) -> dict:
    """configs/pipeline/appendix_i_llama3.yaml's shape for one tiny model (its experiments set
    init_mode per variant; here the stage's per-variant overrides do)."""
    common = ["model.mta.group_norm=false", "model.mta.add_gating=false"]
    return {
        "name": "appendix_i_tiny_llama",
        "variants": ["mta", "baseline"],
        "train_overrides": TINY_LLAMA,
        "imports": {"tiny_llama": str(folder)},
        "stages": [
            {
                "name": "tiny_llama",
                "experiment": "debug",
                "init_from": "import:tiny_llama",
                "kind": {"mta": "insertion", "baseline": "continued"},
                "check_first_loss": ["mta"],
                "overrides": {
                    "mta": ["attention=mta", *common, "checkpoint.init_mode=baseline_to_mta"],
                    "baseline": ["attention=baseline", "checkpoint.init_mode=model"],
                },
                "eval": ["tasks=[ppl]", "ppl.max_batches=1", "ppl.batch_size=1", "ppl.domains=[book]"],
            }
        ],
        "appendix_i_tol": 1e-4,
        "report": True,
        "slurm": {"gpus_per_node": 0},
    }


def _run(plan):
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + old if old else "")  # this checkout, in subprocesses too
    try:
        log = []
        return run_local(plan, log=log.append), log
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3_pipeline")
    folder = _tiny_llama(d / "Llama-tiny")
    plan = Plan(OmegaConf.create(_spec(folder)), d / "runs")
    rc, log = _run(plan)
    assert rc == 0, "\n".join(log)
    return plan, folder, d


@pytest.mark.pipeline
def test_plan_order_and_dependencies(finished):
    plan, folder, d = finished
    jobs = {j.id: j for j in plan.jobs}
    assert list(jobs) == [
        "import:tiny_llama",
        "check:tiny_llama/mta",
        "train:tiny_llama/mta",
        "train:tiny_llama/baseline",
        "eval:tiny_llama/mta",
        "eval:tiny_llama/baseline",
        "report",
    ]
    pt = d / "runs" / "imports" / "tiny_llama" / "consolidated.pt"
    assert jobs["import:tiny_llama"].command[-4:] == ["mta_repro.hf", "import", str(folder), str(pt)]
    assert jobs["check:tiny_llama/mta"].deps == ["import:tiny_llama"]
    assert jobs["train:tiny_llama/mta"].deps == ["import:tiny_llama", "check:tiny_llama/mta"]
    assert jobs["train:tiny_llama/baseline"].deps == ["import:tiny_llama"]  # the control needs no check
    for j in ("check:tiny_llama/mta", "train:tiny_llama/mta", "train:tiny_llama/baseline"):
        assert f"checkpoint.init_from={pt}" in jobs[j].command


@pytest.mark.pipeline
def test_import_check_finetune_report(finished):
    plan, folder, d = finished
    runs = d / "runs"
    pt = runs / "imports" / "tiny_llama" / "consolidated.pt"
    assert imported_from(pt) == str(folder)
    # the check ran against the imported weights and passed: the inserted model's first-batch
    # loss is the import's (and the trainer's first logged loss, before any update, is it too)
    res = json.loads((runs / "tiny_llama" / "mta" / "appendix_i_check.json").read_text())
    assert res["source"] == str(pt) and res["ok"] and res["abs_diff"] <= 1e-4
    first = json.loads((runs / "tiny_llama" / "mta" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(res["source_loss"], abs=1e-4)
    assert not (runs / "tiny_llama" / "baseline" / "appendix_i_check.json").exists()
    for v, mode in (("mta", "baseline_to_mta"), ("baseline", "model")):
        cfg = OmegaConf.load(runs / "tiny_llama" / v / "config.yaml")
        assert cfg.checkpoint.init_mode == mode and cfg.checkpoint.init_from == str(pt)
        # what each run is, recorded by the plan (the stage's kind map) and read by the report
        stage = {"mta": "insertion", "baseline": "continued"}[v]
        assert (cfg.run.stage, cfg.run.variant) == (stage, v)
        assert json.loads((runs / "tiny_llama" / v / "provenance.json").read_text())["run"]["stage"] == stage
    # the report: the MTA insertion and its control (not a long-context finetune: theta
    # 500,000 is the Llama's own), the control as the insertion's baseline
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO((runs / "report" / "ppl.csv").read_text()))}
    assert rows["tiny_llama/mta"]["stage"] == "MTA insertion"
    assert rows["tiny_llama/baseline"]["stage"] == "continued training"
    d_avg = float(rows["tiny_llama/mta"]["avg"]) - float(rows["tiny_llama/baseline"]["avg"])
    assert float(rows["tiny_llama/mta"]["Δ vs baseline"]) == pytest.approx(d_avg, abs=1e-3)
    # a tiny model is none of the appendix's models: no paper number beside it, and it says why
    assert rows["tiny_llama/mta"]["paper avg"] == ""
    assert "Appendix I finetuned 1.4B, Llama 3.2 1B, Llama 3.2 3B, Llama 3.1 8B" in rows["tiny_llama/mta"]["vs paper"]


@pytest.mark.pipeline
def test_rerun_skips_everything_and_a_changed_folder_reimports(finished, tmp_path):
    plan, folder, d = finished
    assert all(done(j) for j in plan.jobs)
    rc, log = _run(plan)
    assert rc == 0 and log == [f"pipeline: nothing to do, all {len(plan.jobs)} jobs are done ({plan.root})"]
    # the same .pt read from another folder is not this plan's import
    other = Plan(OmegaConf.create(_spec(tmp_path / "elsewhere")), plan.root)
    assert not done(other.job("import:tiny_llama")) and done(other.job("train:tiny_llama/mta"))
    # ... and that folder does not exist: refused before any job, naming the field
    with pytest.raises(UserError, match=r"pipeline.imports.tiny_llama: .*elsewhere/config.json does not exist"):
        run_local(other, log=lambda *_: None)
    # a truncated .pt is not a finished import
    cut = tmp_path / "cut.pt"
    cut.write_bytes((plan.root / "imports" / "tiny_llama" / "consolidated.pt").read_bytes()[:1000])
    assert imported_from(cut) is None


def test_plan_errors_name_the_field(tmp_path):
    spec = _spec(tmp_path)
    spec["stages"][0]["init_from"] = "import:nope"
    with pytest.raises(
        UserError,
        match=r"pipeline.stages\[0\].init_from: 'import:nope': no such entry in "
        r"pipeline.imports \(has \['tiny_llama'\]\)",
    ):
        Plan(OmegaConf.create(spec), tmp_path / "runs")
    spec = _spec(tmp_path)
    spec["stages"][0]["continue_data"] = True
    with pytest.raises(UserError, match=r"continue_data: needs init_from of an earlier stage"):
        Plan(OmegaConf.create(spec), tmp_path / "runs")
    spec = _spec(tmp_path)
    spec["imports"] = ["x"]
    with pytest.raises(UserError, match=r"pipeline.imports: expected a map"):
        Plan(OmegaConf.create(spec), tmp_path / "runs")


@pytest.mark.pipeline
def test_slurm_chain_import_check_train(finished, tmp_path, monkeypatch):
    """launcher=slurm against a stand-in sbatch: the import first (CPU), the check after it,
    the MTA run after both, the control after the import; scripts are valid bash."""
    import stat
    import subprocess

    from mta_repro.pipeline.run import submit_slurm

    _, folder, _ = finished
    log = tmp_path / "sbatch.log"
    log.touch()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("sbatch", f'n=$(( $(wc -l < {log}) + 100 ))\necho "$n $*" >> {log}\necho "$n"\n'),
        ("squeue", "exit 0\n"),
    ):
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    root = tmp_path / "runs"
    plan = Plan(OmegaConf.create(_spec(folder)), root)
    assert submit_slurm(plan, log=lambda *_: None) == 0
    calls = {
        c.split()[-1]: (c.split()[0], [a for a in c.split()[1:-1] if a.startswith("--dependency")])
        for c in log.read_text().splitlines()
    }
    job = lambda rel, kind: calls[str(root / rel / "slurm" / f"pipeline_{kind}.sbatch")]  # noqa: E731
    imp, chk = job("imports/tiny_llama", "import"), job("tiny_llama/mta", "check")
    assert imp[1] == [] and chk[1] == [f"--dependency=afterok:{imp[0]}"]
    assert job("tiny_llama/mta", "train")[1] == [f"--dependency=afterok:{imp[0]}:{chk[0]}"]
    assert job("tiny_llama/baseline", "train")[1] == [f"--dependency=afterok:{imp[0]}"]
    assert job("report", "report")[1][0].startswith("--dependency=afterany:") and len(calls) == 7
    script = root / "imports" / "tiny_llama" / "slurm" / "pipeline_import.sbatch"
    text = script.read_text()
    assert "--gpus-per-node" not in text and f"-m mta_repro.hf import {folder} " in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
