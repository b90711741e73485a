"""Consolidated single-file export for evaluation.

``<run_dir>/export/consolidated.pt`` = ``{"model": full fp32 state dict (Lingua keys),
"config": the resolved run config as a plain dict, "step": int, "provenance": the
checkpoint's record (mta_repro/runs/provenance.py) with the sha256 of the weights}``,
made from the latest complete DCP checkpoint in a single process (no process group needed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import OmegaConf

from mta_repro.errors import NoSpaceError, UserError
from mta_repro.files import caused_by_enospc, save_file_atomic
from mta_repro.runs.provenance import EXPORT_KEY, read_record, state_digest
from mta_repro.weights import Candidate, read_weights
from mta_repro.weights.layout import latest_checkpoint


def export_consolidated(run_dir: str | Path, checkpoint: Path | None = None) -> Path:
    """Write ``<run_dir>/export/consolidated.pt`` from ``checkpoint`` (default: latest)."""
    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file}: missing (is {run_dir} a training run directory?)")
    ckpt = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"{run_dir}/checkpoints: no complete checkpoint to export")
    cfg = OmegaConf.load(cfg_file)
    # This process reads every shard itself, whatever the saving world size (fp32, CPU),
    # with the checks of any weights read (float tensors, the shapes of its config's model).
    w = read_weights(Candidate("dcp", ckpt))
    sd, step = {k: v.contiguous() for k, v in w.state.items()}, w.step
    out = run_dir / "export" / "consolidated.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    # What the weights came from (the checkpoint's record) and the sha256 of their tensors.
    record = {**(read_record(ckpt) or {}), "checkpoint": str(ckpt), "weights_sha256": state_digest(sd)}
    blob = {
        "model": sd,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "step": int(step if step is not None else ckpt.name),
        EXPORT_KEY: record,
    }
    try:
        return save_file_atomic(blob, out)  # atomic: readers never see a half-written export
    except Exception as e:
        need = sum(v.numel() * v.element_size() for v in sd.values())
        try:
            free: int | None = shutil.disk_usage(out.parent).free
        except OSError:
            free = None
        if not (caused_by_enospc(e) or (free is not None and free < need)):
            raise
        have = f"{free:,} bytes free" if free is not None else "free space unknown"
        raise NoSpaceError(
            f"no space left on device: the export {out} needs about {need:,} bytes and the filesystem has "
            f"{have} (the partial {out.name}.tmp is removed; the checkpoint {ckpt} is intact). Free space and "
            "rerun the same command to make the export"
        ) from None  # torch.save's own error says nothing about space ("file write failed")


def export_is_current(run_dir: str | Path) -> bool:
    """Whether ``<run_dir>/export/consolidated.pt`` holds the latest complete checkpoint's
    step (its header read memory-mapped; a missing or unreadable export is not current)."""
    from mta_repro.weights import load_pt

    run_dir = Path(run_dir)
    out, ckpt = run_dir / "export" / "consolidated.pt", latest_checkpoint(run_dir)
    if ckpt is None or not out.is_file():
        return ckpt is None
    try:
        blob = load_pt(out)
    except (UserError, OSError):
        return False
    return isinstance(blob, dict) and str(blob.get("step")) == str(int(ckpt.name))


USAGE = """usage: python -m mta_repro.train.export <run_dir>

Writes <run_dir>/export/consolidated.pt ({"model", "config", "step"}, what evaluation
loads) from the run's latest complete checkpoint, and prints its path."""


def main(argv=None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if len(argv) != 1:
        print(USAGE.splitlines()[0], file=sys.stderr)
        return 2
    from mta_repro.cli import run_cli

    def run() -> int:
        print(export_consolidated(argv[0]))
        return 0

    return run_cli("mta_repro.train.export", run)


if __name__ == "__main__":
    import sys

    sys.exit(main())
