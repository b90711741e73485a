"""The paper preset's lm-eval task list against the installed lm-eval's task index.

A task renamed in lm-eval (``siqa`` -> ``social_iqa`` in 0.4.x) must fail here, in CI,
not at the start of a cluster job.
"""

import pytest

from mta_repro.eval.lm_eval_tasks import LAMBADA, PAPER_FEW_SHOT, PAPER_ZERO_SHOT, check_task_names, task_manager
from mta_repro.eval.run import compose_eval

pytestmark = pytest.mark.lm_eval


@pytest.fixture(scope="module")
def manager():
    return task_manager()


def test_paper_preset_tasks_are_all_known_to_lm_eval(manager):
    cfg = compose_eval(["eval/preset=paper"])
    assert "benchmarks" in cfg.tasks and "lambada" in cfg.tasks
    names = list(cfg.lm_eval.benchmarks) + list(cfg.lm_eval.lambada)
    # The preset runs the paper's whole list: 8 zero-shot tasks, MMLU 5-shot, 2 LAMBADAs.
    assert set(names) == set(PAPER_ZERO_SHOT) | set(PAPER_FEW_SHOT) | set(LAMBADA)
    assert len(names) == 11
    check_task_names(names, manager)  # raises on any name lm-eval does not know
    for shots_task in cfg.lm_eval.num_fewshot:
        assert shots_task in names
    assert cfg.lm_eval.num_fewshot == {"mmlu": 5}


def test_renamed_task_fails_before_any_model_work(manager):
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['siqa'\]"):
        check_task_names(["boolq", "siqa"], manager)
