"""``python -m mta_repro.eval <run_dir> [hydra overrides]``: run evaluations, write JSON.

Examples:
    python -m mta_repro.eval runs/debug eval/preset=debug
    python -m mta_repro.eval runs/880m_mta tasks=[ppl,benchmarks,lambada] dtype=bfloat16 device=cuda
    python -m mta_repro.eval runs/x tasks=[needle] needle.context_lens=[4096] needle.samples=100
    torchrun --nproc_per_node 8 -m mta_repro.eval runs/x eval/preset=paper   # work split over GPUs

Each task writes ``<out_dir>/<task>.json`` (out_dir defaults to ``<run_dir>/eval``;
written whole or not at all: a temporary file, fsync, rename):
{"task", "run_dir", "step", "variant", "trained_seq_len", "eval_lengths", "settings",
"provenance", "results": ...}; "provenance" says what the numbers came from: the weights
(path, step, sha256 of their tensors, tokens seen), the run's recorded inputs, the
tokenizer (sha256), the validation files' fingerprint, lm-eval's and this code's
versions (docs/provenance.md). Bad task names, a missing checkpoint, a tokenizer/vocab
mismatch, a tokenizer whose content differs from the one the weights recorded
(accept_changed_tokenizer=true evaluates anyway, recorded in the JSON), a length beyond
the context the run was trained at (its data.seq_len; extrapolate=true allows it) and
needle budgets are checked before any evaluation starts. A task whose JSON is newer than
the weights and has the same settings and inputs is skipped (--force reruns it). A run a
trainer is still writing is evaluated at its newest complete checkpoint (the step is
logged and recorded). The tasks: mta_repro/eval/tasks.py (EVAL_TASKS).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from mta_repro.errors import UserError
from mta_repro.eval.args import EvalConfig, register_eval_config
from mta_repro.files import replace_atomically, result_json
from mta_repro.model.args import attention_variant

log = logging.getLogger("mta_repro.eval")


def compose_eval(overrides: Sequence[str] = ()) -> EvalConfig:
    from mta_repro.train.config import compose

    register_eval_config()
    cfg = compose(list(overrides), config_name="eval")
    out = OmegaConf.to_object(cfg)
    assert isinstance(out, EvalConfig)  # configs/eval.yaml is built on the eval_schema node
    return out


def parse_argv(argv: Sequence[str]) -> EvalConfig:
    """First argument without '=' is the run directory; the rest are Hydra overrides."""
    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    from mta_repro.cli import check_split_lists

    check_split_lists(argv)  # before the split pieces are taken for run directories
    paths = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a] + (["force=true"] if force else [])
    if len(paths) > 1:
        raise UserError(f"eval: expected one run directory, got {paths}")
    if paths:
        overrides = [f"run_dir={paths[0]}"] + overrides
    from mta_repro.cli import check_group_options
    from mta_repro.train.config import CONFIG_DIR

    # an optional group: Hydra would silently skip an unknown preset
    check_group_options(overrides, ["eval/preset"], Path(CONFIG_DIR))
    return compose_eval(overrides)


def trained_context(run_cfg) -> int | None:
    """The context the run was trained at: ``data.seq_len`` of its saved config (for a
    finetuned run, the finetune's: the config of the last training stage). Not the
    model's ``max_seqlen``, which bounds what the code accepts, not what was learned."""
    from mta_repro.train.config import trained_seq_len

    return trained_seq_len(run_cfg)


def check_context(cfg: EvalConfig, lengths: dict, trained: int | None, max_seqlen: int | None = None) -> None:
    """Refuse a length beyond the trained context, or beyond the model's ``max_seqlen``,
    unless ``extrapolate=true``."""
    if cfg.extrapolate:
        return
    for (task, field_name), length in lengths.items():
        if max_seqlen is not None and length > max_seqlen and (trained is None or trained >= length):
            raise UserError(
                f"eval: {field_name}={length} for task {task!r} is longer than model.max_seqlen={max_seqlen} of "
                f"{cfg.run_dir}, the longest sequence the model is meant for; set extrapolate=true to evaluate "
                "beyond it on purpose"
            )
        if trained is not None and length > trained:
            raise UserError(
                f"eval: {field_name}={length} for task {task!r} is beyond the context {cfg.run_dir} was trained at "
                f"(data.seq_len={trained} in its config); set extrapolate=true to evaluate beyond it on purpose "
                "(length extrapolation)"
            )


def _up_to_date(path: Path, weights, record: dict) -> bool:
    """A task's JSON is newer than the weights it scored and has the same settings."""
    if not path.is_file() or not weights or not Path(weights).exists():
        return False
    if path.stat().st_mtime < Path(weights).stat().st_mtime:
        return False
    from mta_repro.files import read_json

    try:
        old = read_json(path, dict)
    except (OSError, UserError) as e:  # torn, or not a result of ours: evaluate again
        log.warning("eval: %s; re-evaluating it", e)
        return False
    if "results" not in old:
        return False
    keys = ("weights", "step", "dtype", "settings", "eval_lengths", "trained_seq_len")
    return all(old.get(k) == record.get(k) for k in keys) and _inputs(old) == _inputs(record)


def _inputs(rec: dict) -> tuple:
    """What a result depends on besides its settings: the weights' and the tokenizer's
    content, the validation files (a result without a record counts as stale)."""
    p = rec.get("provenance") or {}
    return (
        (p.get("checkpoint") or {}).get("weights_sha256"),
        (p.get("tokenizer") or {}).get("sha256"),
        (p.get("validation") or {}).get("sha256"),
    )


def provenance_of(cfg: EvalConfig, model, run_cfg) -> dict:
    """The eval JSON's "provenance": the weights evaluated (path, step, sha256, tokens seen),
    the inputs their run recorded, the tokenizer used, the validation files, versions.
    Refuses a tokenizer whose content differs from the recorded one unless
    ``accept_changed_tokenizer``."""
    from mta_repro.runs import provenance as pv

    src = getattr(model, "source", {}) or {}
    record = src.get("record") or {}
    tok = pv.tokenizer_identity(run_cfg.data.tokenizer) if "data" in run_cfg else None
    accepted = []
    change = pv.tokenizer_change((record.get("inputs") or {}).get("tokenizer"), tok) if tok else None
    if change:
        what = f"the weights {src.get('path')} (step {src.get('step')})"
        if not cfg.accept_changed_tokenizer:
            raise pv.ProvenanceError(
                f"{change}: {what} were trained with the recorded one, so these numbers would come from another "
                "tokenizer. Restore the tokenizer file, or evaluate anyway with accept_changed_tokenizer=true "
                "(recorded in the result's JSON)"
            )
        log.warning("eval: %s; accepted (accept_changed_tokenizer=true), recorded in the results", change)
        accepted.append(pv.accepted("tokenizer", change, "accept_changed_tokenizer=true", src.get("step")))
    return {
        "checkpoint": pv.loaded_weights(model),
        "run_id": record.get("run_id"),  # the run the weights belong to (pv.foreign_result)
        "run": record.get("inputs"),
        "run_accepted": record.get("accepted") or [],
        "tokenizer": tok,
        "validation": pv.validation_fingerprint(run_cfg.data) if "data" in run_cfg else None,
        "lm_eval": pv.package_version("lm_eval"),
        "code": pv.code_version(),
        "accepted": accepted,
    }


def run(cfg: EvalConfig) -> dict:
    """Evaluate ``cfg.tasks`` (``tasks.EVAL_TASKS``) and write one JSON per task.

    Everything that can fail on the config or the run fails before the first task runs
    (task names, lengths beyond the trained context, needle budgets, lm-eval names). A
    task whose JSON is newer than the weights and holds the same settings is skipped
    unless ``force=true`` (``--force``)."""
    from mta_repro.eval.args import validate
    from mta_repro.eval.tasks import EVAL_TASKS, EvalContext

    validate(cfg)
    unknown = [t for t in cfg.tasks if t not in EVAL_TASKS]
    if unknown:
        raise UserError(f"eval.tasks: unknown task(s) {unknown}; expected any of {list(EVAL_TASKS)}")
    tasks = [EVAL_TASKS[t] for t in cfg.tasks]
    for task in tasks:
        task.check(cfg)

    from mta_repro.eval import dist
    from mta_repro.eval.load import default_out_dir, load_for_eval
    from mta_repro.files import unwritable

    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg.run_dir)
    found = unwritable(out_dir)  # on every rank, before any work: rank 0 writes, the others wait for it
    if found:
        raise UserError(
            f"eval: {found[0]} is not writable ({found[1]}); the results go to {out_dir}: make it writable, "
            "or write them elsewhere with out_dir=<dir>"
        )

    # Under torchrun every process takes its share of each task; rank 0 writes.
    rank, world = dist.init(cfg.device)
    model, tok, run_cfg = load_for_eval(cfg.run_dir, device=cfg.device, dtype=cfg.dtype, identity=True)
    prov = provenance_of(cfg, model, run_cfg)
    from mta_repro.data import to_data_args

    ctx = EvalContext(
        model=model,
        tokenizer=tok,
        run_cfg=run_cfg,
        data_args=to_data_args(run_cfg.data),
        trained_seq_len=trained_context(run_cfg),
    )
    lengths = {t.name: t.lengths(cfg, ctx) for t in tasks}
    check_context(
        cfg,
        {(n, f): v for n, per in lengths.items() for f, v in per.items()},
        ctx.trained_seq_len,
        getattr(getattr(model, "args", None), "max_seqlen", None),
    )

    source = getattr(model, "source", {})
    log.info("eval: %s: step %s (%s)", cfg.run_dir, source.get("step"), source.get("path"))
    meta = {
        "run_dir": str(cfg.run_dir),
        "variant": attention_variant(run_cfg.model),
        "step": source.get("step"),
        "weights": source.get("path"),  # the export or DCP checkpoint evaluated
        "dtype": cfg.dtype,
        # the context the run was trained at (data.seq_len of its config) and the token
        # lengths this task evaluated at (the largest, per setting); beyond = extrapolation
        "trained_seq_len": ctx.trained_seq_len,
        "provenance": prov,
    }
    records = {t.name: {**meta, "eval_lengths": lengths[t.name], "settings": t.settings(cfg)} for t in tasks}
    todo = []
    for t in tasks:
        path = out_dir / f"{t.name}.json"
        if not cfg.force and _up_to_date(path, meta["weights"], records[t.name]):
            log.info(
                "eval: %s is up to date (newer than %s, same settings): skipped; --force re-evaluates",
                path,
                meta["weights"],
            )
            continue
        todo.append(t)
    for t in todo:  # budgets and names fail here, before any evaluation
        t.prepare(cfg, ctx)

    written = {t.name: str(out_dir / f"{t.name}.json") for t in tasks if t not in todo}
    for t in todo:
        t0 = time.time()
        log.info("eval: %s on %s", t.name, cfg.run_dir)
        res = t.run(cfg, ctx)
        if rank != 0:
            continue
        rec = records[t.name]
        res = {
            "task": t.name,
            **rec,
            "extrapolated": any(v > (ctx.trained_seq_len or v) for v in rec["eval_lengths"].values()),
            "world_size": world,
            "seconds": round(time.time() - t0, 1),
            "results": res,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{t.name}.json"
        # Whole or absent: a kill or a full disk mid-write leaves the previous file.
        replace_atomically(path, result_json(res))  # a non-finite number as null, flagged
        written[t.name] = str(path)
        log.info("eval: wrote %s", path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    from mta_repro.cli import run_cli

    # lm-eval's and datasets' progress, timed; the package's own lines are run_cli's (plain)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0

    def go() -> int:
        cfg = parse_argv(argv)
        for task, path in run(cfg).items():
            print(f"{task}: {path}")
        return 0

    return run_cli("eval", go)
