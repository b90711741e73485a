"""Data-parallel evaluation: 2 ranks (torchrun, gloo on CPU) give the 1-process results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import make_run

from mta_repro.eval.lm_eval_tasks import write_local_task

FIX = Path(__file__).parent / "fixtures" / "eval"

pytestmark = pytest.mark.distributed

ENV = {
    **os.environ,
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def numbers(obj, path=""):
    """Flatten the numeric leaves of a result tree: {path: value}."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(numbers(v, f"{path}/{k}"))
        return out
    return {path: obj} if isinstance(obj, (int, float)) and not isinstance(obj, bool) else {}


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="mta", seq_len=512)
    tasks = tmp_path / "tasks"
    write_local_task("arc_easy", {"test": FIX / "lm_eval" / "arc_easy_test.jsonl"}, tasks)
    args = [
        str(run_dir),
        "tasks=[ppl,needle,babilong,benchmarks]",
        "device=cpu",
        "ppl.seq_len=32",
        "ppl.max_batches=5",
        "ppl.batch_size=2",
        "ppl.domains=[book,github]",
        "needle.context_lens=[512]",
        "needle.needle_counts=[2]",
        "needle.depths=[0,50]",
        "needle.samples=3",
        "needle.batch_size=2",
        "needle.max_new_tokens=3",
        "needle.max_background_chars=50000",
        "babilong.tasks=[qa1,qa4]",
        "babilong.lengths=[0k]",
        "babilong.samples=3",
        "babilong.batch_size=2",
        "babilong.max_new_tokens=3",
        "lm_eval.benchmarks=[arc_easy_local]",
        f"lm_eval.include_path={tasks}",
        "lm_eval.batch_size=2",
    ]
    one = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", *args, f"out_dir={tmp_path / 'one'}"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "mta_repro.eval",
            *args,
            f"out_dir={tmp_path / 'two'}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    for task in ("ppl", "needle", "babilong", "benchmarks"):
        a = json.loads((tmp_path / "one" / f"{task}.json").read_text())
        b = json.loads((tmp_path / "two" / f"{task}.json").read_text())
        assert a["world_size"] == 1 and b["world_size"] == 2
        na, nb = numbers(a["results"]), numbers(b["results"])
        assert na.keys() == nb.keys() and na, task
        for k in na:
            assert nb[k] == pytest.approx(na[k], rel=1e-5, abs=1e-6), (task, k)
    ppl = json.loads((tmp_path / "two" / "ppl.json").read_text())["results"]["domains"]["book"]
    assert ppl["batches"] == 5 and ppl["tokens"] == 5 * 2 * 32
    # the same random windows, each with its loss and document, in the same order
    one_ppl = json.loads((tmp_path / "one" / "ppl.json").read_text())["results"]["domains"]
    two_ppl = json.loads((tmp_path / "two" / "ppl.json").read_text())["results"]["domains"]
    for name, a in one_ppl.items():
        b = two_ppl[name]
        assert a["batch_doc"] == b["batch_doc"] and len(a["batch_doc"]) == 10, name
        assert b["batch_ce"] == pytest.approx(a["batch_ce"], rel=1e-5), name
    # the needle prompts: the same ids in the same order
    ids = [json.loads((tmp_path / d / "needle.json").read_text())["results"]["accuracy"] for d in ("one", "two")]
    assert ids[0]["512"]["2"]["prompt_ids"] == ids[1]["512"]["2"]["prompt_ids"]
