"""Loading (consolidated file and DCP run dir), the eval CLI and its early errors."""

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import make_run

from mta_repro.eval.load import load_model
from mta_repro.eval.run import main, parse_argv, run


@pytest.mark.parametrize("fmt", ["consolidated", "dcp"])
def test_load_model_gives_the_saved_weights(tmp_path, fmt):
    run_dir, ref = make_run(tmp_path / "run", fmt=fmt)
    model, cfg = load_model(run_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    assert cfg.model.dim == 64


@pytest.mark.slow
def test_errors_before_work(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither export/consolidated.pt nor a complete DCP"):
        load_model(tmp_path / "empty")
    run_dir, _ = make_run(tmp_path / "badvocab", attention="baseline", vocab=300)
    with pytest.raises(ValueError, match="n_words=258 but the model's vocab_size is 300"):
        run(parse_argv([str(run_dir), "tasks=[ppl]"]))
    with pytest.raises(ValueError, match="unknown task"):
        run(parse_argv([str(run_dir), "tasks=[ppl,mmlu_typo]"]))
    with pytest.raises(ValueError, match="cannot hold 10 needles"):
        ok_dir, _ = make_run(tmp_path / "ok", attention="baseline")
        run(parse_argv([str(ok_dir), "tasks=[needle]", "needle.context_lens=[200]", "needle.needle_counts=[10]"]))


@pytest.mark.slow
def test_cli_writes_results(tmp_path, capsys):
    run_dir, _ = make_run(tmp_path / "run", seq_len=512)
    rc = main(
        [
            str(run_dir),
            "tasks=[ppl,needle,babilong]",
            "ppl.seq_len=64",
            "ppl.max_batches=2",
            "ppl.domains=[book,github]",
            "needle.context_lens=[512]",
            "needle.needle_counts=[2]",
            "needle.depths=[0,100]",
            "needle.samples=1",
            "needle.max_new_tokens=2",
            "babilong.tasks=[qa1]",
            "babilong.lengths=[0k]",
            "babilong.samples=1",
            "babilong.max_new_tokens=2",
        ]
    )
    assert rc == 0
    ppl = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert ppl["variant"] == "mta" and ppl["step"] == 7
    doms = ppl["results"]["domains"]
    assert set(doms) == {"book", "github"} and all(d["tokens"] == 2 * 4 * 64 for d in doms.values())
    assert ppl["results"]["average"] == pytest.approx((doms["book"]["ppl"] + doms["github"]["ppl"]) / 2)
    needle = json.loads((run_dir / "eval" / "needle.json").read_text())
    assert set(needle["results"]["accuracy"]["512"]["2"]["by_depth"]) == {"0", "100"}
    bab = json.loads((run_dir / "eval" / "babilong.json").read_text())
    assert set(bab["results"]["accuracy"]["qa1"]) == {"0k"}


@pytest.mark.slow
def test_cli_lm_eval_tasks_on_local_data(tmp_path):
    from mta_repro.eval.lm_eval_tasks import write_local_task

    fix = Path(__file__).parent / "fixtures" / "eval" / "lm_eval"
    tasks_dir = tmp_path / "tasks"
    write_local_task("arc_easy", {"test": fix / "arc_easy_test.jsonl"}, tasks_dir)
    write_local_task("lambada_openai", {"test": fix / "lambada_test.jsonl"}, tasks_dir)
    run_dir, _ = make_run(tmp_path / "run", attention="talking_heads")
    written = run(
        parse_argv(
            [
                str(run_dir),
                "tasks=[benchmarks,lambada]",
                "lm_eval.benchmarks=[arc_easy_local]",
                "lm_eval.lambada=[lambada_openai_local]",
                f"lm_eval.include_path={tasks_dir}",
            ]
        )
    )
    bench = json.loads(Path(written["benchmarks"]).read_text())["results"]
    # ARC-easy's headline metric is the length-normalised accuracy (the paper's), named
    acc = bench["tasks"]["arc_easy_local"]["acc_norm,none"]
    assert bench["metrics"]["arc_easy_local"] == "acc_norm"
    assert bench["summary"]["arc_easy_local"] == pytest.approx(100 * acc)
    assert bench["summary"]["average"] == pytest.approx(100 * acc)
    # the documents scored, what the report's Wilson interval of the accuracy needs
    n_docs = len((fix / "arc_easy_test.jsonl").read_text().splitlines())
    assert bench["n_samples"] == {"arc_easy_local": n_docs}
    lam = json.loads(Path(written["lambada"]).read_text())["results"]
    assert lam["summary"]["lambada_openai_local"]["ppl"] == lam["tasks"]["lambada_openai_local"]["perplexity,none"]


@pytest.mark.slow
def test_export_cli_help_and_one_line_error(tmp_path):
    """python -m mta_repro.train.export: --help, and a bad run dir as one line (exit 2)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "mta_repro.train.export", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("usage: python -m mta_repro.train.export")
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train.export", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "config.yaml" in p.stderr
