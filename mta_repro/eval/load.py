"""Load a model (and its tokenizer) for evaluation.

``load_model(path)`` accepts a run directory (``export/consolidated.pt`` if present,
else the latest complete DCP checkpoint, read in this single process) or a
consolidated ``.pt`` file (``{"model": state_dict, "config": dict, "step": int}``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from mta_repro.device import resolve_device  # noqa: F401 - the one device choice (eval.dist, tests)
from mta_repro.errors import UserError
from mta_repro.model import build_model

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"eval dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def complete_checkpoints(run_dir: Path) -> list:
    """``checkpoints/<step>/`` folders with a ``.complete`` marker, newest first."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    steps = [
        p for p in ckpt_root.iterdir()
        if p.is_dir() and re.fullmatch(r"\d+", p.name) and (p / ".complete").exists()
    ]
    return sorted(steps, key=lambda p: -int(p.name))


def latest_complete_checkpoint(run_dir: Path) -> Optional[Path]:
    """The highest-step ``checkpoints/<step:010d>/`` that has a ``.complete`` marker."""
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def _read_consolidated(src: Path) -> dict:
    try:
        blob = torch.load(src, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - truncated/corrupt files raise many types
        raise UserError(f"checkpoint: {src} is unreadable ({type(e).__name__}: {e}); truncated or corrupt?") from None
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        raise UserError(f"checkpoint: {src} is not a consolidated export (expected keys 'model', 'config')")
    return blob


def _candidates(path: Union[str, Path]) -> list:
    """Weights to try, newest first: [(kind, file or dir, step or None)].

    A run directory offers its export and its complete DCP checkpoints; the newest
    wins, as in training (``train.checkpoint.load_model_state``): a checkpoint saved
    after the export beats the stale export, and the export wins a tie.
    """
    path = Path(path)
    if path.is_file():
        return [("consolidated", path, None)]
    if not path.exists():
        raise UserError(f"checkpoint: {path} does not exist (expected a run directory or a consolidated .pt file)")
    ckpts = [("dcp", c, int(c.name)) for c in complete_checkpoints(path)]
    export = path / "export" / "consolidated.pt"
    if export.is_file():
        try:
            step = int(_read_consolidated(export).get("step") or 0)
        except ValueError as e:  # a broken export: the checkpoints may still do
            if not ckpts:
                raise
            warnings.warn(f"{e}; using the checkpoints instead")
        else:
            older = [c for c in ckpts if c[2] <= step]
            newer = [c for c in ckpts if c[2] > step]
            if newer:
                warnings.warn(
                    f"checkpoint: {newer[0][1]} (step {newer[0][2]}) is newer than {export} (step {step}); "
                    "evaluating the newer checkpoint (re-export with python -m mta_repro.train.export)"
                )
            return newer + [("consolidated", export, step)] + older
    if not ckpts:
        raise UserError(
            f"checkpoint: run directory {path} has neither export/consolidated.pt nor a "
            f"complete DCP checkpoint under checkpoints/<step>/ (with a .complete marker)"
        )
    return ckpts


def _resolve_source(path: Union[str, Path]) -> tuple[str, Path]:
    """('consolidated' | 'dcp', file or dir) that would be tried first."""
    kind, src, _ = _candidates(path)[0]
    return kind, src


def load_config(path: Union[str, Path]) -> DictConfig:
    """The resolved training config of a run directory or consolidated file (no weights)."""
    kind, src = _resolve_source(path)
    if kind == "consolidated":
        return OmegaConf.create(_read_consolidated(src)["config"])
    return _run_config(src)


def _run_config(ckpt: Path) -> DictConfig:
    cfg_file = ckpt.parents[1] / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"checkpoint: {cfg_file} is missing (the run's resolved config)")
    return OmegaConf.load(cfg_file)


def _read_weights(kind: str, src: Path) -> tuple:
    """(state dict, config, step) of one candidate; ValueError naming the file if broken."""
    if kind == "consolidated":
        blob = _read_consolidated(src)
        state = blob["model"]
        cfg = OmegaConf.create(blob["config"])
        return state, cfg, blob.get("step")
    cfg = _run_config(src)
    if "model" not in cfg:
        raise UserError(f"checkpoint: the config of {src} has no 'model' section")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # Only the "model" entry is requested; DCP reads just those tensors, in this
    # single process (no process group needed).
    state = dict(build_model(cfg.model, device="meta", init=False).state_dict())
    state = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({"model": state}, checkpoint_id=str(src))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        first = " ".join(str(e).split())[:300]
        raise UserError(f"checkpoint: {src} is unreadable ({type(e).__name__}: {first}); corrupt or partly written?") from None
    return state, cfg, int(src.name)


def load_model(
    path: Union[str, Path],
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = torch.float32,
) -> tuple[torch.nn.Module, DictConfig]:
    """(model in eval mode on ``device``/``dtype``, resolved training config).

    ``model.source`` = {"kind", "path", "step"} of the weights that were loaded. When
    the newest weights of a run directory are unreadable (a corrupt checkpoint, a
    truncated export), the next newest complete ones are used, with a warning naming
    the broken file; an explicit ``.pt`` that is broken is an error.
    """
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    candidates = _candidates(path)
    errors = []
    for kind, src, _ in candidates:
        try:
            state, cfg, step = _read_weights(kind, src)
            break
        except ValueError as e:
            errors.append(str(e))
            if len(errors) < len(candidates):
                warnings.warn(f"{e}; falling back to the previous complete checkpoint")
    else:
        raise UserError(errors[0] if len(errors) == 1 else "; ".join(errors))
    if "model" not in cfg:
        raise UserError(f"checkpoint: the config of {path} has no 'model' section")
    model = build_model(cfg.model, device="cpu", init=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("output.weight") or not model.args.weight_tying]
    if missing or unexpected:
        raise UserError(
            f"checkpoint: {src} does not match the config's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model = model.to(device=device, dtype=dtype).eval()
    model.source = {"kind": kind, "path": str(src), "step": None if step is None else int(step)}
    return model, cfg


def default_out_dir(path: Union[str, Path]) -> Path:
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

        tok_args = TokenizerArgs(**OmegaConf.to_container(tok_cfg, resolve=True))
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


def load_for_eval(path, device="auto", dtype=torch.float32, tokenizer=None):
    """(model, tokenizer, cfg), with the tokenizer/vocab check done before any work."""
    model, cfg = load_model(path, device=device, dtype=dtype)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    check_vocab(tok, model)
    return model, tok, cfg
