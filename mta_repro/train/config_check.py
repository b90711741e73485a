"""The config check of a start in a run dir that holds a checkpoint: what may differ from
the config the run was saved with.

The new config is compared with the saved ``config.yaml`` (or, if that is gone, with the
config the newest checkpoint carries). Each field's class is declared with it
(``metadata={"run_dir": ...}``, a section's ``RUN_DIR``): ``FREE`` fields are never
compared, ``SAFE`` ones may change with ``checkpoint.allow_config_change=true``, every
other one (model, data, optimiser, seed) defines the run; ``trainer.grad_accum`` is
compared as the global batch, so a run may continue on another world size
(``global_batch_error``). A refused difference raises ``RunDirError`` naming the keys and
the ways out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mta_repro.runs.runlock import RunDirError, RunLock


def _classified() -> tuple[tuple, tuple, tuple]:
    """(FREE, SAFE, PATHS) keys from the schema itself: a field's ``metadata={"run_dir":
    "free" | "safe"}`` (``"path": True`` for a path compared resolved), a section's
    ``RUN_DIR`` class attribute (every key under it, ``"logging."``). The classes are
    declared beside the fields they describe (mta_repro/train/args.py, data/args.py,
    model/args.py, train/config.py)."""
    import dataclasses

    from mta_repro.train.config import TrainConfig

    free, safe, paths = [], [], []
    out = {"free": free, "safe": safe}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if f.metadata.get("run_dir") in out:
                out[f.metadata["run_dir"]].append(key)
            if f.metadata.get("path"):
                paths.append(key)
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if sub is not None and dataclasses.is_dataclass(sub):
                run_dir = getattr(sub, "RUN_DIR", None)
                if run_dir in out:
                    out[run_dir].append(key + ".")
                walk(sub, key + ".")

    walk(TrainConfig, "")
    return tuple(free), tuple(safe), tuple(paths)


# FREE: never compared (where the run dir is, SLURM resources, the progress bar, prefetching,
# timeouts, the CPU allocator's policy, the memory pre-flight's switch, model.kernels, this
# check's own switches; trainer.grad_accum is compared as the global batch). SAFE: may change
# with checkpoint.allow_config_change.
# PATHS: compared as resolved paths (relative vs absolute is no change).
FREE, SAFE, PATHS = _classified()


def key_matches(key: str, prefixes) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def _norm(key: str, value: Any) -> Any:
    if key_matches(key, PATHS) and isinstance(value, str):
        from mta_repro.data.args import resolve_path

        return str(resolve_path(value).resolve())
    return value


@dataclass
class ConfigDiff:
    unsafe: dict[str, tuple]  # key -> (saved, new)
    safe: dict[str, tuple]


def diff_configs(saved: dict, new: dict) -> ConfigDiff:
    """Differences between two resolved configs, classified. A key missing from the saved
    config (a field added to the schema since) counts as its schema default (a SAFE one
    is not compared)."""
    from mta_repro.train.config import TrainConfig

    default = flatten(OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False))
    old, cur = flatten(saved), flatten(new)
    unsafe, safe = {}, {}
    for key in sorted(set(old) | set(cur)):
        if key_matches(key, FREE):
            continue
        if key not in cur:  # a field removed from the schema: nothing to compare with
            continue
        if key not in old and key_matches(key, SAFE):
            continue  # a setting added to the schema since the run started: nothing to protect
        a = old.get(key, default.get(key))
        b = cur[key]
        if _norm(key, a) == _norm(key, b):
            continue
        (safe if key_matches(key, SAFE) else unsafe)[key] = (a, b)
    return ConfigDiff(unsafe, safe)


# What an ``attention=`` option (configs/attention/) sets: a changed option is reported as one
# "attention: mta -> baseline", not as the dozen model.mta.* fields it moves.
ATTENTION_KEYS = ("model.mta.", "model.diff_transformer")


def _fmt(diff: dict[str, tuple], limit: int = 6, saved: dict | None = None, new: dict | None = None) -> str:
    """Every differing key; the saved -> new values of the first ``limit``. With the two
    configs, a change of attention variant is one item."""
    items = []
    if saved is not None and new is not None:
        from mta_repro.model.args import attention_variant

        a, b = attention_variant(saved.get("model") or {}), attention_variant(new.get("model") or {})
        if a != b:
            items.append(f"attention: {a} -> {b}")
            diff = {k: v for k, v in diff.items() if not key_matches(k, ATTENTION_KEYS)}
            limit = max(limit - 1, 0)
    items += [f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:limit]]
    rest = list(diff)[limit:]
    return "; ".join(items) + (f"; also {', '.join(rest)}" if rest else "")


def check_config(
    saved: dict,
    new: dict,
    allow_change: bool,
    run_dir: Path,
    at_step: int | None,
    source: str = "the run's config.yaml",
) -> ConfigDiff:
    """Raise RunDirError if ``new`` may not continue the run saved as ``saved`` (read from
    ``source``, named in the error)."""
    d = diff_configs(saved, new)
    where = f"{run_dir} (at step {at_step})" if at_step is not None else str(run_dir)
    if d.unsafe:
        raise RunDirError(
            f"run_dir={run_dir}: this config differs from {source} in fields that define "
            f"the model, data or optimiser state: {_fmt(d.unsafe, saved=saved, new=new)}. "
            f"The run in {where} is left untouched. "
            "Use another run_dir=..., or start a new stage from its weights with "
            f"run_dir=<new> checkpoint.init_from={run_dir}"
        )
    if d.safe and not allow_change:
        raise RunDirError(
            f"run_dir={run_dir}: this config changes {_fmt(d.safe)} of the run in {where}. "
            "Add checkpoint.allow_config_change=true to continue this run with the change, "
            "or use another run_dir=..."
        )
    return d


def global_batch_error(saved_cfg: dict, new_cfg: Any, saved_world: int, world: int) -> str | None:
    """An error text if the global batch would change, naming the grad_accum that keeps it."""
    try:
        b0, a0 = int(saved_cfg["data"]["batch_size"]), int(saved_cfg["trainer"].get("grad_accum", 1))
    except (KeyError, TypeError):
        return None
    b1, a1 = int(new_cfg.data.batch_size), int(new_cfg.trainer.grad_accum)
    g0, g1 = b0 * saved_world * a0, b1 * world * a1
    if g0 == g1:
        return None
    fix = (
        f"set trainer.grad_accum={g0 // (b1 * world)}"
        if g0 % (b1 * world) == 0
        else f"no grad_accum keeps it with data.batch_size={b1} on {world} ranks"
    )
    return (
        f"the run's global batch was {g0} sequences (data.batch_size={b0} x {saved_world} ranks x "
        f"trainer.grad_accum={a0}); this start would use {g1} ({b1} x {world} x {a1}): {fix}"
    )


def load_saved_config(run_dir: Path, name: str = "config.yaml") -> dict | None:
    """The config saved as ``<run_dir>/<name>`` (a run dir's, or a checkpoint folder's own), or None."""
    path = Path(run_dir) / name
    if not path.is_file():
        return None
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # noqa: BLE001 - a damaged file is a user-facing error
        raise RunDirError(f"{path}: cannot be read ({e}); use another run_dir=... or repair/delete it") from e
    if not isinstance(config, dict):
        raise RunDirError(
            f"{path}: cannot be read (a YAML {type(config).__name__}, not a mapping of config "
            "sections); use another run_dir=... or repair/delete it"
        )
    return config


def _saved_config(run_dir: Path, found: list, allow_change: bool) -> tuple[dict | None, str]:
    """(the config the run was saved with, where it was read) for the config check."""
    from mta_repro.weights.layout import CHECKPOINT_CONFIG

    saved, source = load_saved_config(run_dir), "the run's config.yaml"
    if found and saved is None:
        # config.yaml is gone (deleted, or lost with a copied run dir): the checkpoint
        # carries the config it was trained with.
        saved, source = load_saved_config(found[-1], CHECKPOINT_CONFIG), f"the config stored in {found[-1]}"
        if saved is None and not allow_change:
            raise RunDirError(
                f"run_dir={run_dir} has checkpoints but no config.yaml, and {found[-1]} carries no config "
                "(saved by an older version), so this command cannot be checked against the run: restore "
                "config.yaml, or add checkpoint.allow_config_change=true to take this command's config as the run's"
            )
    return saved, source


def prepare_run_dir(args, info, lock: RunLock) -> tuple[int | None, list[str]]:
    """Rank 0, before anything is written (``args``: the TrainConfig): the lock, the config
    check against the run's config.yaml. Returns the step of the newest complete checkpoint
    (None if none) and the config changes it accepts (``key: old -> new``), which the start
    records with config.yaml once all its checks passed (``commit_start``)."""
    from mta_repro.weights.layout import complete_checkpoints, saved_world_size, verify_checkpoint

    tr, ck = args.trainer, args.checkpoint
    run_dir = Path(args.run_dir)
    # The lock first: nothing below is decided on files another live job is writing.
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run_dir={run_dir}: cannot create it ({e.strerror})") from e
    lock.acquire()
    found = complete_checkpoints(run_dir / "checkpoints") if ck.resume else []
    at_step = int(found[-1].name) if found else None
    if at_step == tr.steps and verify_checkpoint(found[-1]) is not None:
        at_step = None  # "finished", but its last checkpoint is damaged: resume decides
    saved, source = _saved_config(run_dir, found, ck.allow_config_change)
    new = OmegaConf.to_container(OmegaConf.structured(args), resolve=True)
    assert isinstance(new, dict)
    if found and saved is not None:
        # A different model or data first: that is never a matter of trainer.steps or of
        # allow_config_change, which the checks below would suggest.
        check_config(saved, new, True, run_dir, at_step, source)
    if at_step is not None and at_step > tr.steps:
        raise RunDirError(
            f"run_dir={run_dir} is already at step {at_step} ({found[-1]}), beyond trainer.steps={tr.steps}: "
            "nothing to train. Raise trainer.steps (with checkpoint.allow_config_change=true) or use another run_dir"
        )
    changes = ["no config.yaml to compare with; this command's config taken as the run's"] if found else []
    if found and saved is not None:
        diff = check_config(saved, new, ck.allow_config_change, run_dir, at_step, source)
        changes = [f"{key}: {a!r} -> {b!r}" for key, (a, b) in diff.safe.items()]
        saved_world = saved_world_size(found[-1])
        if saved_world is not None:
            err = global_batch_error(saved, args, saved_world, info.world_size)
            if err:
                raise RunDirError(f"run_dir={run_dir}: {err}")
    if not ck.resume and (run_dir / "checkpoints").is_dir() and complete_checkpoints(run_dir / "checkpoints"):
        raise RunDirError(
            f"run_dir={run_dir} holds checkpoints and checkpoint.resume=false would train over them from "
            "step 0: use another run_dir=..., or checkpoint.resume=true"
        )
    return at_step, changes
