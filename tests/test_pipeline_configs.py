"""Sweeps that cannot merge, stage hand-offs that do not depend on the cwd, warmup that
fits the run."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mta_repro.resolvers import mta_layers_every
from mta_repro.train.config import compose, model_args_from
from mta_repro.train.optim import OptimArgs, build_lr_scheduler, lr_factor, warmup_steps

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ warmup
def _lrs(args, total):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = build_lr_scheduler(opt, args, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_frac_scales_with_the_run():
    args = OptimArgs(lr=1.0, warmup=375, warmup_frac=0.1)
    assert warmup_steps(args, 30) == 3 and warmup_steps(args, 400_000) == 40_000
    lrs = _lrs(args, 30)
    assert lrs[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])  # peak reached at step 3, not 375
    # then linear decay to 0 over the remaining 27 steps (independent formula)
    assert lrs[10] == pytest.approx(1.0 - (10 - 3) / 27)
    assert lr_factor(30, args, 30) == 0.0
    # unset: the step count as before
    assert warmup_steps(OptimArgs(warmup=375), 30) == 375
    with pytest.raises(ValueError, match="optim.warmup_frac"):
        OptimArgs(warmup_frac=1.5)


def test_warmup_longer_than_the_run_warns():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.warns(UserWarning, match=r"optim.warmup=375 >= trainer.steps=30.*at most 7.7%"):
        build_lr_scheduler(opt, OptimArgs(warmup=375), 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_lr_scheduler(opt, OptimArgs(warmup=375, warmup_frac=0.01), 30)  # no warning
        build_lr_scheduler(opt, OptimArgs(warmup=10), 30)


def test_warmup_frac_composes_from_the_command_line():
    cfg = compose(["experiment=debug", "optim.warmup_frac=0.05"])
    assert cfg.optim.warmup_frac == 0.05
    assert compose(["experiment=debug"]).optim.warmup_frac is None


# ------------------------------------------------------------------ sweeps
def test_conv_layer_lists_follow_the_depth():
    assert mta_layers_every(24, 4) == "2,6,10,14,18,22"  # the release's 880M list
    assert mta_layers_every(24, 8) == "2,10,18"
    assert mta_layers_every(20, 4) == "2,6,10,14,18"  # 300M
    assert mta_layers_every(6, 1) == "0,1,2,3,4,5"
    with pytest.raises(ValueError, match=r"model.n_layers=4 \(valid strides: 1..3\)"):
        mta_layers_every(4, 4)


def _sweep_points(name, extra=()):
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    raw = OmegaConf.load(ROOT / "configs" / "experiment" / f"{name}.yaml")
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in raw.hydra.sweeper.params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [compose([f"experiment={name}", *extra, *combo]) for combo in itertools.product(*axes)]


def test_conv_layer_sweep_derives_its_lists_for_other_sizes():
    for model, n in (("880m", 24), ("300m", 20)):
        cfgs = _sweep_points("ablation_conv_layers", [f"model={model}"])
        lists = [model_args_from(c).mta.mta_layers for c in cfgs]
        assert lists == [mta_layers_every(n, 4), mta_layers_every(n, 8), ",".join(map(str, range(n)))]
        assert len({c.run_dir for c in cfgs}) == 3
    cfg = _sweep_points("ablation_conv_layers", ["model=tiny"])[0]
    with pytest.raises(Exception, match="valid strides: 1..3"):
        model_args_from(cfg)


@pytest.mark.slow
def test_plain_run_dir_in_a_sweep_is_refused_before_any_job(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.train",
            "experiment=ablation_kernels",
            f"run_dir={tmp_path / 'one'}",
            "model=tiny",
            "trainer.steps=1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"sweep: error: run_dir={tmp_path / 'one'}: the sweep points [") and "share it" in line
    assert f"run_dir={tmp_path / 'one'} names one directory for every point" in line
    assert not (tmp_path / "one").exists()


def test_stage_sources_are_required_not_cwd_relative():
    for name in ("long_context_880m_mta", "mta_insertion", "mta_insertion_control"):
        cfg = compose([f"experiment={name}"])
        with pytest.raises(Exception, match="checkpoint.init_from: required"):
            cfg.checkpoint.init_from
        cfg = compose([f"experiment={name}", "checkpoint.init_from=/abs/pretrain"])
        assert cfg.checkpoint.init_from == "/abs/pretrain"
