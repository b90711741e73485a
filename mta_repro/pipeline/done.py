"""Whether a job of the plan is done: its output is there, reads whole and is of the run
the plan asks for now.

A run is done when it is the plan's run (``run_differs``: its recorded config, seed and
inputs are what the plan asks now, and its weights carry its own run id) and its export
(with ``checkpoint.export=false``: its complete checkpoint) holds the last step; an
evaluation when every task's JSON is valid, has a result (no missing or null average), is
of that step and newer, and carries the run's id; the Appendix I check when its JSON says
ok; an import when its ``.pt`` (written atomically) was read from the configured folder;
the report when its valid ``results.json`` is newer than every evaluation. ``torn(job)``
names an output there but unreadable: the job is redone. A run dir that holds another run
than the plan's is never trained over: ``conflicts(plan_jobs)`` says so, and the runner
refuses before any job (docs/pipeline.md, "What done means").
"""

from __future__ import annotations

from pathlib import Path

from mta_repro.errors import UserError
from mta_repro.files import read_json
from mta_repro.pipeline.job import Job
from mta_repro.runs.provenance import foreign_result, read_record, short

# What the done check of a run does not compare, beside the fields a resume never compares
# (``mta_repro.train.config_check.FREE``: run_dir, the run.* labels, slurm.*, the progress
# bar, timeouts, ...): logging.* says how a run reports, not what it computes. A field
# missing from the recorded config counts as its schema default (``diff_configs``): a
# field added to the code since, at its default, is no difference.
NOT_COMPARED = ("logging.",)


def finished_checkpoint(run_dir: Path, steps: int) -> Path | None:
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


# ------------------------------------------------------------------ the same run
def _rebase(value, old_root: str, new_root: str):
    """``value`` (a config section) with paths under ``old_root`` moved under ``new_root``: a
    copied pipeline root's hand-offs (checkpoint.init_from=<root>/pretrain/...) are the
    same hand-offs."""
    if isinstance(value, dict):
        return {k: _rebase(v, old_root, new_root) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase(v, old_root, new_root) for v in value]
    if isinstance(value, str) and (value == old_root or value.startswith(old_root + "/")):
        return new_root + value[len(old_root) :]
    return value


def _root_of(run_dir: str, label: str) -> str | None:
    """The pipeline root a run dir ``<root>/<label>`` is under, or None."""
    parts, tail = Path(run_dir).parts, Path(label).parts
    if len(parts) > len(tail) and parts[-len(tail) :] == tail:
        return str(Path(*parts[: -len(tail)]))
    return None


def _config_difference(job: Job, saved: dict) -> tuple[str, object, object] | None:
    """(field, recorded, planned) of the first field (in key order) where the recorded
    config ``saved`` differs from the plan's, ignoring ``NOT_COMPARED``."""
    from mta_repro.train.config_check import diff_configs, key_matches

    assert job.config is not None
    old_root = _root_of(str(saved.get("run_dir") or ""), job.label)
    new_root = _root_of(str(job.run_dir), job.label)
    if old_root and new_root and old_root != new_root:
        saved = {k: _rebase(v, old_root, new_root) for k, v in saved.items()}
    d = diff_configs(saved, job.config)
    diffs = {k: v for k, v in {**d.unsafe, **d.safe}.items() if not key_matches(k, NOT_COMPARED)}
    if not diffs:
        return None
    keys = sorted(diffs, key=lambda k: (k.count("."), k))  # seed before model.seed, data.seed
    also = f" (also {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})" if len(keys) > 1 else ""
    return keys[0] + also, diffs[keys[0]][0], diffs[keys[0]][1]


_tokenizers: dict = {}
_listings: dict = {}


def _tokenizer_now(tok: dict) -> dict:
    from mta_repro.runs.provenance import tokenizer_identity

    key = (tok.get("name"), tok.get("path"))
    if key not in _tokenizers:
        _tokenizers[key] = tokenizer_identity(tok)
    return _tokenizers[key]


def _listing_now(data: dict) -> str | None:
    """The sha256 of the names and sizes of the training files the data config ``data``
    reads (what a run records as ``inputs.data.train.sha256_names_sizes``); None when they
    cannot be listed here."""
    import json

    # the seeds of a seeds axis do not change the listing: one listing for them all
    key = json.dumps({k: v for k, v in data.items() if k != "seed"}, sort_keys=True, default=str)
    if key not in _listings:
        from mta_repro.data import to_data_args
        from mta_repro.data.args import active_sources
        from mta_repro.data.listing import fingerprint, list_entries

        try:
            args = to_data_args(data)
            listed = {n: (sz, mt) for d in active_sources(args) for n, sz, mt in list_entries(args, d, "train")}
            _listings[key] = fingerprint([(n, sz, mt) for n, (sz, mt) in listed.items()], with_mtime=False)["sha256"]
        except (UserError, OSError, TypeError, ValueError):
            _listings[key] = None
    return _listings[key]


def _weights_run_ids(run_dir: Path) -> list:
    """[(what, run id)] the export and the newest complete checkpoint of ``run_dir`` carry."""
    from mta_repro.runs.provenance import weights_record
    from mta_repro.weights import NoWeightsError, find_weights

    try:
        found = find_weights(run_dir)
    except (NoWeightsError, UserError, OSError):
        return []
    out, kinds = [], set()
    for c in found:  # newest first
        if c.problem is not None or c.kind in kinds:
            continue
        kinds.add(c.kind)
        rec = weights_record(c.path, c.kind) or {}
        if rec.get("run_id"):
            out.append((c.path, rec["run_id"]))
    return out


def run_differs(job: Job) -> str | None:
    """Why the run in a train (or eval) job's run dir is not the run the plan asks for now (one line
    naming the run dir, what differs and both values), or None: it is (or nothing was
    trained there yet). Compared: the recorded config.yaml with the plan's resolved config
    (``NOT_COMPARED`` aside; the seed is ``seed``), the tokenizer's sha256 and the training
    files' listing (names, sizes) recorded at the run's last start with today's, and the run
    id its export and newest checkpoint carry with its provenance.json's."""
    if job.kind not in ("train", "eval"):  # an eval job: of the run it evaluates
        return None
    from mta_repro.runs.runlock import RunDirError
    from mta_repro.train.config_check import load_saved_config

    d = job.run_dir
    where = f"{d} holds a run that is not the one the plan asks for"
    try:
        saved = load_saved_config(d)
    except RunDirError as e:
        return str(e)
    if saved is not None and job.config is not None:
        diff = _config_difference(job, saved)
        if diff is not None:
            key, a, b = diff
            first, _, also = key.partition(" ")
            return f"{where}: {first} is {a!r} in its config.yaml, the plan asks {b!r}{' ' + also if also else ''}"
    prov = read_record(d / "provenance.json") or {}
    ours = prov.get("run_id")
    for path, theirs in _weights_run_ids(d):
        if ours and theirs != ours:
            return (
                f"{where}: {path} carries run id {theirs}, but the run's provenance.json says {ours} "
                "(weights copied from another run?)"
            )
    starts = prov.get("starts") or []
    inputs = (starts[-1].get("inputs") if isinstance(starts[-1], dict) else None) if starts else None
    if isinstance(inputs, dict) and job.config is not None:
        from mta_repro.runs.provenance import tokenizer_change

        data = job.config.get("data") or {}
        change = tokenizer_change(inputs.get("tokenizer"), _tokenizer_now(data.get("tokenizer") or {}))
        if change:
            return f"{where}: {change}"
        recorded = ((inputs.get("data") or {}).get("train") or {}).get("sha256_names_sizes")
        now = _listing_now(data) if recorded else None
        if recorded and now and recorded != now:
            return (
                f"{where}: the training files' listing (names, sizes) has sha256 {short(now)} now, "
                f"{short(recorded)} recorded by the run"
            )
    return None


def _ids(jobs: list[Job]) -> dict:
    """{run id: [run dirs]} of the train jobs' provenance.json."""
    out: dict = {}
    for j in jobs:
        if j.kind == "train":
            rid = (read_record(j.run_dir / "provenance.json") or {}).get("run_id")
            if rid:
                out.setdefault(rid, []).append(j.run_dir)
    return out


REFUSE_TAIL = "it is left untouched: use another root=..., or remove that run dir to train it again"


def conflicts(jobs: list[Job]) -> list:
    """One line per planned run dir that holds another run than the plan's (``run_differs``)
    or the same run as another planned run dir (a copy: one run id in two dirs). The
    runner refuses them all before any job: a finished run may be weeks of GPU time, and an
    unfinished one resumed under another config would mix two runs."""
    lines = []
    for j in [j for j in jobs if j.kind == "train"]:  # an eval job's run: its train job's
        why = run_differs(j)
        if why:
            lines.append(f"{why}; {REFUSE_TAIL}")
    for rid, dirs in _ids(jobs).items():
        if len(dirs) > 1:
            lines.append(
                f"{dirs[1]} holds a copy of the run in {dirs[0]} (both record run id {rid}): one run counted "
                f"twice; {REFUSE_TAIL}"
            )
    return lines


def _eval_problem(job: Job) -> str | None:
    """Why an eval job is not done (its run not the plan's, its export missing, a result
    missing, null, older than the export, of an earlier step, of other weights or of another
    run), or None."""
    if why := run_differs(job):
        return why
    export = finished_checkpoint(job.run_dir, job.steps or 0)
    if export is None:
        return f"{job.run_dir} has no export of step {job.steps} to evaluate"
    t0 = export.stat().st_mtime
    held = None  # the sha256 of the export's tensors, where it recorded one
    if export.suffix == ".pt":
        from mta_repro.runs.provenance import weights_record

        held = (weights_record(export, "consolidated") or {}).get("weights_sha256")
    assert job.eval_out is not None
    for f in [job.eval_out / f"{t}.json" for t in job.eval_tasks]:
        if not f.is_file():
            return f"{f} is missing"
        data = _json(f)
        res = data.get("results") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(res, dict) or not res:
            return f"{f} holds no results"
        if "average" in res and res["average"] is None:
            return f"{f} has a null average"
        if f.stat().st_mtime < t0:
            return f"{f} is older than {export}"
        if isinstance(data.get("step"), int) and data["step"] < (job.steps or 0):  # an earlier checkpoint's
            return f"{f} is of step {data['step']}, not {job.steps}"
        if why := foreign_result(data, job.run_dir):  # copied from another run: evaluate this one
            return f"{f} is not a result of {job.run_dir}: {why}"
        read = (
            ((data.get("provenance") or {}).get("checkpoint") or {}) if isinstance(data.get("provenance"), dict) else {}
        )
        if held and read.get("kind") == "consolidated" and read.get("weights_sha256") not in (None, held):
            return f"{f} is of weights {short(read.get('weights_sha256'))}, the export holds {short(held)}"
    return None


def why_not_done(job: Job) -> str:
    """What keeps ``job`` from being done, in words (for the runner's FAILED line)."""
    if job.kind == "train":
        why = run_differs(job)
        if why:
            return why
        return f"{job.run_dir} holds no export or complete checkpoint of step {job.steps}"
    if job.kind == "eval":
        return _eval_problem(job) or "its results are not all there"
    return f"its output ({', '.join(str(f) for f in outputs(job)) or job.run_dir}) is missing or not whole"


def done(job: Job) -> bool:
    if job.kind == "import":
        assert job.out_file is not None
        src = imported_from(job.out_file)
        return src is not None and Path(src).expanduser().resolve() == job.hf_dir
    if job.kind == "train":
        return finished_checkpoint(job.run_dir, job.steps or 0) is not None and run_differs(job) is None
    if job.kind == "check":
        f = job.run_dir / "appendix_i_check.json"
        data = _json(f, dict)  # damaged or not the check's record: run the check again
        return data is not None and bool(data.get("ok"))
    if job.kind == "eval":
        return _eval_problem(job) is None
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
