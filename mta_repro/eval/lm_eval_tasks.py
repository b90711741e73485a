"""Task lists and local-data task YAMLs for lm-eval.

Real runs use lm-eval's registered tasks, whose datasets come from the HF hub or its
local cache. ``write_local_task`` makes a YAML that ``include:``s lm-eval's own task
definition (so the official prompt format is used) but reads rows of that task's HF
schema from local json/jsonl files: the offline tests run on these, and so can anyone
with a local copy of a dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mta_repro.errors import UserError

# The paper's benchmarks (spec 4): zero-shot, and MMLU 5-shot; LAMBADA separately.
PAPER_ZERO_SHOT = ["boolq", "piqa", "social_iqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
PAPER_FEW_SHOT = {"mmlu": 5}
LAMBADA = ["lambada_standard", "lambada_openai"]


def task_manager(include_path: Optional[str] = None):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def check_task_names(names, manager) -> None:
    """Unknown task names fail here, before any model work."""
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"eval.lm_eval.tasks: unknown lm-eval task(s) {unknown}")


def write_local_task(
    task: str,
    data_files: dict,
    out_dir,
    new_name: Optional[str] = None,
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
