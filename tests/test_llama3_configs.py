"""Appendix I on the public Llama 3 checkpoints: model configs, memory pre-flight, pipeline plan."""

import os
import subprocess
import sys

import pytest

from mta_repro.estimate.params import count
from mta_repro.train.config import compose, model_args_from

# Meta's published parameter counts (model cards / safetensors metadata).
META_PARAMS = {"llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824, "llama3_1_8b": 8_030_261_248}
EXPERIMENTS = [f"mta_insertion_llama3_{m}{c}" for m in ("2_1b", "2_3b", "1_8b") for c in ("", "_control")]


@pytest.mark.parametrize("model", sorted(META_PARAMS))
def test_llama3_model_configs_have_metas_parameter_count(model):
    args = model_args_from(compose([f"model={model}"]))
    assert count(args)["total"] == META_PARAMS[model]
    assert args.n_kv_heads == 8 and args.vocab_size == 128256 and args.rope_scaling.rope_type == "llama3"
    assert args.weight_tying == (model != "llama3_1_8b")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_insertion_experiments_fit_an_h200_with_fsdp(experiment):
    from mta_repro.estimate.memory import CAPACITIES, estimate_from_config

    cfg = compose([f"experiment={experiment}"])
    assert int(cfg.data.seq_len) == 2048
    tokens = int(cfg.trainer.steps) * 262_144  # 4 x 2048 x 32 GPUs
    # Appendix I: the public Llama 3.x models were trained 5.3B tokens more (the paper's own
    # 1.4B got 10.5B: configs/experiment/mta_insertion.yaml)
    assert abs(tokens - 5.3e9) < 262_144
    est = estimate_from_config(cfg)
    assert est.world_size == 32 and est.fits(CAPACITIES["H200 141 GB"]), est.table()
    assert "micro-batch 4 x 2048 tokens per GPU, bfloat16" in est.table()  # the assumptions, stated


@pytest.mark.slow
def test_appendix_i_llama3_pipeline_dry_run_prints_plan_and_every_sbatch(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.pipeline",
            "pipeline=appendix_i_llama3",
            "launcher=slurm",
            f"root={tmp_path}",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "LLAMA3_DIR"},
    )
    # everything is printed, then what the jobs would miss at their start (here: the Llama
    # folders, the corpus and the tokenizer): exit status 2, as a submission would refuse
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("pipeline: error: ")]
    assert errors and all("does not exist" in line for line in errors), r.stderr[-2000:]
    out = r.stdout + r.stderr
    # per model: import (CPU) -> Appendix I check of the insertion -> MTA + control -> 2 evals; 1 report
    assert "pipeline appendix_i_llama3: 19 jobs" in out
    for e in EXPERIMENTS:
        assert f"experiment={e} " in out
    assert out.count("#!/bin/bash") == 19
    for m, folder in (("2_1b", "Llama-3.2-1B"), ("2_3b", "Llama-3.2-3B"), ("1_8b", "Llama-3.1-8B")):
        pt = tmp_path / "imports" / f"llama3_{m}" / "consolidated.pt"
        # the import reads the user's own folder (LLAMA3_DIR, default /checkpoints/llama3) into the run root
        assert f"-m mta_repro.hf import /checkpoints/llama3/{folder} {pt}\n" in out
        assert f"note: pipeline.imports.llama3_{m}: /checkpoints/llama3/{folder}/config.json does not exist" in out
        assert (
            f"pipeline: error: pipeline.imports.llama3_{m}: /checkpoints/llama3/{folder}/config.json does not exist"
        ) in errors[0] + "".join(errors)
        imp, chk = f"<import:llama3_{m}>", f"<check:llama3_{m}/mta>"
        assert f"# ---- import:llama3_{m}: sbatch  {pt.parent}/slurm/pipeline_import.sbatch" in out
        assert f"# ---- check:llama3_{m}/mta: sbatch --dependency=afterok:{imp} " in out
        assert f"# ---- train:llama3_{m}/mta: sbatch --dependency=afterok:{imp}:{chk} " in out
        assert f"# ---- train:llama3_{m}/baseline: sbatch --dependency=afterok:{imp} " in out
        assert f"# ---- eval:llama3_{m}/mta: sbatch --dependency=afterok:<train:llama3_{m}/mta> " in out
        for v in ("mta", "baseline"):  # every run starts from the imported file, not $LLAMA3_IMPORTS
            assert (
                f"experiment=mta_insertion_llama3_{m}{'' if v == 'mta' else '_control'} checkpoint.init_from={pt} "
                f"run_dir={tmp_path / f'llama3_{m}' / v}" in out
            )
        assert f"-m mta_repro.pipeline.check experiment=mta_insertion_llama3_{m} checkpoint.init_from={pt} " in out
    # the import job: CPU only; the check: one GPU
    imp_script = out.split("# ---- import:llama3_1_8b:")[1].split("# ----")[0]
    assert "--gpus-per-node" not in imp_script and "#SBATCH --job-name=import_llama3_1_8b" in imp_script
    chk_script = out.split("# ---- check:llama3_1_8b/mta:")[1].split("# ----")[0]
    assert "#SBATCH --gpus-per-node=1" in chk_script
    report = next(l for l in out.splitlines() if l.startswith("# ---- report: sbatch --dependency=afterany:"))
    assert report.count("<") == 18
