"""Load a run directory for the report: its config, eval results and metrics, and the
stage of the paper's protocol it belongs to.

``load_run`` reads ``config.yaml``, every ``eval/<task>.json`` (checked against the shape
the tables read, ``eval_shape``, and refused when copied from another run) and
``metrics.jsonl`` (damaged lines skipped with a warning), and places the run: its stage
and variant as it recorded them (``run.stage``, ``run.variant`` in its config, set by the
pipeline for every run it plans; the trainer records the stage of a run started by hand),
else, for a run that recorded none (made before the fields existed, or a variant not
given by hand), inferred: the variant from its results or model config, the stage from its
config and its source's (``run_stage``: a source and a longer context or another RoPE
theta is the 4K finetune). The report marks an inferred stage in its provenance block
and says why once, under its list of runs. The table builders (``mta_repro.report.tables``) and the plots read
``RunData`` only.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mta_repro.errors import UserError
from mta_repro.files import fault, read_json


@dataclass
class RunData:
    path: Path
    label: str
    variant: str | None = None
    config: dict | None = None
    evals: dict = field(default_factory=dict)  # task -> parsed eval JSON
    metrics: list = field(default_factory=list)  # metrics.jsonl records
    stage: str = "pretrain"  # pretrain | long_context | insertion | continued
    final_step: int | None = None  # the step of the run's newest checkpoint or export
    # Whether the stage and the variant are the run's record (its config's run.stage,
    # run.variant) or inferred from its config and results (a run that recorded none).
    stage_recorded: bool = False
    variant_recorded: bool = False

    @property
    def shape(self) -> tuple | None:
        m = (self.config or {}).get("model") or {}
        try:
            return int(m["dim"]), int(m["n_layers"]), int(m["n_heads"])
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def step(self) -> int | None:
        for e in self.evals.values():
            if isinstance(e.get("step"), int) and e["step"] >= 0:
                return e["step"]
        steps = [m["step"] for m in self.metrics if isinstance(m.get("step"), int)]
        return max(steps) if steps else None


def cfg_get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def recorded(cfg: dict | None, path: Path) -> tuple:
    """(stage, variant) a run recorded in its config (``run.stage``, ``run.variant``:
    mta_repro/train/args.py); None for each one it did not record (a run started by hand
    without them, or before they existed)."""
    from mta_repro.train.args import RUN_STAGES, VARIANTS

    out = []
    for key, choices in (("stage", RUN_STAGES), ("variant", VARIANTS)):
        v = cfg_get(cfg, f"run.{key}")
        if v is not None and v not in choices:
            raise UserError(
                f"report: {path / 'config.yaml'}: run.{key} is {v!r}; expected one of {choices} or null "
                "(unrecorded); correct it or set it to null to have the report infer it"
            )
        out.append(v)
    return tuple(out)


def run_stage(cfg: dict | None) -> str:
    """The stage of a run that did not record one (``run.stage``; runs made before the
    trainer recorded it): what its start would have recorded (``start_stage``: from its
    config and its source's), else, when the source is not readable here (e.g. a report
    made on another machine), a guess from the run's own config: a model with Llama 3's
    RoPE scaling is a Llama 3 trained on (theta 500,000 is its own, not a long-context
    change), otherwise theta 500,000 marks the paper's 4K finetune."""
    from mta_repro.train.stage_weights import start_stage

    known = start_stage(cfg)
    if known is not None:
        return known
    if cfg_get(cfg, "model.rope_scaling.rope_type") == "llama3":
        return "continued"
    theta = cfg_get(cfg, "model.rope_theta")
    return "long_context" if theta is not None and float(theta) >= 500_000 else "continued"


# What the tables and plots read from each task's eval JSON (shapes: mta_repro.files).
_NUM = (float, type(None))
_RESULTS = {
    "ppl": {"domains": {"*": {"ppl?": _NUM, "loss?": _NUM}}, "average": _NUM, "seq_len?": _NUM},
    "needle": {"accuracy": {"*": {"*": {"mean": float}}}},
    "babilong": {"accuracy": {"*": {"*": float}}, "mean": {"*": float}},
    "benchmarks": {"summary": dict, "metrics?": (dict, type(None))},
    "lambada": {"summary": {"average?": _NUM, "*": (dict, type(None))}},
}


def eval_shape(task: str) -> dict:
    """The shape of ``eval/<task>.json`` that the report reads."""
    return {
        "task?": str,
        "step?": (int, type(None)),
        "variant?": (str, type(None)),
        "results?": (_RESULTS.get(task, dict), type(None)),
    }


def load_run(path, label: str | None = None) -> RunData:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"report: run directory {path} does not exist")
    run = RunData(path=path, label=label or path.name)
    cfg_file = path / "config.yaml"
    if cfg_file.is_file():
        from omegaconf import OmegaConf

        raw = OmegaConf.load(cfg_file)
        try:  # the trainer saves resolved configs; others may hold interpolations
            config = OmegaConf.to_container(raw, resolve=True)
        except Exception:  # noqa: BLE001 - e.g. an unset environment variable: keep it as written
            config = OmegaConf.to_container(raw, resolve=False)
        run.config = config if isinstance(config, dict) else None
    for f in sorted((path / "eval").glob("*.json")) if (path / "eval").is_dir() else []:
        what = "an eval result of python -m mta_repro.eval"
        try:
            data = read_json(f, eval_shape(""), what)
        except UserError as e:
            raise UserError(
                f"report: {e}; rerun the evaluation that wrote it ({eval_command(path)}; it redoes "
                "that task), or delete the file"
            ) from None
        task = data.get("task", f.stem)
        why = fault(data, eval_shape(task))
        if why:
            raise UserError(f"report: {f}: not {what} ({task}): {why}")
        from mta_repro.runs.provenance import foreign_result

        foreign = foreign_result(data, path)
        if foreign:  # copied from another run: its numbers would stand in this run's row
            raise UserError(
                f"report: {f}: not a result of {path}: {foreign}; delete it and evaluate this run: {eval_command(path)}"
            )
        run.evals[task] = data
        run.variant = run.variant or data.get("variant")
    stage, variant = recorded(run.config, path)
    if variant is not None:  # the run's own record wins over what its results or model say
        run.variant, run.variant_recorded = variant, True
    if run.variant is None and run.config and "model" in run.config:
        from mta_repro.model.args import attention_variant

        run.variant = attention_variant(run.config["model"])
    run.stage, run.stage_recorded = (stage, True) if stage is not None else (run_stage(run.config), False)
    run.final_step = final_step(path)
    m = path / "metrics.jsonl"
    if m.is_file():
        lines, skipped = m.read_bytes().split(b"\n"), []
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line.decode("utf-8"))
                except (ValueError, RecursionError):  # not UTF-8 / not JSON
                    record = None
                if isinstance(record, dict):
                    run.metrics.append(record)
                elif n < len(lines):  # (the last line, without its newline, may be a write in progress)
                    skipped.append(n)
        if skipped:  # damaged lines the trainer kept as they are on resume
            import sys

            print(
                f"report: {m}: skipped {len(skipped)} damaged line{'s' if len(skipped) > 1 else ''} "
                f"(not a JSON object): {', '.join(map(str, skipped[:10]))}{', ...' if len(skipped) > 10 else ''}",
                file=sys.stderr,
            )
    if not run.evals and not run.metrics:
        raise UserError(
            f"report: {path} has no eval/*.json results and no metrics.jsonl; "
            f"train it, then evaluate it: {eval_command(path)}"
        )
    return run


def final_step(path: Path) -> int | None:
    """The step of a run directory's newest complete checkpoint or export (None: neither)."""
    from mta_repro.weights import EXPORT, complete_checkpoints, export_step

    steps = [int(c.name) for c in complete_checkpoints(Path(path) / "checkpoints")]
    if (Path(path) / EXPORT).is_file():
        with contextlib.suppress(UserError, OSError):
            steps.append(export_step(Path(path) / EXPORT))
    return max(steps) if steps else None


def eval_command(path) -> str:
    return f"python -m mta_repro.eval {path} eval/preset=paper   (or eval/preset=debug for a quick CPU look)"


def results_or_none(run: RunData, task: str) -> dict | None:
    return (run.evals.get(task) or {}).get("results")


def results_of(run: RunData, task: str) -> dict:
    """``results_or_none`` of a run known to have results for ``task`` (a table's rows)."""
    res = results_or_none(run, task)
    assert res is not None
    return res
