"""Whether a job of the plan is done: its output is there and reads whole.

A run is done when its export (with ``checkpoint.export=false``: its complete checkpoint)
holds the last step, an evaluation when every task's JSON is valid, of that step and
newer, the Appendix I check when its JSON says ok, an import when its ``.pt`` (written
atomically) was read from the configured folder, the report when its valid
``results.json`` is newer than every evaluation. ``torn(job)`` names an output there but
unreadable: the job is redone.
"""

from __future__ import annotations

from pathlib import Path

from mta_repro.errors import UserError
from mta_repro.files import read_json
from mta_repro.pipeline.job import Job
from mta_repro.runs.provenance import foreign_result


def _finished(run_dir: Path, steps: int) -> Path | None:
    """The file that shows the run reached ``steps``: its export, else (checkpoint.export=false)
    the complete checkpoint of that step; None while it has not (a damaged file does not
    count). Weights that would unpickle code raise ``UnsafeFileError`` (one line, exit 2)."""
    from mta_repro.weights import COMPLETE, NoWeightsError, find_weights

    if not run_dir.is_dir():
        return None
    try:
        found = find_weights(run_dir)
    except NoWeightsError:
        return None
    for c in found:  # newest first; the export wins a tie
        if c.problem is None and c.step is not None and c.step >= steps:
            return c.path / COMPLETE if c.kind == "dcp" else c.path
    return None


def imported_from(pt: Path) -> str | None:
    """The folder a ``python -m mta_repro.hf import`` .pt was read from, or None when the
    file is not there or not a complete import (truncated, or not an import). Read as data
    only (``mta_repro.weights.load_pt``) and memory-mapped: the weights are not read."""
    if not pt.is_file():
        return None
    from mta_repro.errors import CorruptFileError
    from mta_repro.weights import load_pt

    try:  # a file that would unpickle code raises UnsafeFileError (one line), as for the runs
        blob = load_pt(pt)
    except (CorruptFileError, OSError):  # truncated (not written by the atomic save), not a torch file
        return None
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict) or "config" not in blob:
        return None
    return str(blob.get("source")) if blob.get("source") is not None else None


def missing_sources(jobs: list[Job]) -> list:
    """One line per import job of ``jobs`` (a plan's) still to run whose folder is not a
    Hugging Face model folder."""
    return [
        f"pipeline.imports.{j.label}: {j.hf_dir}/config.json does not exist (expected your "
        "local download of the Hugging Face model folder, docs/llama3.md)"
        for j in jobs
        if j.kind == "import" and j.hf_dir is not None and not done(j) and not (j.hf_dir / "config.json").is_file()
    ]


def _json(path: Path, shape=object):
    """The JSON value in ``path``; None when it is missing, not whole (``torn``) or not of
    ``shape`` (``mta_repro.files``)."""
    try:
        return read_json(path, shape)
    except (OSError, UserError):
        return None


def outputs(job: Job) -> list:
    """The JSON files a job's done check reads."""
    if job.kind == "check":
        return [job.run_dir / "appendix_i_check.json"]
    if job.kind == "eval":
        assert job.eval_out is not None
        return [job.eval_out / f"{t}.json" for t in job.eval_tasks]
    if job.kind == "report":
        return [job.run_dir / "results.json"]
    return []


def torn(job: Job) -> list:
    """One line per output of ``job`` that is there but is not valid JSON (a write cut
    short by a kill or a full disk, or a file damaged since), or is an evaluation of
    another run's weights (``foreign_result``): the job is redone."""
    out = []
    for f in outputs(job):
        data = _json(f) if f.is_file() else None
        if f.is_file() and data is None:
            out.append(f"{f} is there but not valid JSON (a write cut short?)")
        elif job.kind == "eval" and isinstance(data, dict) and (why := foreign_result(data, job.run_dir)):
            out.append(f"{f} is not a result of {job.run_dir}: {why}")
    return out


def done(job: Job) -> bool:
    if job.kind == "import":
        assert job.out_file is not None
        src = imported_from(job.out_file)
        return src is not None and Path(src).expanduser().resolve() == job.hf_dir
    if job.kind == "train":
        return _finished(job.run_dir, job.steps or 0) is not None
    if job.kind == "check":
        f = job.run_dir / "appendix_i_check.json"
        data = _json(f, dict)  # damaged or not the check's record: run the check again
        return data is not None and bool(data.get("ok"))
    if job.kind == "eval":
        export = _finished(job.run_dir, job.steps or 0)
        if export is None:
            return False
        t0 = export.stat().st_mtime
        assert job.eval_out is not None
        for f in [job.eval_out / f"{t}.json" for t in job.eval_tasks]:
            data = _json(f)
            if not (isinstance(data, dict) and isinstance(data.get("results"), dict) and f.stat().st_mtime >= t0):
                return False
            if isinstance(data.get("step"), int) and data["step"] < (job.steps or 0):  # an earlier checkpoint's
                return False
            if foreign_result(data, job.run_dir):  # copied from another run: evaluate this one
                return False
        return True
    if job.kind == "report":
        res = job.run_dir / "results.json"
        data = _json(res)
        if not isinstance(data, dict):
            return False
        try:
            runs = [r["path"] for r in data["runs"]]
        except (KeyError, TypeError):
            return False
        if runs != [str(d) for d in job.runs]:
            return False
        t = res.stat().st_mtime
        newest = [f.stat().st_mtime for d in job.runs for f in (d / "eval").glob("*.json")] if job.runs else []
        newest += [(d / "metrics.jsonl").stat().st_mtime for d in job.runs if (d / "metrics.jsonl").is_file()]
        return all(t >= x for x in newest)
    raise UserError(f"unknown job kind {job.kind!r}")
