"""The paper's toy task (section 4.1) end to end: baseline and MTA for several seeds.

    python scripts/toy_task.py                          # reduced scale (CPU, configs/toy/reduced.yaml)
    python scripts/toy_task.py --config toy/paper train.device=cuda   # the paper's scale
    python scripts/toy_task.py seeds=[42] train.steps=200 out_dir=/tmp/toy   # overrides

Writes to ``out_dir``: results.csv (model, seed, seq_error, token_error in %),
results.md (per model and seed plus the mean), errors.png (held-out error over
training), runs/<model>_seed<seed>.jsonl (the held-out curve of each run) and
config.yaml (the resolved config). Each run checkpoints into ckpt/ at every evaluation:
rerunning the same command after a crash or a kill resumes every unfinished run where
its last checkpoint left it, and takes finished runs from their checkpoints.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from mta_repro.toy.find_block import generate_splits
from mta_repro.toy.report import markdown_table, plot_curves, write_csv
from mta_repro.toy.train import ToyConfig, to_toy_config, train_run
from mta_repro.train.config import compose

_DATA = None  # the generated splits, shared with the worker processes


def _init_worker(data) -> None:
    global _DATA
    _DATA = data


def _job(args) -> dict:
    cfg, variant, seed, log_path, ckpt_path = args
    return train_run(cfg, variant, seed, data=_DATA, log_path=Path(log_path), ckpt_path=Path(ckpt_path))


def _exit_on_sigterm(signum, frame):
    # SystemExit unwinds `with Pool`, which terminates the workers; without it a killed
    # parent leaves its (spawned) workers training on as orphans.
    raise SystemExit(128 + signum)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="toy/reduced", help="config under configs/ (toy/reduced or toy/paper)")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. train.steps=100")
    a = p.parse_args(argv)
    composed = compose(a.overrides, config_name=a.config)
    cfg: ToyConfig = to_toy_config(composed)
    out = Path(cfg.out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "ckpt").mkdir(exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), out / "config.yaml")

    t0 = time.time()
    data = generate_splits(cfg.data)
    print(
        f"data: {len(data[0])} train / {len(data[1])} held-out sequences of "
        f"{cfg.data.seq_len} tokens ({time.time() - t0:.1f}s)",
        flush=True,
    )

    # MTA runs are slower (materialised scores); start them first so the pool balances.
    jobs = [
        (cfg, v, s, str(out / "runs" / f"{v}_seed{s}.jsonl"), str(out / "ckpt" / f"{v}_seed{s}.pt"))
        for v in sorted(cfg.variants, key=lambda v: v != "mta")
        for s in cfg.seeds
    ]
    if cfg.train.workers > 1:
        ctx = mp.get_context("spawn")
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            with ctx.Pool(cfg.train.workers, initializer=_init_worker, initargs=(data,)) as pool:
                results = pool.map(_job, jobs, chunksize=1)
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        _init_worker(data)
        results = [_job(j) for j in jobs]
    order = {v: i for i, v in enumerate(cfg.variants)}
    results.sort(key=lambda r: (order[r["model"]], r["seed"]))

    write_csv(results, out / "results.csv")
    d = cfg.data
    title = f"Toy task ({a.config}): N={d.block_length}, K={d.n_blocks} blocks, L={d.query_length}, target={d.target}"
    notes = [
        f"Held-out set: {d.n_test} sequences; training set: {d.n_train} sequences of "
        f"{d.seq_len} tokens; {cfg.train.steps} steps of batch {cfg.train.batch_size}; "
        f"lr {cfg.optim.lr:g} ({cfg.optim.scheduler} after {cfg.optim.warmup} warmup steps), "
        "identical for both models.",
        "Sequence error: % of held-out samples with any wrong target token (greedy argmax "
        "under teacher forcing, as the release's eval_ppl); token error: % of wrong "
        "target tokens.",
        "Produced by: python scripts/toy_task.py --config "
        + a.config
        + (" " + " ".join(a.overrides) if a.overrides else ""),
        f"Wall time: {(time.time() - t0) / 60:.1f} min; per run: "
        + ", ".join(f"{r['model']}/{r['seed']} {r['train_seconds'] / 60:.1f} min" for r in results),
    ]
    (out / "results.md").write_text(markdown_table(results, title, notes))
    plot_curves(results, out / "errors.png", title)
    with open(out / "summary.json", "w") as f:
        json.dump(
            [{k: r[k] for k in ("model", "seed", "seq_error", "token_error", "train_seconds")} for r in results],
            f,
            indent=1,
        )
    print((out / "results.md").read_text(), flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
