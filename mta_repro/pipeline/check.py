"""Appendix I check: the inserted model's loss on its first batch equals the source's.

``python -m mta_repro.pipeline.check <the insertion stage's training overrides>`` builds
the stage's starting weights exactly as the trainer does (``checkpoint.init_from`` +
``checkpoint.init_mode=baseline_to_mta``, or ``model`` for the control), takes the first batch the trainer's loader
gives rank 0, and computes the cross entropy of the source model and of the inserted model
on it in float32 (TF32 off). It writes ``<run_dir>/appendix_i_check.json`` ({source_loss,
inserted_loss, abs_diff, tol, ok, ...}), prints both losses on one line, and exits 1 when
they differ by more than ``--tol`` (default 1e-4 nats: float rounding, not a model
difference). Only exact-identity configs (group norm and gating off) can pass; the trainer
refuses others already.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mta_repro.cli import honour_ctrl_c
from mta_repro.errors import UserError
from mta_repro.files import replace_atomically

DEFAULT_TOL = 1e-4
RESULT_FILE = "appendix_i_check.json"


def first_batch_losses(overrides: Sequence[str], device: str = "auto") -> dict:
    import torch

    from mta_repro.dataclass_config import to_dataclass
    from mta_repro.eval.load import load_model
    from mta_repro.model import build_model, to_model_args

    # the trainer's own stage start, so the check sees exactly what training starts from
    from mta_repro.model.loss import cross_entropy
    from mta_repro.train.args import CheckpointArgs
    from mta_repro.train.config import compose
    from mta_repro.train.plugins import load_factory
    from mta_repro.train.stage_weights import stage_start_weights

    cfg = compose(list(overrides))
    ck = to_dataclass(CheckpointArgs, cfg.checkpoint, "checkpoint")
    if ck.init_from is None:
        raise UserError("appendix I check: the stage needs checkpoint.init_from (the source model)")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model_args = to_model_args(cfg.model)
        weights = stage_start_weights(ck, model_args)  # what the trainer starts from
        inserted = build_model(model_args, device="cpu", init=False)
        assert weights is not None  # init_from is set
        inserted.load_state_dict(weights)
        inserted = inserted.to(dev).eval()
        source, _ = load_model(ck.init_from, device=dev, dtype=torch.float32)
        try:
            loader = load_factory(cfg.trainer.loader)(cfg.data, 0, 1)
        except ValueError:  # e.g. a continued stream of a many-rank source: any batch shows identity
            loader = load_factory("mta_repro.data:build_train_loader")(cfg.data, 0, 1)
        try:
            batch = next(loader)
        finally:
            if hasattr(loader, "close"):
                loader.close()
        x, y = batch["input"].to(dev), batch["target"].to(dev)
        with torch.no_grad():
            src = float(cross_entropy(source, x, y))
            ins = float(cross_entropy(inserted, x, y))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return {
        "source": str(ck.init_from),
        "run_dir": str(cfg.run_dir),
        "batch_shape": list(x.shape),
        "device": str(dev),
        "source_loss": src,
        "inserted_loss": ins,
        "abs_diff": abs(src - ins),
    }


def check(overrides: Sequence[str], tol: float = DEFAULT_TOL, device: str = "auto") -> dict:
    res = first_batch_losses(overrides, device)
    res["tol"] = tol
    res["ok"] = res["abs_diff"] <= tol
    out = Path(res["run_dir"])
    out.mkdir(parents=True, exist_ok=True)
    replace_atomically(out / RESULT_FILE, json.dumps(res, indent=1).encode())  # whole or absent
    return res


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    honour_ctrl_c()
    tol, device = DEFAULT_TOL, "auto"
    rest = []
    for a in argv:
        if a.startswith("--tol="):
            tol = float(a.split("=", 1)[1])
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
        else:
            rest.append(a)
    try:
        res = check(rest, tol, device)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    line = (
        f"appendix I check: first-batch loss source {res['source_loss']:.6f} | inserted "
        f"{res['inserted_loss']:.6f} | |diff| {res['abs_diff']:.2e} (tol {tol:g})"
    )
    if not res["ok"]:
        print(f"error: {line}: the MTA-inserted model does not compute what the source computed", file=sys.stderr)
        return 1
    print(line + ": identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
