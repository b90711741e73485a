"""One long (model, seed) run of the toy task, logging the held-out curve to a JSONL file.

For probing whether a model leaves the "query letters only" plateau with more steps
(results/toy_task/README.md, "Longer probe"). The lr schedule is constant after warmup,
so ``train.steps`` only sets an upper bound: the run may be stopped at any time and the
curve up to the last evaluation is in the log (one flushed line per evaluation).

    python scripts/toy_probe.py --variant mta --seed 42 \
        --log results/toy_task/probes/mta_seed42.jsonl train.steps=20000 train.eval_every=250
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mta_repro.toy.train import VARIANTS, to_toy_config, train_run
from mta_repro.train.config import compose


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="toy/reduced", help="config under configs/")
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log", required=True, help="JSONL file for the held-out curve")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. train.steps=20000")
    a = p.parse_args(argv)
    cfg = to_toy_config(compose(a.overrides, config_name=a.config))
    log = Path(a.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    return train_run(cfg, a.variant, a.seed, log_path=log)


if __name__ == "__main__":
    main(sys.argv[1:])
