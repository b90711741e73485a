"""Load a model (and its tokenizer) for evaluation.

``load_model(path)`` accepts a run directory (its newest readable weights: the export or a
newer complete DCP checkpoint, read in this single process), a checkpoint folder or a
consolidated ``.pt`` file (``{"model": state_dict, "config": dict, "step": int}``); finding
and reading them is ``mta_repro.weights``'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mta_repro.device import resolve_device
from mta_repro.errors import UserError
from mta_repro.model import Transformer, build_model
from mta_repro.weights import find_weights, load_weights, read_config

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"eval dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_config(path: str | Path) -> DictConfig:
    """The resolved training config of a run directory or consolidated file (no weights)."""
    cand = find_weights(path)[0]
    cfg = read_config(cand)
    if cfg is None:
        raise UserError(
            f"checkpoint: {cand.path} carries no run config (a consolidated export or a run's "
            "checkpoint has one; a Lingua/release checkpoint is converted with mta_repro.release)"
        )
    return OmegaConf.create(cfg)


def load_model(
    path: str | Path,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype = torch.float32,
    identity: bool = False,
) -> tuple[Transformer, DictConfig]:
    """(model in eval mode on ``device``/``dtype``, resolved training config).

    The weights are ``mta_repro.weights.load_weights(path)``'s: the newest readable ones of
    a run directory (a checkpoint saved after the export beats it; the export wins a tie,
    as in training), a checkpoint folder or a consolidated ``.pt``. An unreadable newer one
    is named in one line on stderr with the one used instead; an explicit ``.pt`` that is
    broken, or a file that would unpickle code, is an error naming the file.
    ``model.source`` = {"kind", "path", "step", "record"} of the weights that were loaded
    (``record``: what they came from, mta_repro/runs/provenance.py); ``identity`` adds
    "weights_sha256", the sha256 of their tensors as read (float32).
    """
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    w = load_weights(path, who="mta_repro.eval")
    src = w.source.path
    from mta_repro.runs.provenance import check_own_weights

    check_own_weights(path, src, w.record)  # an export copied from another run: refused
    if w.config is None:
        raise UserError(
            f"checkpoint: {src} carries no run config (a consolidated export or a run's checkpoint "
            "has one; a Lingua/release checkpoint is converted with python -m mta_repro.release)"
        )
    cfg = OmegaConf.create(w.config)
    if "model" not in cfg:
        raise UserError(f"checkpoint: the config of {src} has no 'model' section")
    model = build_model(cfg.model, device="cpu", init=False)
    missing, unexpected = model.load_state_dict(w.state, strict=False)
    missing = [m for m in missing if not m.endswith("output.weight") or not model.args.weight_tying]
    if missing or unexpected:
        raise UserError(
            f"checkpoint: {src} does not match the config's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    digest = None
    if identity:
        from mta_repro.runs.provenance import state_digest

        digest = state_digest(w.state)
    model = model.to(device=device, dtype=dtype).eval()
    source = {
        "kind": w.source.kind,
        "path": str(src),
        "step": None if w.step is None else int(w.step),
        "record": w.record,
        "weights_sha256": digest,
    }
    model.source = source  # pyright: ignore[reportArgumentType]  # nn.Module takes any value; torch types it Tensor | Module
    return model, cfg


def default_out_dir(path: str | Path) -> Path:
    """Where results of evaluating ``path`` go: ``<run_dir>/eval`` for a run directory
    and for a run's ``export/consolidated.pt`` (where ``report`` looks), else an
    ``eval/`` folder next to a loose ``.pt`` file."""
    path = Path(path)
    if path.is_dir():
        return path / "eval"
    parent = path.parent
    if parent.name == "export" and (parent.parent / "config.yaml").is_file():
        return parent.parent / "eval"
    return parent / "eval"


def load_tokenizer(cfg: Any):
    """The run's tokenizer (``cfg.data.tokenizer``), through ``mta_repro.data``."""
    from mta_repro.data import build_tokenizer

    if "data" not in cfg or "tokenizer" not in cfg.data:
        raise UserError("config: no data.tokenizer section to build the tokenizer from")
    tok_cfg = cfg.data.tokenizer
    try:
        from mta_repro.data.args import TokenizerArgs

        fields = OmegaConf.to_container(tok_cfg, resolve=True)
        tok_args = TokenizerArgs(**{str(k): v for k, v in fields.items()}) if isinstance(fields, dict) else tok_cfg
    except (ImportError, TypeError):
        tok_args = tok_cfg
    return build_tokenizer(tok_args)


def check_vocab(tokenizer, model) -> None:
    """The tokenizer's id count must equal the model's vocabulary size."""
    n_words = int(tokenizer.n_words)
    vocab = int(model.args.vocab_size)
    if n_words != vocab:
        raise UserError(
            f"tokenizer has n_words={n_words} but the model's vocab_size is {vocab}: "
            "this tokenizer does not belong to this model (check data.tokenizer)"
        )


def load_for_eval(
    path: str | Path,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype = torch.float32,
    tokenizer=None,
    identity: bool = False,
) -> tuple[Transformer, Any, DictConfig]:
    """(model, tokenizer, cfg), with the tokenizer/vocab check done before any work."""
    model, cfg = load_model(path, device=device, dtype=dtype, identity=identity)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    check_vocab(tok, model)
    return model, tok, cfg
