"""Trainer pieces in one process: schedule and AdamW against formulas, launcher
environment parsing, MFU, checkpoint discovery, config validation, experiment configs,
the sbatch dry-run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mta_repro.train.args import CheckpointArgs, TrainerArgs
from mta_repro.train.checkpoint import complete_checkpoints
from mta_repro.train.config import compose, model_args_from
from mta_repro.train.distributed import dist_env
from mta_repro.train.loop import _section
from mta_repro.train.metrics import device_peak_flops, mfu, truncate_after
from mta_repro.train.optim import OptimArgs, build_lr_scheduler, build_optimizer

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ optimisation
def _lrs(args: OptimArgs, total: int) -> list[float]:
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, args)
    sched = build_lr_scheduler(opt, args, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_linear_decay_to_zero():
    lr, warm, total = 2.0, 4, 20
    got = _lrs(OptimArgs(lr=lr, warmup=warm), total)
    for s, v in enumerate(got):
        want = lr * s / warm if s < warm else lr * (1 - (s - warm) / (total - warm))
        assert v == pytest.approx(want, abs=1e-12)
    assert got[0] == 0.0  # warmup starts from 0


def test_cosine_option():
    lr, warm, total = 1.0, 2, 12
    got = _lrs(OptimArgs(lr=lr, warmup=warm, scheduler="cosine"), total)
    for s in range(warm, total):
        want = 0.5 * lr * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
        assert got[s] == pytest.approx(want, abs=1e-12)


def test_adamw_step_matches_formula_and_decays_all_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=True), torch.nn.LayerNorm(3))
    args = OptimArgs(lr=0.1, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.05, warmup=0)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    loss = model(torch.randn(4, 3)).pow(2).sum()
    loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    build_optimizer(model, args).step()
    for n, p in model.named_parameters():
        g, w = grads[n], before[n]
        m, v = (1 - 0.9) * g, (1 - 0.98) * g * g
        mhat, vhat = m / (1 - 0.9), v / (1 - 0.98)
        want = w * (1 - 0.1 * 0.05) - 0.1 * mhat / (vhat.sqrt() + 1e-8)
        assert torch.allclose(p.detach().double(), want, atol=1e-6), n


def test_exclude_norms_and_1d_from_weight_decay():
    from mta_repro.model import build_model

    model = build_model(model_args_from(compose(["attention=mta"])), device="meta")
    opt = build_optimizer(model, OptimArgs(exclude_norms_and_1d=True))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.05
    nd = {names[id(p)] for p in no_decay["params"]}
    assert "norm.weight" in nd and "layers.0.attention_norm.weight" in nd
    assert "layers.0.attention.gate.bias" in nd and "layers.0.attention.subln.weight" in nd
    assert all(
        names[id(p)].endswith(
            (
                "wq.weight",
                "w1.weight",
                "w2.weight",
                "w3.weight",
                "wk.weight",
                "wv.weight",
                "wo.weight",
                "tok_embeddings.weight",
                "mta_kernel",
                "mta_kernel_after_sm",
                "wpsm.weight",
                "head_kernel",
                "gate.weight",
            )
        )
        for p in decay["params"]
    )
    # Default (the paper): one group, everything decayed.
    assert len(build_optimizer(model, OptimArgs()).param_groups) == 1


# ------------------------------------------------------------------ launch environment
def test_nodelist_expanded_without_scontrol():
    """The fallback for a launch without SLURM's tools, on the lists SLURM writes (checked
    against scontrol itself in tests/test_slurm_multinode.py when a cluster is up)."""
    from mta_repro.slurm import expand_nodelist

    assert expand_nodelist("gpu-[001-004,010]") == ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010"]
    assert expand_nodelist("a1,b[2-3]") == ["a1", "b2", "b3"]
    assert expand_nodelist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert expand_nodelist("gpu[003-005,9],cpu1") == ["gpu003", "gpu004", "gpu005", "gpu9", "cpu1"]
    assert expand_nodelist("x[1-2]y[3-4]") == ["x1y3", "x1y4", "x2y3", "x2y4"]
    assert expand_nodelist("node7") == ["node7"]
    with pytest.raises(ValueError, match="is not N or N-M"):
        expand_nodelist("a[x-2]")


def test_dist_env_from_slurm_and_torchrun(monkeypatch):
    import os

    # dist_env writes MASTER_ADDR/PORT into os.environ: work on a copy so nothing leaks
    # into later tests' subprocesses.
    monkeypatch.setattr(
        os,
        "environ",
        {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        },
    )
    monkeypatch.setenv("SLURM_PROCID", "11")
    monkeypatch.setenv("SLURM_NTASKS", "32")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "h100-[017-020]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    # The first node as SLURM (or, without scontrol, the fallback) expands the list, at the
    # address SLURM has for it (these names resolve nowhere: a stand-in answers).
    import mta_repro.slurm

    monkeypatch.setattr(mta_repro.slurm, "node_address", lambda name: f"addr({name})")
    assert dist_env() == (11, 32, 3, True)
    assert os.environ["MASTER_ADDR"] == "addr(h100-017)"
    assert os.environ["MASTER_PORT"] == str(20000 + 123456 % 20000)
    # torchrun's variables win (torchrun inside an allocation).
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert dist_env()[:3] == (1, 2, 1)


# ------------------------------------------------------------------ metrics
def test_mfu_formula_and_cpu_peak_unknown():
    assert device_peak_flops(torch.device("cpu")) is None
    assert mfu(1000.0, 6e9, None, 8) is None
    # 1e4 tokens/s * 6e9 FLOP/token over 2 devices of 1e14 FLOP/s = 30 %.
    assert mfu(1e4, 6e9, 1e14, 2) == pytest.approx(0.3)


def test_hardware_flops_count_what_the_implementation_computes():
    from mta_repro.model.flops import hardware_flops_per_token

    base = hardware_flops_per_token(model_args_from(compose(["model=880m"])), 2048)
    mta = hardware_flops_per_token(
        model_args_from(compose(["model=880m", "attention=mta", "model.attn_impl=torch"])), 2048
    )
    H, T, L, d = 16, 2048, 24, 96
    # the paper's MTA cost: convolutions and head mixing (train = 3x), plus what the reference path really computes:
    # Q K^T and A V over the whole T x T matrix, not the causal half SDPA visits.
    extra = 3 * (6 * 2 * 2 * H * T * 6 * 11 + L * 2 * 2 * H * T * H + L * 2 * T * H * d)
    assert mta - base == pytest.approx(extra, rel=1e-9)


def test_model_flops_are_the_variants_on_the_causal_half_whatever_runs_it():
    """MFU's FLOPs: the paper's cost model (convolutions in the 6 conv layers, two head
    mixings in every layer, each on the causal half of the scores), 3x for training; the
    same for the reference and the blocked path, which performs more (halo, recomputation)."""
    from mta_repro.model.flops import hardware_flops_per_token, model_flops_per_token

    base = model_flops_per_token(model_args_from(compose(["model=880m"])), 2048)
    by_impl = {
        impl: model_args_from(compose(["model=880m", "attention=mta", f"model.attn_impl={impl}"]))
        for impl in ("torch", "blocked")
    }
    H, T, L = 16, 2048, 24
    extra = 3 * (6 * 2 * 2 * H * (T / 2) * 6 * 11 + L * 2 * 2 * H * (T / 2) * H)
    for args in by_impl.values():
        assert model_flops_per_token(args, T) - base == pytest.approx(extra, rel=1e-9)
        assert hardware_flops_per_token(args, T) > model_flops_per_token(args, T)
    n_matmul = 24 * (4 * 1536 * 1536 + 3 * 1536 * 4096) + 1536 * 128256  # 880M: dense weights and the head
    attn = 24 * 2 * 2 * H * 96 * (T / 2)  # Q K^T and A V on the causal half
    assert base == pytest.approx(6 * n_matmul + 3 * attn, rel=1e-12)


def test_truncate_after_drops_later_steps_and_torn_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
    truncate_after(p, 2)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'


# ------------------------------------------------------------------ checkpoints
def test_only_complete_checkpoints_count(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in (
        ("0000000004", True),
        ("0000000008", False),
        (".tmp-0000000012", True),
        ("0000000002", True),
    ):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / ".complete").write_text("x")
    assert [p.name for p in complete_checkpoints(root)] == ["0000000002", "0000000004"]


# ------------------------------------------------------------------ configs
def test_bad_trainer_fields_raise_value_error():
    with pytest.raises(ValueError, match="trainer.nonfinite"):
        _section(compose(["trainer.nonfinite=ignore"]), "trainer", TrainerArgs)
    with pytest.raises(ValueError, match="checkpoint.init_mode"):
        _section(compose(["checkpoint.init_mode=weights"]), "checkpoint", CheckpointArgs)
    with pytest.raises(ValueError, match="optim.scheduler"):
        OptimArgs(scheduler="step")


@pytest.mark.parametrize("size", ["300m", "550m", "880m", "1b"])
@pytest.mark.parametrize("variant", ["baseline", "diff", "talking_heads", "mta"])
def test_pretrain_experiments(size, variant):
    cfg = compose([f"experiment=pretrain_{size}_{variant}"])
    args = model_args_from(cfg)
    assert args.vocab_size == 128256 and cfg.data.seq_len == 2048 and cfg.data.batch_size == 4
    assert cfg.slurm.nodes * cfg.slurm.gpus_per_node == 32 and cfg.trainer.steps == 400_000
    # 4 x 2048 x 32 x 400k = 104.9B tokens (the paper's 105B).
    assert cfg.data.batch_size * cfg.data.seq_len * 32 * cfg.trainer.steps == pytest.approx(105e9, rel=0.01)
    o = cfg.optim
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.warmup, o.scheduler, o.clip) == (
        1.5e-4,
        0.9,
        0.98,
        1e-8,
        0.05,
        375,
        "linear",
        1.0,
    )
    assert args.mta.use_mta == (variant in ("mta", "talking_heads"))
    assert args.diff_transformer == (variant == "diff")


def test_stage_experiments():
    lc = compose(["experiment=long_context_880m_mta"])
    a = model_args_from(lc)
    assert (a.rope_theta, lc.data.seq_len, lc.optim.weight_decay, lc.optim.warmup) == (500000, 4096, 0.0, 50)
    # init_from is required (absolute, from the pipeline's plan), not a cwd-relative runs/...
    with pytest.raises(Exception, match="checkpoint.init_from: required"):
        lc.checkpoint.init_from
    assert lc.checkpoint.init_mode == "model"
    tokens = lc.data.batch_size * lc.data.seq_len * 32 * lc.trainer.steps
    assert tokens == pytest.approx(10.5e9, rel=0.001)
    ins = compose(["experiment=mta_insertion"])
    assert ins.checkpoint.init_mode == "baseline_to_mta" and model_args_from(ins).mta.use_mta


@pytest.mark.parametrize("name", ["ablation_gating_norm", "ablation_kernels", "ablation_conv_layers"])
def test_ablation_sweeps_expand_to_valid_distinct_runs(name):
    from mta_repro.pipeline.sweep import build

    raw = OmegaConf.load(ROOT / "configs" / "experiment" / f"{name}.yaml")
    assert raw.hydra.mode == "MULTIRUN"
    n = math.prod(len(str(v).split(",")) if "choice" not in str(v) else 3 for v in raw.hydra.sweeper.params.values())
    # the engine's plan of `python -m mta_repro.train experiment=<name>`: one job a point, a report after
    plan, launcher = build([f"experiment={name}"])
    train = [j for j in plan.jobs if j.kind == "train"]
    assert launcher == "local" and len(train) == n >= 3
    assert len({j.run_dir for j in train}) == n
    for job in train:
        model_args_from(compose(job.overrides))  # each point's command line composes to a valid model
    (report,) = [j for j in plan.jobs if j.kind == "report"]
    assert report.deps == [j.id for j in train] and report.runs == [j.run_dir for j in train]


# ------------------------------------------------------------------ SLURM dry-run
@pytest.mark.slow
def test_sbatch_dry_run(tmp_path):
    p = subprocess.run(
        # the corpus and tokenizer are on the cluster, not here
        [sys.executable, "-m", "mta_repro.pipeline.submit", "experiment=pretrain_880m_mta", "--dry-run", "--no-check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("SLIMPAJAMA_DIR", "LLAMA3_TOKENIZER")},
    )
    assert p.returncode == 0, p.stderr
    script = tmp_path / "train.sbatch"
    script.write_text(p.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    s = p.stdout
    assert "#SBATCH --nodes=4\n" in s and "#SBATCH --ntasks-per-node=8\n" in s and "#SBATCH --gpus-per-node=8\n" in s
    assert "#SBATCH --signal=USR2@120" in s and "#SBATCH --requeue" in s
    srun = [l for l in s.splitlines() if l.startswith("srun ")]
    assert len(srun) == 1
    # the values read from $SLIMPAJAMA_DIR / $LLAMA3_TOKENIZER (their defaults here), written in
    assert (
        "-m mta_repro.train experiment=pretrain_880m_mta data.root_dir=/datasets/slimpajama_domains "
        "data.tokenizer.path=/checkpoints/llama3/tokenizer.model run_dir="
    ) in srun[0]
    assert srun[0].rstrip().endswith("runs/pretrain_880m_mta")
    # Overrides reach the command and the resources.
    from mta_repro.pipeline.submit import render

    script2, command2 = render(["experiment=pretrain_300m_mta", "slurm.nodes=2", "trainer.steps=10"])
    assert "#SBATCH --nodes=2\n" in script2 and "trainer.steps=10" in command2
