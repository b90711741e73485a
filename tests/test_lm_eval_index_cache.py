"""The on-disk cache of lm-eval's task index (mta_repro.eval.lm_eval_tasks.task_manager):
what a cached manager knows equals what lm-eval's own TaskManager builds, and a second
process reads the index instead of parsing lm-eval's ~15,000 YAMLs again."""

from pathlib import Path

import pytest

from mta_repro.eval import lm_eval_tasks

pytestmark = pytest.mark.lm_eval


_MEMO = {}  # folder -> its index, shared by the tests of this module


@pytest.fixture
def one_build_per_root(monkeypatch):
    """TaskIndex.build memoised per folder, so lm-eval's own index is parsed once in this
    test (tens of seconds); records which folders were really parsed."""
    from lm_eval.tasks._index import TaskIndex

    real = TaskIndex.build
    memo, parsed = _MEMO, []

    def build(paths, **kw):
        out = {}
        for p in paths:
            parsed.append(Path(p))
            if Path(p) not in memo:
                memo[Path(p)] = real([p], **kw)
            out.update(memo[Path(p)])
        return out

    monkeypatch.setattr(TaskIndex, "build", staticmethod(build))
    return parsed


def test_cached_index_equals_lm_evals_own(tmp_path, monkeypatch, one_build_per_root):
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("MTA_REPRO_CACHE", str(tmp_path / "cache"))
    root = Path(lm_eval.tasks.__file__).parent
    tasks = tmp_path / "tasks"
    (tmp_path / "rows.jsonl").write_text("")
    lm_eval_tasks.write_local_task("arc_easy", {"test": tmp_path / "rows.jsonl"}, tasks, manager=TaskManager())

    plain = TaskManager(include_path=str(tasks))
    first = lm_eval_tasks.task_manager(str(tasks))  # writes the cache
    assert list((tmp_path / "cache").glob("lm_eval_index_*.json"))
    parsed_before = list(one_build_per_root)
    second = lm_eval_tasks.task_manager(str(tasks))  # reads it
    # the second manager indexed only the include folder, not lm-eval's tasks again
    assert one_build_per_root[len(parsed_before) :] == [tasks]
    assert root in parsed_before

    for m in (first, second):
        assert m.task_index == plain.task_index
        assert m.all_tasks == plain.all_tasks and "arc_easy_local" in m.all_tasks
        assert m.all_subtasks == plain.all_subtasks
        assert m.all_groups == plain.all_groups
        assert m.all_tags == plain.all_tags
    assert Path(second.task_index["arc_easy"].yaml_path).is_file()


def test_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch, one_build_per_root):
    monkeypatch.setenv("MTA_REPRO_CACHE", str(tmp_path))
    lm_eval_tasks.task_manager()
    (cache,) = tmp_path.glob("lm_eval_index_*.json")
    cache.write_text('{"truncated": ')
    again = lm_eval_tasks.task_manager()
    assert "arc_easy" in again.all_tasks
    assert len(cache.read_text()) > 1_000_000  # rewritten whole
