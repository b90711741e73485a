"""The weights a stage starts from (``checkpoint.init_from``): another run's or the
release's, as the model (``init_mode=model``) or a baseline with MTA inserted at identity
(``baseline_to_mta``, Appendix I), read on rank 0 and recorded with their digest."""

from __future__ import annotations

import dataclasses
import sys

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
