"""Loading (consolidated file and DCP run dir), the eval CLI and its early errors."""

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "eval"))
from eval_helpers import tiny_model  # noqa: E402

from mta_repro.config import compose  # noqa: E402
from mta_repro.eval.load import load_model  # noqa: E402
from mta_repro.eval.run import main, parse_argv, run  # noqa: E402

SMALL = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.multiple_of=32",
    "model.vocab_size=258", "data.tokenizer.name=bytes", "model.kq_conv_layers=1",
]


def make_run(tmp: Path, attention="mta", fmt="consolidated", vocab=258) -> Path:
    cfg = compose(SMALL + [f"attention={attention}", f"model.vocab_size={vocab}", f"run_dir={tmp}"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    from mta_repro.model import build_model

    model = build_model(cfg.model)
    with torch.no_grad():  # leave identity init, so a wrong load shows up
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tmp.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, tmp / "config.yaml")
    if fmt == "consolidated":
        (tmp / "export").mkdir()
        torch.save({"model": model.state_dict(), "config": plain, "step": 7}, tmp / "export" / "consolidated.pt")
    else:
        import torch.distributed.checkpoint as dcp

        ck = tmp / "checkpoints" / f"{7:010d}"
        dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=str(ck))
        (ck / ".complete").touch()
    return tmp, model


@pytest.mark.parametrize("fmt", ["consolidated", "dcp"])
def test_load_model_gives_the_saved_weights(tmp_path, fmt):
    run_dir, ref = make_run(tmp_path / "run", fmt=fmt)
    model, cfg = load_model(run_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    assert cfg.model.dim == 64


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


def test_cli_writes_results(tmp_path, capsys):
    run_dir, _ = make_run(tmp_path / "run")
    rc = main([str(run_dir), "tasks=[ppl,needle,babilong]", "ppl.seq_len=64", "ppl.max_batches=2",
               "ppl.domains=[book,github]", "needle.context_lens=[512]", "needle.needle_counts=[2]",
               "needle.depths=[0,100]", "needle.samples=1", "needle.max_new_tokens=2",
               "babilong.tasks=[qa1]", "babilong.lengths=[0k]", "babilong.samples=1", "babilong.max_new_tokens=2"])
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
