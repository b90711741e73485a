"""Seeds as an axis: a pipeline with ``seeds: [...]`` plans one run directory per seed
(``<root>/<stage>/<variant|point>/seed<k>``) with every random stream set from the seed,
hands each seed's weights to the same seed of the next stage, and keeps today's layout
without the field; one seed trains bit-identically twice on one machine, two seeds
differ in initialisation and data order; the run's provenance records each stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mta_repro.data import build_train_loader
from mta_repro.errors import UserError
from mta_repro.model import build_model
from mta_repro.pipeline.__main__ import build_plan
from mta_repro.pipeline.plan import seed_overrides
from mta_repro.train.config import compose, to_train_config

SMALL = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.multiple_of=32",
    "model.kq_conv_layers=0",
    "data.seq_len=32",
    "data.batch_size=2",
    "data.shuffle_buffer=8",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "logging.progress_bar=false",
    "logging.wandb_mode=disabled",
]


def _plan(tmp_path, *overrides):
    plan, _ = build_plan(["pipeline=tiny", f"root={tmp_path}", *overrides])
    return plan


def test_seeds_plan_one_run_dir_per_seed_with_every_stream_set(tmp_path):
    plan = _plan(tmp_path, "+pipeline.seeds=[0,1,2]")
    pre = [j for j in plan.jobs if j.kind == "train" and j.stage == "pretrain"]
    assert sorted(j.label for j in pre) == sorted(
        f"pretrain/{v}/seed{k}" for v in ("baseline", "mta") for k in (0, 1, 2)
    )
    for j in pre:
        k = int(j.label.rsplit("seed", 1)[1])
        assert j.run_dir == plan.root / "pretrain" / j.label.split("/")[1] / f"seed{k}"
        cfg = to_train_config(compose([o for o in j.overrides if not o.startswith("hydra.")]))
        assert (cfg.seed, cfg.model.seed, cfg.data.seed) == (k, k, k)
    # every later stage starts each seed from the same seed's weights
    for j in (j for j in plan.jobs if j.kind == "train" and j.stage != "pretrain"):
        seed = j.label.rsplit("/", 1)[1]
        (src,) = [o for o in j.overrides if o.startswith("checkpoint.init_from=")]
        assert Path(src.partition("=")[2]).name == seed
        assert any(d.endswith(f"/{seed}") for d in j.deps), j.deps
    evals = {j.label for j in plan.jobs if j.kind == "eval"}
    assert evals == {j.label for j in plan.jobs if j.kind == "train"}
    (report,) = [j for j in plan.jobs if j.kind == "report"]
    assert len(report.runs) == len(plan.train_dirs) == 3 * 5  # 2 + 2 + 1 runs a seed


def test_without_seeds_the_layout_and_commands_are_unchanged(tmp_path):
    plan = _plan(tmp_path)
    trains = [j for j in plan.jobs if j.kind == "train"]
    assert {j.label for j in trains} == {
        "pretrain/baseline",
        "pretrain/mta",
        "long_context/baseline",
        "long_context/mta",
        "insertion/mta",
    }
    for j in trains:
        assert j.run_dir == plan.root / j.label
        assert not [o for o in j.overrides if o.split("=")[0] in ("seed", "model.seed", "data.seed")]


def test_a_stage_may_set_its_own_seeds(tmp_path):
    plan, _ = build_plan(["pipeline=small_study", f"root={tmp_path}", "pipeline.seeds=null", "pipeline.variants=[mta]"])
    assert [j.label for j in plan.jobs if j.kind == "train"] == ["pretrain/mta"]
    plan, _ = build_plan(["pipeline=small_study", f"root={tmp_path}", "pipeline.variants=[mta]"])
    assert [j.label for j in plan.jobs if j.kind == "train"] == [f"pretrain/mta/seed{k}" for k in range(8)]


@pytest.mark.parametrize(
    "value, says",
    [("[]", "non-empty list"), ("[0,0]", "names a seed twice"), ("[-1]", "not a seed"), ("[a]", "not a seed")],
)
def test_bad_seeds_are_one_user_error_naming_the_field(tmp_path, value, says):
    with pytest.raises(UserError, match=rf"pipeline\.seeds: .*{says}"):
        _plan(tmp_path, f"+pipeline.seeds={value}")


def _streams(seed: int, overrides: list | None = None):
    cfg = to_train_config(compose([*SMALL, *(seed_overrides(seed) if overrides is None else overrides)]))
    model = build_model(cfg.model)
    loader = build_train_loader(cfg.data)
    first = next(iter(loader))
    return {k: v.clone() for k, v in model.state_dict().items()}, first


def test_two_seeds_differ_in_initialisation_and_data_order():
    w0, b0 = _streams(0)
    w0b, b0b = _streams(0)
    w1, b1 = _streams(1)
    assert all(torch.equal(w0[k], w0b[k]) for k in w0)
    assert all(torch.equal(b0[k], b0b[k]) for k in b0)
    # every randomly initialised matrix differs (norm weights start at 1 whatever the seed)
    random_init = [k for k in w0 if w0[k].dim() == 2]
    assert random_init and all(not torch.equal(w0[k], w1[k]) for k in random_init)
    assert not torch.equal(b0["input"], b1["input"])


def test_seed_alone_sets_every_stream_and_an_explicit_one_still_wins():
    # What a `-m` sweep `seed=0,1,2` (the engine, no pipeline config) relies on: the one field moves the
    # initialisation and the data order with it, exactly as the pipeline's three overrides.
    w1, b1 = _streams(1)
    w1s, b1s = _streams(1, ["seed=1"])
    assert all(torch.equal(w1[k], w1s[k]) for k in w1) and all(torch.equal(b1[k], b1s[k]) for k in b1)
    default = to_train_config(compose(list(SMALL)))
    assert (default.seed, default.model.seed, default.data.seed) == (42, 42, 42)  # Lingua's, as before
    mixed = to_train_config(compose([*SMALL, "seed=1", "model.seed=5"]))
    assert (mixed.seed, mixed.model.seed, mixed.data.seed) == (1, 5, 1)


def _train(run_dir: Path, seed: int) -> dict:
    from mta_repro.train.loop import train

    overrides = [*SMALL, *seed_overrides(seed), "trainer.steps=3", "checkpoint.every=3", "logging.every=1"]
    train(compose([*overrides, "optim.lr=3e-3", "optim.warmup=1", f"run_dir={run_dir}"]))
    blob = torch.load(run_dir / "export" / "consolidated.pt", map_location="cpu", weights_only=True)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((run_dir / "provenance.json").read_text())
    return {"model": blob["model"], "losses": losses, "seeds": record["starts"][-1]["inputs"]["seeds"]}


def test_one_seed_trains_bit_identically_and_the_record_names_its_streams(tmp_path):
    a, b, c = _train(tmp_path / "a", 0), _train(tmp_path / "b", 0), _train(tmp_path / "c", 1)
    assert a["losses"] == b["losses"]
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["losses"] != c["losses"]
    assert any(not torch.equal(a["model"][k], c["model"][k]) for k in a["model"])
    for run, k in ((a, 0), (c, 1)):
        s = run["seeds"]
        assert s["seed"] == k and s["init"]["seed"] == k
        assert s["data_order"]["seed"] == k and s["shuffle_buffer"]["seed"] == k and s["shuffle_buffer"]["size"] == 8
        assert s["dropout"]["seed"] == k and s["dropout"]["p"] == 0.0


# ------------------------------------------------------------------ the small study at toy size
TOY = {  # small_study's overrides that set its size -> a toy's (every other choice kept)
    "model.n_layers": "3",
    "model.kq_conv_layers": "'2'",
    "data.batch_size": "1",
    "trainer.steps": "3",
    "checkpoint.every": "3",
    "logging.every": "1",
}


@pytest.mark.pipeline
def test_small_study_at_toy_size_end_to_end_with_two_seeds(tmp_path):
    """configs/pipeline/small_study.yaml with 2 variants x 2 seeds at toy size, run as
    the one command runs it: per-seed run dirs, each evaluated, and a report whose rows
    carry mean, std and the paired interval over the two seeds (9 processes: 130 s on the
    2-core machine while the study trained beside it)."""
    from omegaconf import DictConfig, OmegaConf

    from mta_repro.pipeline.plan import CONFIG_DIR, Plan
    from mta_repro.pipeline.run import run_local

    spec = OmegaConf.load(CONFIG_DIR / "pipeline" / "small_study.yaml")
    assert isinstance(spec, DictConfig)
    spec.train_overrides = [
        f"{k}={TOY[k]}" if (k := str(o).partition("=")[0]) in TOY else str(o) for o in spec.train_overrides
    ]
    spec.variants, spec.seeds = ["baseline", "mta"], [0, 1]
    ev = [str(o) for o in spec.stages[0].eval]
    toy_eval = {"ppl.max_batches": "3", "needle.samples": "2", "needle.max_background_chars": "20000"}
    spec.stages[0].eval = [f"{k}={toy_eval[k]}" if (k := o.partition("=")[0]) in toy_eval else o for o in ev]
    plan = Plan(spec, tmp_path / "study")
    lines: list = []
    assert run_local(plan, log=lines.append) == 0, "\n".join(lines)
    root = tmp_path / "study"
    for v in ("baseline", "mta"):
        for k in (0, 1):
            d = root / "pretrain" / v / f"seed{k}"
            cfg = OmegaConf.load(d / "config.yaml")
            assert (cfg.seed, cfg.model.seed, cfg.data.seed, cfg.trainer.steps) == (k, k, k, 3)
            ppl = json.loads((d / "eval" / "ppl.json").read_text())["results"]
            assert all(len(x["batch_ce"]) == 3 for x in ppl["domains"].values())
    res = json.loads((root / "report" / "results.json").read_text())
    rows = {r["run"]: r for r in res["tables"]["ppl_seeds"]["rows"]}
    assert set(rows) == {"pretrain/baseline", "pretrain/mta"}
    mta, base = rows["pretrain/mta"], rows["pretrain/baseline"]
    assert mta["seeds"] == "0,1" and mta["interval"] == "t over 2 paired seeds (1 df)"
    avg = {
        (v, k): json.loads((root / "pretrain" / v / f"seed{k}" / "eval" / "ppl.json").read_text())["results"]["average"]
        for v in ("baseline", "mta")
        for k in (0, 1)
    }
    diffs = [avg["mta", k] - avg["baseline", k] for k in (0, 1)]
    assert mta["Δ avg ppl vs reference"] == pytest.approx(sum(diffs) / 2, rel=1e-12)
    assert base["avg ppl (mean)"] == pytest.approx((avg["baseline", 0] + avg["baseline", 1]) / 2, rel=1e-12)
    assert mta["95% CI excludes 0"] in ("yes", "no") and mta["95% lo"] < mta["Δ avg ppl vs reference"] < mta["95% hi"]
    assert {r["run"] for r in res["tables"]["needle_seeds"]["rows"]} == {"pretrain/baseline", "pretrain/mta"}
