"""``python -m mta_repro.eval <run_dir> [hydra overrides]``: run evaluations, write JSON.

Examples:
    python -m mta_repro.eval runs/debug eval/preset=debug
    python -m mta_repro.eval runs/880m_mta tasks=[ppl,benchmarks,lambada] dtype=bfloat16 device=cuda
    python -m mta_repro.eval runs/x tasks=[needle] needle.context_lens=[4096] needle.samples=100
    torchrun --nproc_per_node 8 -m mta_repro.eval runs/x eval/preset=paper   # work split over GPUs

Each task writes ``<out_dir>/<task>.json`` (out_dir defaults to ``<run_dir>/eval``):
{"task", "run_dir", "step", "variant", "results": ...}. Bad task names, a missing
checkpoint, a tokenizer/vocab mismatch and needle budgets are checked before any
evaluation starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from mta_repro.errors import UserError
from mta_repro.eval.args import TASK_NAMES, EvalConfig, register_eval_config

log = logging.getLogger("mta_repro.eval")


def compose_eval(overrides: Sequence[str] = ()) -> EvalConfig:
    from mta_repro.config import compose

    register_eval_config()
    cfg = compose(list(overrides), config_name="eval")
    return OmegaConf.to_object(cfg)


def parse_argv(argv: Sequence[str]) -> EvalConfig:
    """First argument without '=' is the run directory; the rest are Hydra overrides."""
    paths = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    if len(paths) > 1:
        raise UserError(f"eval: expected one run directory, got {paths}")
    if paths:
        overrides = [f"run_dir={paths[0]}"] + overrides
    from mta_repro.config import CONFIG_DIR
    from mta_repro.cli import check_group_options

    # an optional group: Hydra would silently skip an unknown preset
    check_group_options(overrides, ["eval/preset"], Path(CONFIG_DIR))
    return compose_eval(overrides)


def variant_name(model_cfg) -> str:
    if model_cfg.get("diff_transformer"):
        return "diff"
    mta = model_cfg.get("mta") or {}
    if not mta.get("use_mta"):
        return "baseline"
    if mta.get("query_kernel_size") or mta.get("after_sm_query_kernel_size"):
        return "mta"
    return "talking_heads"


def _docs(data_args, domain: str, splits):
    from mta_repro.data.sources import iter_docs

    for split in splits:
        yield from iter_docs(data_args, domain, split)


def run(cfg: EvalConfig) -> dict:
    unknown = [t for t in cfg.tasks if t not in TASK_NAMES]
    if unknown:
        raise UserError(f"eval.tasks: unknown task(s) {unknown}; expected any of {list(TASK_NAMES)}")
    if cfg.needle.query not in ("one", "all"):
        raise UserError(f"eval.needle.query: expected 'one' or 'all', got {cfg.needle.query!r}")
    from mta_repro.eval import babilong as bl
    for t in cfg.babilong.tasks if "babilong" in cfg.tasks else ():
        bl.check_task(t)
    for length in cfg.babilong.lengths if "babilong" in cfg.tasks else ():
        bl.length_tokens(int(length) if str(length).isdigit() else length)

    from mta_repro.eval import dist
    from mta_repro.eval.load import load_for_eval

    # Under torchrun every process takes its share of each task; rank 0 writes.
    rank, world = dist.init(cfg.device)
    model, tok, run_cfg = load_for_eval(cfg.run_dir, device=cfg.device, dtype=cfg.dtype)
    from mta_repro.data import to_data_args

    data_args = to_data_args(run_cfg.data)
    from mta_repro.eval.load import default_out_dir

    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg.run_dir)
    source = getattr(model, "source", {})
    meta = {
        "run_dir": str(cfg.run_dir),
        "variant": variant_name(run_cfg.model),
        "step": source.get("step"),
        "weights": source.get("path"),  # the export or DCP checkpoint evaluated
        "dtype": cfg.dtype,
    }

    lm_manager = None
    if "benchmarks" in cfg.tasks or "lambada" in cfg.tasks:
        from mta_repro.eval.lm_eval_tasks import check_task_names, task_manager

        lm_manager = task_manager(cfg.lm_eval.include_path)
        names = (cfg.lm_eval.benchmarks if "benchmarks" in cfg.tasks else []) + (
            cfg.lm_eval.lambada if "lambada" in cfg.tasks else []
        )
        check_task_names(names, lm_manager)
    needle_gen = None
    if "needle" in cfg.tasks:
        from mta_repro.eval.needle import Haystack, NeedleGenerator

        n = cfg.needle
        hay = Haystack(tok, _docs(data_args, n.background_domain, n.background_splits), n.max_background_chars)
        needle_gen = NeedleGenerator(tok, hay, n.query)
        for c in n.context_lens:
            for k in n.needle_counts:
                needle_gen.check_budget(int(c), int(k), n.max_new_tokens)

    written = {}
    for task in cfg.tasks:
        t0 = time.time()
        log.info("eval: %s on %s", task, cfg.run_dir)
        if task == "ppl":
            from mta_repro.eval.ppl import validation_perplexity

            p = cfg.ppl
            res = validation_perplexity(model, tok, data_args, p.domains, p.seq_len, p.batch_size, p.max_batches)
        elif task == "needle":
            from mta_repro.eval.needle import run_needle

            n = cfg.needle
            res = run_needle(
                model, tok, _docs(data_args, n.background_domain, n.background_splits), n.context_lens,
                n.needle_counts, n.depths, n.samples, n.query, n.max_new_tokens, n.batch_size, n.seed,
                n.max_background_chars,
            )
        elif task == "babilong":
            b = cfg.babilong
            lengths = [int(x) if str(x).isdigit() else x for x in b.lengths]
            res = bl.run_babilong(
                model, tok, b.tasks, lengths, b.samples, b.source,
                _docs(data_args, b.background_domain, b.background_splits) if b.source == "generated" else None,
                b.max_new_tokens, b.batch_size, b.seed, b.dataset,
            )
        else:
            res = _run_lm_eval(model, tok, cfg, task, lm_manager, run_cfg)
        if rank != 0:
            continue
        res = {"task": task, **meta, "world_size": world, "seconds": round(time.time() - t0, 1), "results": res}
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{task}.json"
        path.write_text(json.dumps(res, indent=1, default=str))
        written[task] = str(path)
        log.info("eval: wrote %s", path)
    return written


def _run_lm_eval(model, tok, cfg: EvalConfig, task: str, manager, run_cfg) -> dict:
    import lm_eval

    from mta_repro.eval.lm_eval_model import MTAReproLM

    e = cfg.lm_eval
    from mta_repro.eval.lm_eval_model import trained_seq_len

    max_length = e.max_length or trained_seq_len(run_cfg)
    lm = MTAReproLM(model=model, tokenizer=tok, batch_size=e.batch_size, max_length=max_length)
    names = e.benchmarks if task == "benchmarks" else e.lambada
    groups: dict = {}
    for name in names:  # one simple_evaluate call per few-shot count
        groups.setdefault(int(e.num_fewshot.get(name, 0)), []).append(name)
    results: dict = {}
    for shots, group in groups.items():
        out = lm_eval.simple_evaluate(
            model=lm, tasks=group, num_fewshot=shots, task_manager=manager, limit=e.limit,
            bootstrap_iters=0, log_samples=False,
        )
        if out is None:  # ranks other than 0 under torchrun: rank 0 has the results
            continue
        for name, metrics in out["results"].items():
            results[name] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) or k == "alias"}
    return {"tasks": results, "summary": summarize_lm_eval(results, names), "limit": e.limit, "max_length": lm.max_length}


def summarize_lm_eval(results: dict, names) -> dict:
    """One number per task: accuracy in % (acc_norm for HellaSwag as is customary),
    perplexity for LAMBADA; the benchmark average over the accuracy tasks."""
    summary = {}
    for name in names:
        r = results.get(name, {})
        if name.startswith("lambada"):
            summary[name] = {"ppl": r.get("perplexity,none"), "acc": _pct(r.get("acc,none"))}
            continue
        key = "acc_norm,none" if name == "hellaswag" and "acc_norm,none" in r else "acc,none"
        summary[name] = _pct(r.get(key))
    accs = [v for k, v in summary.items() if not k.startswith("lambada") and v is not None]
    if accs:
        summary["average"] = sum(accs) / len(accs)
    return summary


def _pct(x):
    return None if x is None else 100.0 * float(x)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mta_repro.cli import run_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0

    def go() -> int:
        cfg = parse_argv(argv)
        for task, path in run(cfg).items():
            print(f"{task}: {path}")
        return 0

    return run_cli("eval", go)
