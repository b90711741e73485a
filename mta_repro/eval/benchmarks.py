"""The paper's nine benchmarks by their lm-eval names, and the metric each is reported with."""

from __future__ import annotations

# The nine tasks (lm-eval 0.4.x names) and the metric each one's number is (the task's
# headline metric, named in the report's table header). The paper's table gives one
# accuracy per task without naming lm-eval's metric; the tasks whose answers differ in
# length (PIQA, HellaSwag, ARC-easy/challenge, OpenBookQA) are reported with the
# length-normalised accuracy, as in the Llama papers' and Meta Lingua's evaluations;
# BoolQ, SIQA, WinoGrande and MMLU with plain accuracy (lm-eval computes no other).
BENCH_TASKS = [
    "boolq",
    "piqa",
    "social_iqa",
    "hellaswag",
    "winogrande",
    "arc_easy",
    "arc_challenge",
    "openbookqa",
    "mmlu",
]
BENCH_METRIC = {t: "acc" for t in BENCH_TASKS} | {
    t: "acc_norm" for t in ("piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa")
}
# lm-eval's names of the same tasks elsewhere (old project names, local copies)
TASK_ALIASES = {"siqa": "social_iqa"}
LOCAL_SUFFIX = "_local"


def canonical_task(name: str) -> str:
    """The paper's task name for an lm-eval task name (``arc_easy_local`` -> ``arc_easy``;
    ``mmlu_*`` subtasks -> ``mmlu``)."""
    base = name[: -len(LOCAL_SUFFIX)] if name.endswith(LOCAL_SUFFIX) else name
    base = TASK_ALIASES.get(base, base)
    return "mmlu" if base.startswith("mmlu_") else base


def headline_metric(name: str) -> str:
    """The metric (lm-eval's name) that a task's number in the report is."""
    return BENCH_METRIC.get(canonical_task(name), "acc")
