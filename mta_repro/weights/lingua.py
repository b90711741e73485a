"""The official release's and Meta Lingua's checkpoints, read as ours: their state-dict key
names (Lingua's, which are ours, plus wrapper prefixes and ``TiedLinear``'s
``output.tied_module.weight``), their ``consolidated/consolidated.pth`` folders, their DCP
step folders (``<dump_dir>/checkpoints/<step:010d>/`` with ``params.json``) and dump dirs.

Only reading: converting a release *config* is ``mta_repro.release``'s job, which the
trainer and eval never import.
"""

from __future__ import annotations

import re
from pathlib import Path

from mta_repro.errors import UserError

# Module wrappers that prefix parameter names (torch.compile, activation checkpointing,
# FSDP1); they can sit at any depth (Lingua wraps blocks).
_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
# Buffers the release may carry that we recompute.
_DROPPED = ("rope_embeddings.freqs_cis",)


def release_state_dict_to_ours(sd: dict) -> dict:
    """A Lingua/release model state dict -> ours (a new dict; tensors shared, not copied).

    Key names are Lingua's on both sides; this removes wrapper path components
    (``_orig_mod.``, ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``, a leading
    DDP ``module.``), drops the RoPE table buffer, and folds ``TiedLinear``'s
    ``output.tied_module.weight`` into ``tok_embeddings.weight`` (refusing a tied copy that
    differs). Our own state dicts pass through unchanged.
    """
    import torch

    out: dict = {}
    for key, value in sd.items():
        parts = [p for p in key.split(".") if p not in _WRAPPERS]
        if parts and parts[0] == "module":
            parts = parts[1:]
        new = ".".join(parts)
        if new in out:
            raise UserError(f"state dict: {key!r} and another key both map to {new!r}")
        out[new] = value
    for key in _DROPPED:
        out.pop(key, None)
    tied = out.pop("output.tied_module.weight", None)
    if tied is not None:
        emb = out.get("tok_embeddings.weight")
        if emb is None:
            out["tok_embeddings.weight"] = tied
        elif emb.shape != tied.shape or not torch.equal(emb.to(tied.dtype), tied):
            raise UserError(
                "state dict: output.tied_module.weight differs from tok_embeddings.weight "
                "(a tied output must be the embedding)"
            )
    return out


def release_checkpoint_path(path: str | Path) -> Path:
    """Where the weights of a release/Lingua checkpoint are: the ``consolidated.pth`` of a
    ``consolidated/`` folder or of a step folder holding one; a Lingua step folder (DCP,
    ``params.json``, no ``consolidated/``) itself; the newest such step of a Lingua
    ``dump_dir`` (``<dump_dir>/checkpoints/<step:010d>``). Any other path unchanged."""
    path = Path(path)
    if not path.is_dir():
        return path
    for cand in (path / "consolidated.pth", path / "consolidated" / "consolidated.pth"):
        if cand.is_file():
            return cand
    if is_lingua_step(path):
        return path
    root = path / "checkpoints"
    if root.is_dir():
        steps = sorted(p for p in root.iterdir() if re.fullmatch(r"\d{10}", p.name) and is_lingua_step(p))
        if steps and not any((p / ".complete").exists() for p in root.iterdir()):
            return release_checkpoint_path(steps[-1])
    return path


def is_lingua_step(path: Path) -> bool:
    # Lingua's CheckpointManager.save: DCP files + params.json (+ train_state_*.json); ours
    # marks a finished save with .complete and has no params.json.
    return (path / ".metadata").is_file() and (path / "params.json").is_file() and not (path / ".complete").exists()
