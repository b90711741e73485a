"""Which weights eval loads (newest complete, as training does), broken files, where
results go, and one-line CLI errors."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from eval_helpers import make_run

from mta_repro.eval.load import default_out_dir, load_model


def save_dcp(run_dir, step, model):
    import torch.distributed.checkpoint as dcp

    ck = Path(run_dir) / "checkpoints" / f"{step:010d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": step}, checkpoint_id=str(ck))
    (ck / ".complete").touch()
    return ck


def perturbed(model, seed):
    """Change ``model``'s weights in place; return a copy of the new state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, sd):
    return all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_newer_checkpoint_beats_stale_export(tmp_path):
    run_dir, ref = make_run(tmp_path / "run")  # export at step 7
    export_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    new_sd = perturbed(ref, 1)
    save_dcp(run_dir, 9, ref)
    with pytest.warns(UserWarning, match="step 9.*newer than .*consolidated.pt.*step 7"):
        model, _ = load_model(run_dir, device="cpu")
    assert same(model, new_sd) and model.source["step"] == 9 and model.source["kind"] == "dcp"
    # an export at least as new as every checkpoint wins (ties too), as in training
    run2, ref2 = make_run(tmp_path / "run2")
    old_sd = perturbed(ref2, 2)
    save_dcp(run2, 7, ref2)
    model, _ = load_model(run2, device="cpu")
    assert model.source["kind"] == "consolidated" and not same(model, old_sd)
    assert not same(load_model(run_dir / "export" / "consolidated.pt", device="cpu")[0], new_sd)
    assert same(load_model(run_dir / "export" / "consolidated.pt", device="cpu")[0], export_sd)


def test_corrupt_latest_checkpoint_falls_back(tmp_path):
    run_dir, ref = make_run(tmp_path / "run", fmt="dcp")  # complete checkpoint at step 7
    good = {k: v.clone() for k, v in ref.state_dict().items()}
    perturbed(ref, 3)
    bad = save_dcp(run_dir, 9, ref)
    for f in bad.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated shard
    with pytest.warns(UserWarning, match=f"{bad}.*unreadable.*falling back"):
        model, _ = load_model(run_dir, device="cpu")
    assert same(model, good) and model.source["step"] == 7


def test_truncated_export(tmp_path):
    run_dir, ref = make_run(tmp_path / "run")
    export = run_dir / "export" / "consolidated.pt"
    export.write_bytes(export.read_bytes()[:2000])
    with pytest.raises(ValueError, match=f"{export} is unreadable"):
        load_model(export, device="cpu")
    with pytest.raises(ValueError, match=f"{export} is unreadable"):
        load_model(run_dir, device="cpu")  # nothing else to fall back to
    save_dcp(run_dir, 5, ref)
    with pytest.warns(UserWarning, match="unreadable.*falling back"):
        model, _ = load_model(run_dir, device="cpu")
    assert model.source["step"] == 5


def test_results_of_an_export_go_to_the_run(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    pt = run_dir / "export" / "consolidated.pt"
    assert default_out_dir(pt) == run_dir / "eval" == default_out_dir(run_dir)
    loose = tmp_path / "w.pt"
    loose.write_bytes(pt.read_bytes())
    assert default_out_dir(loose) == tmp_path / "eval"
    from mta_repro.eval.run import main

    assert main([str(pt), "tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]) == 0
    res = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert res["step"] == 7 and res["weights"] == str(pt)
    out = tmp_path / "elsewhere"
    assert (
        main([str(pt), "tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]", f"out_dir={out}"])
        == 0
    )
    assert (out / "ppl.json").is_file()


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )


def one_line_error(r, *expected):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for e in expected:
        assert e in lines[0], lines[0]


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    one_line_error(cli("mta_repro.eval", str(run_dir), "tasks=ppl"), "eval: error:", "tasks=ppl", "tasks=[ppl]")
    one_line_error(cli("mta_repro.eval", str(run_dir), "eval/preset=papr"), "eval/preset=papr", "'paper'")
    one_line_error(cli("mta_repro.eval", str(tmp_path / "nope")), "does not exist")
    one_line_error(cli("mta_repro.estimate", "model=880"), "estimate: error: model=880", "'880m'")
    one_line_error(cli("mta_repro.estimate", "model.dimm=3"), "model.dimm")
    for mod in ("mta_repro.eval", "mta_repro.estimate"):
        r = cli(mod, "--help")
        assert r.returncode == 0 and "python -m " + mod in r.stdout, (mod, r.stdout[:500], r.stderr[-500:])
