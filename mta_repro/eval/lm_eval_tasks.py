"""Task lists and local-data task YAMLs for lm-eval.

Real runs use lm-eval's registered tasks, whose datasets come from the HF hub or its
local cache. ``write_local_task`` makes a YAML that ``include:``s lm-eval's own task
definition (so the official prompt format is used) but reads rows of that task's HF
schema from local json/jsonl files: the offline tests run on these, and so can anyone
with a local copy of a dataset:

    python -m mta_repro.eval.lm_eval_tasks lambada_openai test=lambada_test.jsonl --out tasks/
    python -m mta_repro.eval.lm_eval_cli --model_args pretrained=RUN --include_path tasks/ --tasks lambada_openai_local
"""

from __future__ import annotations

from pathlib import Path

from mta_repro.errors import UserError

# The paper's benchmarks (the paper's section 4): zero-shot, and MMLU 5-shot; LAMBADA separately.
PAPER_ZERO_SHOT = ["boolq", "piqa", "social_iqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
PAPER_FEW_SHOT = {"mmlu": 5}
LAMBADA = ["lambada_standard", "lambada_openai"]


def task_manager(include_path: str | None = None):
    """lm-eval's TaskManager, with the index of lm-eval's own tasks read from a cache.

    Building that index parses lm-eval's ~15,000 task YAMLs (seconds, a minute on a loaded
    machine) in every evaluation process; the index depends only on the installed lm-eval, so
    it is kept as JSON in ``$MTA_REPRO_CACHE`` (default ``~/.cache/mta_repro``), keyed by
    lm-eval's version, location and tasks-folder mtime. ``include_path`` folders are
    always indexed afresh (they are small and change). Any mismatch with lm-eval's
    internals falls back to the plain TaskManager: the cache is only a speed-up."""
    from lm_eval.tasks import TaskManager

    try:
        return _cached_task_manager(TaskManager, include_path)
    except Exception:  # noqa: BLE001 - another lm-eval layout: build the index as lm-eval does
        return TaskManager(include_path=include_path) if include_path else TaskManager()


def _cached_task_manager(TaskManager, include_path):
    import hashlib
    import json
    import os
    from importlib.metadata import version

    import lm_eval.tasks
    from lm_eval.tasks._index import Entry, Kind, TaskIndex

    root = Path(lm_eval.tasks.__file__).parent
    key = f"{version('lm_eval')}|{root}|{root.stat().st_mtime_ns}"
    cache_dir = Path(os.environ.get("MTA_REPRO_CACHE", Path.home() / ".cache" / "mta_repro"))
    path = cache_dir / f"lm_eval_index_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        rows = json.loads(path.read_text())
        defaults = {
            k: Entry(n, Kind[kind], None if y is None else Path(y), cfg, set(tags))
            for k, (n, kind, y, cfg, tags) in rows.items()
        }
    except (OSError, ValueError, KeyError, TypeError):  # absent or unreadable: rebuild it
        defaults = TaskIndex.build([root])
        rows = {
            k: [e.name, e.kind.name, None if e.yaml_path is None else str(e.yaml_path), e.cfg, sorted(e.tags)]
            for k, e in defaults.items()
        }
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(rows))
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except (OSError, TypeError, ValueError):
            pass  # not cacheable here (read-only home, a non-JSON config): index built anyway
    manager = TaskManager(include_path=include_path, include_defaults=False)
    # What TaskManager.__init__ derives from its index (lm-eval 0.4.9+), over defaults + include_path
    # (later paths win, as in lm-eval).
    manager._index = index = {**defaults, **manager._index}
    manager._all_tasks = sorted(index)
    manager._all_subtasks = sorted(k for k, e in index.items() if e.kind in (Kind.TASK, Kind.PY_TASK))
    manager._all_groups = sorted(k for k, e in index.items() if e.kind == Kind.GROUP)
    manager._all_tags = sorted(k for k, e in index.items() if e.kind == Kind.TAG)
    return manager


def check_task_names(names, manager) -> None:
    """Unknown task names fail here, before any model work."""
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        import difflib

        near = {n: difflib.get_close_matches(n, sorted(known), n=1, cutoff=0.75) for n in unknown}
        hints = [f"{n} -> {m[0]}" for n, m in near.items() if m]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise UserError(
            f"eval.lm_eval.tasks: unknown lm-eval task(s) {unknown}{hint}; "
            "list them with: python -m mta_repro.eval.lm_eval_cli ls tasks"
        )


def task_data(config) -> dict:
    """What an lm-eval task's rows were read from, from its config as lm-eval ran it:
    ``{"dataset", "name"}`` and either ``"files"`` (each local data file: split, path,
    sha256 of its bytes) or ``"revision"`` (the hub revision the task pins, else the commit
    the local hub cache resolved for it; None when neither is known)."""
    from collections.abc import Mapping

    from mta_repro.runs.provenance import sha256_file

    cfg: Mapping = config if isinstance(config, Mapping) else {}
    given = cfg.get("dataset_kwargs")
    kw: Mapping = given if isinstance(given, Mapping) else {}
    out: dict = {"dataset": cfg.get("dataset_path"), "name": cfg.get("dataset_name")}
    files = kw.get("data_files")
    if files:
        listed = files.items() if isinstance(files, Mapping) else [(None, files)]
        out["files"] = [
            {"split": split, "path": str(f), "sha256": sha256_file(Path(str(f))) if Path(str(f)).is_file() else None}
            for split, fs in listed
            for f in (fs if isinstance(fs, (list, tuple)) else [fs])
        ]
    else:
        out["revision"] = kw.get("revision") or _hub_revision(cfg.get("dataset_path"))
    return out


def _hub_revision(dataset: str | None) -> str | None:
    """The commit the local Hugging Face hub cache holds for ``dataset``'s main branch."""
    if not dataset:
        return None
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        ref = Path(HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}" / "refs" / "main"
        return ref.read_text().strip() or None
    except (ImportError, OSError):
        return None


def write_local_task(
    task: str,
    data_files: dict,
    out_dir,
    new_name: str | None = None,
    manager=None,
) -> Path:
    """Write ``<out_dir>/<new_name>.yaml``: lm-eval's ``task`` over local json files.

    data_files: {split name used by the task (e.g. "test", "validation"): path}.
    """
    manager = manager or task_manager()
    info = manager.task_index.get(task)
    yaml_path = info.get("yaml_path") if isinstance(info, dict) else getattr(info, "yaml_path", None)
    if info is None or yaml_path in (-1, None):
        raise UserError(f"lm-eval task {task!r} has no YAML definition to include")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = new_name or f"{task}_local"
    files = {split: str(Path(p).resolve()) for split, p in data_files.items()}
    lines = [
        f"include: {yaml_path}",
        f"task: {name}",
        "tag: []",
        "dataset_path: json",
        "dataset_name: null",
        "dataset_kwargs:",
        "  data_files:",
        *[f"    {split}: {path}" for split, path in files.items()],
    ]
    # The included task may name splits that the local files do not have.
    for key, split in (("training_split", "train"), ("validation_split", "validation"), ("test_split", "test")):
        lines.append(f"{key}: {split if split in files else 'null'}")
    if "test" not in files and "validation" not in files:
        raise UserError(f"write_local_task: give a 'test' or 'validation' file for {task}")
    path = out_dir / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    """``TASK SPLIT=FILE [SPLIT=FILE ...] [--out DIR] [--name NAME]``: write the task YAML."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m mta_repro.eval.lm_eval_tasks",
        description="Write an lm-eval task YAML that reads TASK's rows from local json/jsonl files.",
    )
    p.add_argument("task", help="an lm-eval task name (its prompt format is included)")
    p.add_argument("files", nargs="+", metavar="SPLIT=FILE", help="e.g. test=lambada_test.jsonl")
    p.add_argument("--out", default="lm_eval_tasks", help="folder for the YAML (default: lm_eval_tasks)")
    p.add_argument("--name", default=None, help="the new task's name (default: TASK_local)")
    a = p.parse_args(argv)

    def run() -> int:
        files = {}
        for f in a.files:
            split, sep, path = f.partition("=")
            if not sep or not split or not path:
                raise UserError(f"{f!r}: expected SPLIT=FILE, e.g. test=data.jsonl")
            if not Path(path).is_file():
                raise UserError(f"{split}={path}: no such file")
            files[split] = path
        manager = task_manager()
        check_task_names([a.task], manager)
        path = write_local_task(a.task, files, a.out, new_name=a.name, manager=manager)
        print(f"wrote {path}\nuse: --include_path {Path(a.out)} --tasks {path.stem}")
        return 0

    from mta_repro.cli import run_cli

    return run_cli("lm_eval_tasks", run)


if __name__ == "__main__":
    raise SystemExit(main())
