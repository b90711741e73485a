"""Reading one candidate (``read_weights``) and the newest readable one of a path
(``load_weights``). A checkpoint a running trainer prunes (``checkpoint.keep``) while it
is being read is not damaged: ``load_weights`` reads the newest complete one instead."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

from mta_repro.errors import CorruptFileError, UnsafeFileError
from mta_repro.weights.check import check_against, check_float, check_plain_config, check_state, expected_shapes
from mta_repro.weights.find import Candidate, find_weights
from mta_repro.weights.layout import CHECKPOINT_CONFIG, COMPLETE, PROVENANCE
from mta_repro.weights.lingua import release_state_dict_to_ours
from mta_repro.weights.safe import dcp_error_line, dcp_load, load_pt, read_dcp_metadata

log = logging.getLogger(__name__)


class FallbackWarning(UserWarning):
    """Newer weights were unreadable and older ones are used. ``load_weights`` prints it as
    one line on stderr; the warning is for callers that catch it (ignored by default)."""


warnings.filterwarnings("ignore", category=FallbackWarning)


@dataclasses.dataclass
class Weights:
    """A full model state dict in our key layout (float tensors as float32, on the CPU),
    the step it was saved at (None if unknown) and the run config saved with it (a plain
    dict; None for a Lingua/release checkpoint, whose config is a release config)."""

    state: dict
    step: int | None
    config: dict | None
    source: Candidate
    # What the weights came from (mta_repro/runs/provenance.py): a checkpoint's
    # provenance.json, an export's "provenance" entry; None when they carry none.
    record: dict | None = None


def read_dcp_model(path: str | Path) -> tuple[dict, int | None]:
    """The "model" tensors (and the "step", if saved) of a DCP step folder, ours or Lingua's
    (``{"model": ..., "optim": ...}``), read in this process without the optimizer: the
    tensors are allocated from the metadata, so no model config is needed."""
    import torch

    meta = read_dcp_metadata(path)
    sd = {}
    for key, m in meta.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(m, "size"):  # tensors under "model"
            sd[key[len("model.") :]] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not sd:
        raise CorruptFileError(f"{path}: a DCP checkpoint without 'model' tensors (not a training checkpoint?)")
    state: dict[str, Any] = {"model": sd}
    if "step" in meta.state_dict_metadata:
        state["step"] = -1
    dcp_load(state, path, no_dist=True)
    step = state.get("step")
    return state["model"], int(step) if isinstance(step, int) and step >= 0 else None


def read_weights(candidate: Candidate) -> Weights:
    """Read one candidate of ``find_weights``. ``CorruptFileError`` (naming the file) if it
    is damaged; ``UnsafeFileError`` if it would need unpickling code (never loaded)."""
    c = candidate
    if c.problem:
        if c.kind == "dcp" and not c.path.exists():
            raise PrunedError(f"checkpoint {c.path} was removed while it was read")
        raise CorruptFileError(c.problem)
    if c.kind == "consolidated":
        blob = load_pt(c.path)
        if not isinstance(blob, dict) or "model" not in blob or not isinstance(blob["model"], dict):
            raise CorruptFileError(f"{c.path}: expected a consolidated checkpoint (a dict with key 'model')")
        config = blob.get("config")
        if config is not None and not isinstance(config, dict):
            raise CorruptFileError(f"{c.path}: its 'config' is a {type(config).__name__}, expected a mapping")
        step = blob.get("step")
        state, step = blob["model"], int(step) if step is not None else c.step
        record = blob.get("provenance") if isinstance(blob.get("provenance"), dict) else None
    elif c.kind == "dcp":
        # The config and record first: a folder pruned once its tensors are read stays whole.
        config, record = _run_config(c.path), _record(c.path)
        try:
            state, step = read_dcp_model(c.path)
        except UnsafeFileError:
            if not c.path.exists():  # DCP's fallback to per-rank metadata once .metadata vanished
                raise PrunedError(f"checkpoint {c.path} was removed while it was read") from None
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if not c.path.exists():
                raise PrunedError(f"checkpoint {c.path} was removed while it was read") from None
            if isinstance(e, CorruptFileError):
                raise
            raise CorruptFileError(f"checkpoint {c.path} is unreadable ({dcp_error_line(e)})") from None
        step = step if step is not None else c.step
    else:
        raise TypeError(f"unknown weights kind {c.kind!r} (find_weights makes 'consolidated' or 'dcp')")
    check_plain_config(config, str(c.path))
    state = release_state_dict_to_ours(state)
    for k, v in state.items():
        if not hasattr(v, "dtype"):
            raise CorruptFileError(f"{c.path}: model entry {k!r} is a {type(v).__name__}, expected a tensor")
        check_float(str(c.path), k, v.dtype)
    args = _model_args_of(config)
    if args is not None:  # the file's tensors against its own config, before any caller uses them
        check_state(state, expected_shapes(args), str(c.path), bool(args.weight_tying))
    state = {k: v.float() for k, v in state.items()}
    return Weights(state, step, config, c, record)


class PrunedError(CorruptFileError):
    """A checkpoint folder removed while it was read (a running trainer keeps only its
    newest ``checkpoint.keep``): not damage; the newest complete one is read instead."""


def _record(ckpt: Path) -> dict | None:
    import json

    try:
        data = json.loads((ckpt / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _model_args_of(config: dict | None):
    """The ModelArgs a saved run config describes, or None (no config, no model section, or
    one this version cannot build: the caller's own build then says why)."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return None
    from mta_repro.errors import UserError
    from mta_repro.model import to_model_args

    try:
        return to_model_args(config["model"])
    except (UserError, TypeError):
        return None


def _run_config(ckpt: Path) -> dict | None:
    """The resolved config a checkpoint of ours was trained with: its own config.yaml, or
    (a checkpoint saved before they carried one) its run's."""
    cfg_file = ckpt / CHECKPOINT_CONFIG
    if not cfg_file.is_file():
        cfg_file = ckpt.parent.parent / "config.yaml"
    if not (ckpt / COMPLETE).exists() or not cfg_file.is_file():
        return None
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False)
    if not isinstance(config, dict):
        return None
    check_plain_config(config, str(cfg_file))
    return config


def read_config(candidate: Candidate) -> dict | None:
    """The run config saved with a candidate, without reading its tensors."""
    if candidate.kind == "consolidated":
        if candidate.problem:
            raise CorruptFileError(candidate.problem)
        blob = load_pt(candidate.path)
        config = blob.get("config") if isinstance(blob, dict) else None
        config = config if isinstance(config, dict) else None
        check_plain_config(config, str(candidate.path))
        return config
    return _run_config(candidate.path)


def notice(msg: str, who: str = "mta_repro") -> None:
    """One line on stderr through the package's logger (and a ``FallbackWarning`` for callers
    that catch it)."""
    log.warning("[%s] WARNING: %s", who, " ".join(msg.split()))
    warnings.warn(msg, FallbackWarning, stacklevel=3)


# How often a read restarts on the newest checkpoint after the one it read was pruned.
PRUNED_RETRIES = 20


def load_weights(path: str | Path, who: str = "mta_repro", expect=None) -> Weights:
    """The newest readable weights of ``path`` (``find_weights``' order). A damaged newer
    candidate is named in one line and the next one is used; if none can be read, the
    error names each. An unsafe file is refused, never skipped. A checkpoint removed while
    it was read (a live trainer pruning it) is no error: the newest complete one is read.
    ``expect``: the ModelArgs of the model the weights go into; weights of another shape are
    refused in one line naming the tensor (``ModelMismatchError``), before the caller copies
    anything."""
    for _ in range(PRUNED_RETRIES):
        try:
            return _load_newest(path, who, expect)
        except PrunedError as e:
            notice(
                f"{e} (pruned by the run's trainer, checkpoint.keep); reading its newest complete checkpoint instead",
                who,
            )
    raise CorruptFileError(
        f"{path}: its checkpoints were pruned {PRUNED_RETRIES} times while they were read (a "
        "trainer saving every few steps with a small checkpoint.keep): evaluate it with a larger "
        "checkpoint.keep, or its export once it finished"
    )


def _load_newest(path: str | Path, who: str, expect=None) -> Weights:
    candidates = find_weights(path)
    errors = []
    for i, c in enumerate(candidates):
        try:
            w = read_weights(c)
        except PrunedError:
            raise
        except CorruptFileError as e:
            errors.append(str(e))
            if i + 1 < len(candidates):
                nxt = candidates[i + 1]
                step = f" (step {nxt.step})" if nxt.step is not None else ""
                notice(f"{e}; falling back to {nxt.path}{step}", who)
            continue
        stale = [x for x in candidates[i + 1 :] if x.kind == "consolidated" and x.step is not None]
        if c.kind == "dcp" and stale and w.step is not None:
            notice(
                f"checkpoint {c.path} (step {w.step}) is newer than {stale[0].path} (step {stale[0].step}); "
                "using the newer checkpoint (re-export with python -m mta_repro.train.export)",
                who,
            )
        if expect is not None:
            check_against(w.state, expect, str(c.path))
        return w
    raise CorruptFileError(errors[0] if len(errors) == 1 else "; ".join(errors))
