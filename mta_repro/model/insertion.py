"""Appendix I insertion: a trained baseline into an MTA model.

``baseline_to_mta`` is the paper's Appendix I at the model level: a trained baseline's
weights go into an MTA model whose new parts (key-query kernels, head mixing) start at
identity, so the converted model computes exactly what the baseline computed until
training moves the new parts.
"""

from __future__ import annotations

import dataclasses

import torch

from mta_repro.errors import UserError
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.model.transformer import Transformer


def baseline_to_mta(
    baseline_state: dict[str, torch.Tensor],
    baseline_args: ModelArgs,
    mta: MTAArgs | dict,
    device: str | torch.device = "cpu",
    exact: bool = True,
) -> Transformer:
    """An MTA model carrying ``baseline_state``, its MTA parts identity-initialised.

    ``mta`` replaces ``baseline_args.mta``; every other model field stays. With
    ``exact`` (default) the MTA options must keep the function unchanged at insertion:
    identity init, and no group norm or gating (a norm rescales and a sigmoid gate
    halves the output, so neither is an identity); pass ``exact=False`` to insert them
    anyway. Raises ValueError naming the field that breaks the rule.
    """
    from mta_repro.model import build_model

    mta = MTAArgs(**mta) if isinstance(mta, dict) else mta
    if baseline_args.mta.use_mta or baseline_args.diff_transformer:
        raise UserError("baseline_to_mta: the source model must be the plain baseline (model.mta.use_mta false)")
    if not mta.use_mta:
        raise UserError("baseline_to_mta: model.mta.use_mta must be true for the target")
    if exact:
        for name, bad in (
            ("init_method", mta.init_method != "identity"),
            ("group_norm", mta.group_norm),
            ("add_gating", mta.add_gating),
        ):
            if bad:
                raise UserError(
                    f"baseline_to_mta: model.mta.{name}={getattr(mta, name)!r} would change the "
                    "baseline's outputs at insertion; use init_method=identity, group_norm=false, "
                    "add_gating=false, or pass exact=False"
                )
    args = dataclasses.replace(baseline_args, mta=mta)
    model = build_model(args, device=device, init=True)  # MTA parts: identity per init_method
    missing, unexpected = model.load_state_dict(baseline_state, strict=False)
    if unexpected:
        raise UserError(f"baseline_to_mta: keys not in the MTA model: {sorted(unexpected)[:5]}")
    new_parts = ("mta_kernel", "mta_kernel_after_sm", "wpsm", "wposm", "head_kernel", "subln", "gate")
    not_new = [k for k in missing if not any(f".attention.{p}" in k for p in new_parts)]
    if not_new:
        raise UserError(f"baseline_to_mta: baseline state lacks {sorted(not_new)[:5]}")
    return model
