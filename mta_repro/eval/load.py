"""Load a model (and its tokenizer) for evaluation.

``load_model(path)`` accepts a run directory (``export/consolidated.pt`` if present,
else the latest complete DCP checkpoint, read in this single process) or a
consolidated ``.pt`` file (``{"model": state_dict, "config": dict, "step": int}``).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

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
        raise ValueError(f"eval dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """"auto" (or None) = the first GPU when there is one, else the CPU. Asking for a
    GPU that this machine does not have is a clear error, not a CUDA assertion."""
    if device is None or str(device) == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # under torchrun each process takes the GPU of its local rank
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"eval device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"eval device: {device!r} was asked for but this machine has no CUDA GPU (use device=auto or device=cpu)")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"eval device: {device!r} was asked for but this machine has {n} CUDA GPU(s)")
    return dev


def latest_complete_checkpoint(run_dir: Path) -> Optional[Path]:
    """The highest-step ``checkpoints/<step:010d>/`` that has a ``.complete`` marker."""
    ckpt_root = run_dir / "checkpoints"
    if not ckpt_root.is_dir():
        return None
    steps = [
        p for p in ckpt_root.iterdir()
        if p.is_dir() and re.fullmatch(r"\d+", p.name) and (p / ".complete").exists()
    ]
    return max(steps, key=lambda p: int(p.name)) if steps else None


def _resolve_source(path: Union[str, Path]) -> tuple[str, Path]:
    """('consolidated' | 'dcp', file or dir); raises before any weights are read."""
    path = Path(path)
    if path.is_file():
        return "consolidated", path
    if not path.exists():
        raise ValueError(f"checkpoint: {path} does not exist (expected a run directory or a consolidated .pt file)")
    export = path / "export" / "consolidated.pt"
    if export.is_file():
        return "consolidated", export
    ckpt = latest_complete_checkpoint(path)
    if ckpt is None:
        raise ValueError(
            f"checkpoint: run directory {path} has neither export/consolidated.pt nor a "
            f"complete DCP checkpoint under checkpoints/<step>/ (with a .complete marker)"
        )
    return "dcp", ckpt


def load_config(path: Union[str, Path]) -> DictConfig:
    """The resolved training config of a run directory or consolidated file (no weights)."""
    kind, src = _resolve_source(path)
    if kind == "consolidated":
        blob = torch.load(src, map_location="cpu", weights_only=False, mmap=True)
        if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
            raise ValueError(f"checkpoint: {src} is not a consolidated export (expected keys 'model', 'config')")
        return OmegaConf.create(blob["config"])
    cfg_file = src.parents[1] / "config.yaml"
    if not cfg_file.is_file():
        raise ValueError(f"checkpoint: {cfg_file} is missing (the run's resolved config)")
    return OmegaConf.load(cfg_file)


def load_model(
    path: Union[str, Path],
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype] = torch.float32,
) -> tuple[torch.nn.Module, DictConfig]:
    """(model in eval mode on ``device``/``dtype``, resolved training config)."""
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    kind, src = _resolve_source(path)
    cfg = load_config(path)
    if "model" not in cfg:
        raise ValueError(f"checkpoint: the config of {path} has no 'model' section")
    model = build_model(cfg.model, device="cpu", init=False)
    if kind == "consolidated":
        blob = torch.load(src, map_location="cpu", weights_only=False, mmap=True)
        state = blob["model"]
    else:
        import torch.distributed.checkpoint as dcp

        # Only the "model" entry is requested; DCP reads just those tensors, in this
        # single process (no process group needed).
        state = {k: v for k, v in model.state_dict().items()}
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({"model": state}, checkpoint_id=str(src))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("output.weight") or not model.args.weight_tying]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: {src} does not match the config's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model = model.to(device=device, dtype=dtype).eval()
    return model, cfg


def load_tokenizer(cfg: Any):
    """The run's tokenizer (``cfg.data.tokenizer``), through ``mta_repro.data``."""
    from mta_repro.data import build_tokenizer

    if "data" not in cfg or "tokenizer" not in cfg.data:
        raise ValueError("config: no data.tokenizer section to build the tokenizer from")
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
        raise ValueError(
            f"tokenizer has n_words={n_words} but the model's vocab_size is {vocab}: "
            "this tokenizer does not belong to this model (check data.tokenizer)"
        )


def load_for_eval(path, device="auto", dtype=torch.float32, tokenizer=None):
    """(model, tokenizer, cfg), with the tokenizer/vocab check done before any work."""
    model, cfg = load_model(path, device=device, dtype=dtype)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    check_vocab(tok, model)
    return model, tok, cfg
