"""The attention self-check at a start (``model.attn_selfcheck``): the model's attention
implementation checked on this device in the run's dtype before the model is built
(mta_repro/model/selfcheck.py), replaced by the first fallback that passes on every rank,
each start's decision appended to ``<run_dir>/attn_selfcheck.json``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mta_repro.train.distributed import DistInfo


def attn_selfcheck(model_args, info: DistInfo, param_dtype: str, run_dir: Path) -> tuple[Any, str | None]:
    """``model.attn_selfcheck`` before the model is built: the model's attention
    implementation checked on this device in the run's dtype (mta_repro/model/selfcheck.py),
    replaced by the first of its fallbacks that passes on every rank. Returns the model
    args to build with and the name that runs (None when no check ran); rank 0 appends the
    decision to ``<run_dir>/attn_selfcheck.json``."""
    mode = model_args.attn_selfcheck
    if mode == "off" or (info.device.type == "cpu" and not model_args.attn_selfcheck_cpu):
        return model_args, None
    from mta_repro.model import selfcheck
    from mta_repro.train.distributed import DTYPES

    if not selfcheck.explicit_layer_kinds(model_args):
        return model_args, None  # sdpa/diff layers only: nothing to check
    dtype = DTYPES[param_dtype] if info.device.type == "cuda" else torch.float32
    err: BaseException | None = None
    try:
        decision = selfcheck.decide(
            model_args,
            info.device,
            dtype,
            strict=mode == "strict",
            log=lambda line: print(
                f"[mta_repro.train] rank {info.rank}: {line}" if info.world_size > 1 else f"[mta_repro.train] {line}",
                file=sys.stderr,
                flush=True,
            ),
        )
        chain = [model_args.attn_impl]
        while chain[-1] != decision.used:
            chain.append(selfcheck.next_impl(chain[-1]))
        pos = len(chain) - 1
    except selfcheck.SelfCheckError as e:
        err, pos = e, -1
    if info.world_size > 1:  # every rank runs the furthest fallback any rank needed; a refusal stops all
        t = torch.tensor([pos if err is None else 2**31, 1 if err is not None else 0], device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if err is None and int(t[1]):
            err = selfcheck.SelfCheckError("attention self-check: another rank refused (its line says why)")
        pos = int(t[0])
    if err is not None:
        raise err
    used = model_args.attn_impl
    for _ in range(pos):
        nxt = selfcheck.next_impl(used)
        assert nxt is not None  # pos steps along the chain to an implementation some rank used
        used = nxt
    if info.is_main:
        _record_selfcheck(run_dir, {**decision.as_dict(), "used": used, "world_size": info.world_size})
    # the implementation that passed, for this model only
    return selfcheck.applied(model_args, used), used


def _record_selfcheck(run_dir: Path, entry: dict) -> None:
    """Append one start's decision to ``<run_dir>/attn_selfcheck.json`` (a list, atomically)."""
    from mta_repro.files import replace_atomically

    path = Path(run_dir) / "attn_selfcheck.json"
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, ValueError):
        history = []
    if not isinstance(history, list):
        history = []
    history.append({"time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()) + " UTC", **entry})
    replace_atomically(path, json.dumps(history, indent=1).encode())
