"""What a queued job needs at its start, checked when it is submitted.

A job may wait in the queue for days, then start on a compute node from the command it was
given, and a path that is not there ends it in its first seconds. ``problems(cfg, args)`` finds
those at submission, one line each: the data root and its layout (the training files of
every domain the config reads, the validation files when it validates), the tokenizer
file, ``checkpoint.init_from``, and a run directory the job can write. Every SLURM path
runs it (``mta_repro.pipeline.submit``, ``mta_repro.eval.submit``, ``mta_repro.pipeline
launcher=slurm``, ``mta_repro.train -m hydra/launcher=slurm``) on ``--dry-run``, ``--plan``
and the submission, and submits nothing when a line is found; ``--no-check`` skips the path
checks, for paths that exist only on the compute nodes.

``resolved_overrides(cfg)`` writes into the job's command what it would otherwise read
from its surroundings at start: the values of the fields taken from environment variables
(``${oc.env:VAR,default}``, e.g. ``data.root_dir`` from ``SLIMPAJAMA_DIR``), which the
job's environment need not have, and the data and tokenizer paths made absolute (the job
runs from the repository, not from the submit directory).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from mta_repro.errors import UserError

# The loaders that read data.root_dir with data.tokenizer (a plugin may read anything).
DATA_LOADERS = ("mta_repro.data:build_train_loader", "mta_repro.pipeline.data:build_continued_loader")
NO_CHECK = "--no-check"
HINT = f"add {NO_CHECK} if it exists only on the compute nodes"


class JobCheckError(UserError):
    """What a job would miss at its start: one line per problem (``lines``)."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = list(lines)


def _abs(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def _resolved_path(path: str) -> Path:
    """A data or tokenizer path as the job resolves it (absolute: from the working
    directory here, else from the repository, where the job runs)."""
    from mta_repro.data.args import resolve_path

    return Path(os.path.abspath(resolve_path(path)))


def writable_dir_problem(path: Path, field: str) -> str | None:
    """A line when the job could not create or write ``path`` (its nearest existing
    ancestor is not a writable directory)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{field}: {path}: {p} is not a directory ({HINT})"
    if not os.access(p, os.W_OK | os.X_OK):
        what = "is not writable" if p == path else f"cannot be created ({p} is not writable)"
        return f"{field}: {path} {what} ({HINT})"
    return None


def _env_note(node, key: str) -> str:
    """`` (from $VAR)`` or `` ($VAR is not set: the default)`` for a field read from an
    environment variable, else ""."""
    parent, _, leaf = key.rpartition(".")
    if not isinstance(node, DictConfig):
        return ""
    owner = OmegaConf.select(node, parent) if parent else node
    if not isinstance(owner, DictConfig) or leaf not in owner:
        return ""
    node = owner._get_node(leaf)
    assert node is not None  # leaf in owner
    raw = node._value()
    m = re.search(r"oc\.env:([A-Za-z_][A-Za-z0-9_]*)", raw) if isinstance(raw, str) else None
    if not m:
        return ""
    var = m.group(1)
    return f" (from ${var})" if var in os.environ else f" (${var} is not set: its default)"


def data_problems(data_cfg, validates: bool) -> list[str]:
    """Lines for a data root, layout or tokenizer file the job would not find."""
    from mta_repro.data.args import active_sources, to_data_args
    from mta_repro.data.listing import corpus_root, list_files

    args = to_data_args(data_cfg)
    out = []
    tok = args.tokenizer
    if tok.name != "bytes":
        if not tok.path:
            out.append(f"data.tokenizer.path: not set (the {tok.name} tokenizer file)")
        elif not _resolved_path(tok.path).is_file():
            out.append(
                f"data.tokenizer.path: {_resolved_path(tok.path)}{_env_note(data_cfg, 'tokenizer.path')} "
                f"does not exist (the {tok.name} tokenizer file; {HINT})"
            )
    try:
        corpus_root(args)
    except UserError:
        return [
            f"data.root_dir: {_resolved_path(args.root_dir)}{_env_note(data_cfg, 'root_dir')} does not exist "
            f"(the corpus, layout {args.layout}; {HINT})"
        ] + out
    seen: set = set()
    for domain in active_sources(args):
        for split in ("train", "validation") if validates else ("train",):
            try:
                list_files(args, domain, split)
            except UserError as e:
                extra = " (or set trainer.eval_every=0 to train without validation)" if split == "validation" else ""
                line = f"{e}{extra} ({HINT})"
                if line not in seen:  # the slimpajama layout: one split directory for every domain
                    seen.add(line)
                    out.append(line)
                break  # a domain's validation files are not looked for where its training files are missing
    return out


def problems(cfg: DictConfig, args, base: Path | None = None, made_by_plan: Iterable[Path] = ()) -> list[str]:
    """What the training job of ``cfg`` (a composed train config; ``args``: its TrainConfig,
    ``mta_repro.train.config.to_train_config``, which raises the config's own faults first)
    would miss at its start, one line each. ``base``: the submit directory (relative run_dir
    and init_from); ``made_by_plan``: paths an earlier job makes (a pipeline's source runs)."""
    base = Path.cwd() if base is None else base
    out = []
    line = writable_dir_problem(_abs(str(args.run_dir), base), "run_dir")
    if line:
        out.append(line)
    if args.trainer.loader in DATA_LOADERS:
        out += data_problems(cfg.data, validates=args.trainer.eval_every > 0)
    init = args.checkpoint.init_from
    if init:
        src = _abs(str(init), base)
        made = {Path(p) for p in made_by_plan}
        if src not in made and not src.exists():
            out.append(
                f"checkpoint.init_from: {src} does not exist (a run dir, a checkpoint dir or a .pt file; "
                f"relative paths are taken from the submit directory; {HINT})"
            )
    return out


# The batch scripts of the jobs that train in their run dir (pipeline.submit's and the pipeline's).
TRAIN_SCRIPTS = ("train.sbatch", "pipeline_train.sbatch")
# squeue's states of a job that is over (the rest are queued, running or on their way out).
_ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def queued_owner(run_dir: Path) -> str | None:
    """The line refusing a second job on ``run_dir``: a queued or running SLURM job trains
    there (its batch script is ``<run_dir>/slurm/train.sbatch`` or the pipeline's), or a
    live start holds the run dir's lock (the line the start itself refuses with). A job
    still pending has not taken the lock yet, hence squeue. None when neither is found (no
    squeue here: the lock alone)."""
    from mta_repro.runs.runlock import in_use_line

    mine = {os.path.realpath(run_dir / "slurm" / name) for name in TRAIN_SCRIPTS}
    if shutil.which("squeue") is not None:
        try:
            p = subprocess.run(["squeue", "-h", "-o", "%i|%T|%o"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            p = None
        for line in p.stdout.splitlines() if p is not None and p.returncode == 0 else ():
            job, state, command = (line.split("|", 2) + ["", ""])[:3]
            if state.strip() not in _ENDED and os.path.realpath(command.strip()) in mine:
                return (
                    f"run_dir={run_dir} is already SLURM job {job.strip()}'s ({state.strip().lower()}, "
                    f"{command.strip()}): a second job would train the same run; wait for it, cancel it "
                    f"(scancel {job.strip()}), or use another run_dir=..."
                )
    return in_use_line(run_dir)


def _env_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` whose value reads an environment variable (``oc.env``)."""
    out = []
    if isinstance(node, DictConfig):
        items = [(str(k), node._get_node(k)) for k in node]
    elif isinstance(node, ListConfig):
        return out  # a list element cannot be set alone from the command line
    else:
        return out
    for key, child in items:
        path = f"{prefix}{key}"
        if path == "hydra":
            continue
        if isinstance(child, (DictConfig, ListConfig)):
            if not OmegaConf.is_interpolation(node, key):
                out += _env_keys(child, path + ".")
            continue
        raw = child._value() if child is not None else None
        if isinstance(raw, str) and "oc.env:" in raw:
            out.append(path)
    return out


def quote_value(value) -> str:
    """A value as Hydra reads it back from the command line (quoted when it has
    characters of Hydra's grammar)."""
    s = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./:+@~-]+", s):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def resolved_overrides(cfg: DictConfig, given: Iterable[str] = ()) -> list[str]:
    """Overrides that put what the job would read from its surroundings into its command:
    every field read from an environment variable, with its value here, and the data root
    and tokenizer path made absolute. Keys the command line already sets (``given``) are
    left to it."""
    keys_given = {o.split("=", 1)[0].lstrip("+~") for o in given if "=" in o}
    env = _env_keys(cfg)
    values = {key: str(OmegaConf.select(cfg, key)) for key in env}
    paths = []
    if str(OmegaConf.select(cfg, "trainer.loader", default=DATA_LOADERS[0])) in DATA_LOADERS and "data" in cfg:
        paths.append("data.root_dir")
        tok = cfg.data.get("tokenizer")
        if tok is not None and tok.get("path") and str(tok.get("name")) != "bytes":
            paths.append("data.tokenizer.path")
    for key in paths:
        raw = str(OmegaConf.select(cfg, key))
        absolute = str(_resolved_path(raw))
        if key in env or absolute != raw:
            values[key] = absolute
    return [f"{key}={quote_value(value)}" for key, value in values.items() if key not in keys_given]


def raise_problems(lines: list[str]) -> None:
    """Raise JobCheckError when there is any line."""
    if lines:
        raise JobCheckError(lines)


def print_problems(prog: str, e: BaseException, file=None) -> None:
    """A JobCheckError's lines (else the error's one line), each as ``<prog>: error: ...``."""
    import sys

    from mta_repro.cli import describe

    for line in getattr(e, "lines", None) or [describe(e)]:
        print(f"{prog}: error: {line}", file=file or sys.stderr)
