"""Every OmegaConf resolver the configs use, registered in one place (at ``import mta_repro.train.config``).

Resolvers must exist before any config is resolved, whichever entry point composed it, so
``mta_repro.train.config`` (imported by every entry point that composes or loads a config) calls
``register_resolvers()``; ``import mta_repro`` alone registers nothing. The names are the ones the YAML
files (and the configs ``mta_repro.release`` writes) already carry.

=====================  ===========================================  =====================
resolver               what it gives                                used by
=====================  ===========================================  =====================
release_placeholder    an error naming the override to pass         release-converted YAML
mta_layers_every       the conv layers ``2, 2+k, ...`` below n       ablation_conv_layers
required               an error naming a field that must be given    the stage experiments
=====================  ===========================================  =====================
"""

from __future__ import annotations

from typing import Any

from mta_repro.errors import UserError


def release_placeholder(field: str):
    """``${release_placeholder:data.root_dir}``: a value the official release's config left
    as a placeholder (``<path_to_dataset>``); reading it says which override to pass."""
    raise UserError(f"{field} is a placeholder in the official release's config: pass {field}=... on the command line")


FIRST_CONV_LAYER = 2  # the release's choice: 2, 6, 10, ... (0-based)


def mta_layers_every(n_layers: Any, stride: Any) -> str:
    """Comma list of the layers ``FIRST_CONV_LAYER + i*stride`` below ``n_layers`` (stride 1: all)."""
    n, k = int(n_layers), int(stride)
    if k == 1:
        return ",".join(str(i) for i in range(n))
    if k < 1 or k >= n or n <= FIRST_CONV_LAYER:
        hi = n - 1
        raise UserError(
            f"model.mta.mta_layers: every {k}th layer is not a valid choice for model.n_layers={n} "
            f"(valid strides: 1..{hi}"
            + ("" if n > FIRST_CONV_LAYER else f"; a model of {n} layers has no layer {FIRST_CONV_LAYER}")
            + ")"
        )
    return ",".join(str(i) for i in range(FIRST_CONV_LAYER, n, k))


def required(field: str, what: str = "a value") -> None:
    """``${required:checkpoint.init_from,'the pretraining run'}``: a field the user (or the
    pipeline) must set; reading it unset is an error naming the field. (A YAML ``???``
    cannot override a group's default: OmegaConf merges skip missing values.)"""
    raise UserError(f"{field}: required, give {what} ({field}=<absolute path>)")


RESOLVERS = {
    "release_placeholder": release_placeholder,
    "mta_layers_every": mta_layers_every,
    "required": required,
}


def register_resolvers() -> None:
    """Register every resolver of ``RESOLVERS`` (idempotent)."""
    from omegaconf import OmegaConf

    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
