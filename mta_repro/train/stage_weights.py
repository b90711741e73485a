"""The weights a stage starts from (``checkpoint.init_from``): another run's or the
release's, as the model (``init_mode=model``) or a baseline with MTA inserted at identity
(``baseline_to_mta``, Appendix I), read on rank 0 and recorded with their digest; and the
stage such a start is (``start_stage``), which the trainer records as ``run.stage`` when the
config leaves it null."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from mta_repro.train.args import CheckpointArgs


def stage_start_weights(
    ck: CheckpointArgs, model_args, is_main: bool = True, identity: dict | None = None
) -> dict | None:
    """Full source weights for a stage start (``checkpoint.init_from``, read on rank 0 only),
    or None for the seeded init. mta_repro.pipeline.check calls it too, so that its
    Appendix I check sees exactly what training starts from. ``identity`` (a dict) gets
    the source's path, step and the sha256 of its tensors (the run's record)."""
    if ck.init_from is None or not is_main:
        return None
    from mta_repro.model.args import MTAArgs
    from mta_repro.train.checkpoint import load_init_weights

    # baseline_to_mta (Appendix I): a baseline's weights go into this MTA model, new parts at identity.
    base_args = dataclasses.replace(model_args, mta=MTAArgs(use_mta=False))
    # Ours (load_model_state) or a release/Lingua checkpoint, in our key layout, checked
    # against the model it goes into (keys, shapes, float dtypes) before anything is copied.
    sd, step = load_init_weights(ck.init_from, expect=model_args if ck.init_mode == "model" else base_args)
    if identity is not None:
        from mta_repro.runs.provenance import state_digest

        identity.update(path=str(ck.init_from), step=step, weights_sha256=state_digest(sd))
    if ck.init_mode == "model":
        print(f"[mta_repro.train] initialised from {ck.init_from} (step {step}): model weights only", file=sys.stderr)
        return sd
    from mta_repro.model.insertion import baseline_to_mta

    model = baseline_to_mta(sd, base_args, model_args.mta, device="cpu")
    print(f"[mta_repro.train] inserted MTA into the baseline from {ck.init_from} (step {step})", file=sys.stderr)
    return model.state_dict()


# ------------------------------------------------------------------ the stage a start is
def _get(cfg: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        if not isinstance(cfg, dict) or k not in cfg:
            return None
        cfg = cfg[k]
    return cfg


def source_config(src: Path) -> tuple[dict | None, bool]:
    """(the run config, is an import) of the weights at ``src`` (``checkpoint.init_from``):
    a run dir's or DCP checkpoint's config.yaml; a consolidated .pt's header, read as data
    only and memory-mapped (``mta_repro.weights.load_pt``: the tensors are not read), an
    import when it names a ``source`` (``python -m mta_repro.hf import``). None when there is
    none readable here (a release or Lingua checkpoint, another machine's path)."""
    if src.is_file() or src.suffix == ".pt":
        from mta_repro.errors import UserError
        from mta_repro.weights import load_pt

        try:
            blob = load_pt(src) if src.is_file() else None
        except (UserError, OSError):  # truncated, foreign objects: unknown
            blob = None
        if not isinstance(blob, dict) or not isinstance(blob.get("config"), dict):
            return None, False
        return blob["config"], blob.get("source") is not None
    cfg_file = src / "config.yaml"
    if not cfg_file.is_file():
        return None, False
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False)
    except Exception:  # noqa: BLE001 - an unreadable source config: unknown
        return None, False
    return (cfg, False) if isinstance(cfg, dict) else (None, False)


def start_stage(cfg: dict | None) -> str | None:
    """The stage (``run.stage``) of a run with the resolved config ``cfg`` (a dict), from
    what its start knows: ``pretrain`` without ``checkpoint.init_from`` (from scratch);
    ``insertion`` with ``init_mode=baseline_to_mta`` (Appendix I); weights loaded as the
    model are ``long_context`` (the 4K finetune) when the run changes the source's RoPE
    (theta or scaling) or lengthens its data.seq_len (not compared for an import of a
    Hugging Face checkpoint, whose seq_len is a default, not a trained context), and
    ``continued`` otherwise. None when the source's config is not readable here."""
    src = _get(cfg, "checkpoint.init_from")
    if not src:
        return "pretrain"
    if _get(cfg, "checkpoint.init_mode") == "baseline_to_mta":
        return "insertion"
    source, imported = source_config(Path(str(src)))
    if source is None:
        return None
    same_rope = _get(cfg, "model.rope_theta") == _get(source, "model.rope_theta") and _get(
        cfg, "model.rope_scaling"
    ) == _get(source, "model.rope_scaling")
    if imported:
        return "continued" if same_rope else "long_context"
    seq, src_seq = _get(cfg, "data.seq_len"), _get(source, "data.seq_len")
    longer = seq is not None and src_seq is not None and seq > src_seq
    return "long_context" if longer or not same_rope else "continued"
