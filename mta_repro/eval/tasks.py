"""The evaluation tasks of ``python -m mta_repro.eval``, in a registry (as ``ATTN_IMPLS``).

Each task is an ``EvalTask`` registered under its name in ``EVAL_TASKS`` (the names
accepted in ``tasks=[...]``). ``run`` (mta_repro/eval/run.py) calls, for every task asked
for and in this order:

1. ``check(cfg)`` before the model is loaded: config-only checks (names, options);
2. ``lengths(cfg, ctx)``: {override: token length} the task will evaluate at, checked
   against the context the run was trained at (``data.seq_len`` of its config) and
   written into the task's JSON;
3. ``prepare(cfg, ctx)`` once the model and tokenizer are there, before any task runs:
   everything that can still fail (needle budgets, lm-eval task names) fails here, and
   whatever it builds (the needle haystack) is kept on ``ctx`` for ``run``;
4. ``run(cfg, ctx)``: the results, JSON-ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EvalContext:
    """What the tasks share: the loaded model and tokenizer, the run's training config,
    its data arguments and the context length it was trained at."""

    model: Any = None
    tokenizer: Any = None
    run_cfg: Any = None
    data_args: Any = None
    trained_seq_len: int | None = None
    state: dict[str, Any] = field(default_factory=dict)  # per task, from prepare() to run()


def docs(data_args, domain: str, splits):
    """The documents of one domain of the run's data, these splits in order."""
    from mta_repro.data.sources import iter_docs

    for split in splits:
        yield from iter_docs(data_args, domain, split)


class EvalTask:
    name = ""
    section = ""  # the EvalConfig field holding this task's settings

    def check(self, cfg) -> None:
        pass

    def lengths(self, cfg, ctx: EvalContext) -> dict[str, int]:
        """{the override that sets a length: the largest token length it asks for}."""
        return {}

    def prepare(self, cfg, ctx: EvalContext) -> None:
        pass

    def run(self, cfg, ctx: EvalContext) -> dict:
        raise NotImplementedError

    def settings(self, cfg) -> dict:
        """The config this task's result depends on (an up-to-date JSON must match it)."""
        from dataclasses import asdict

        return asdict(getattr(cfg, self.section)) if self.section else {}


EVAL_TASKS: dict[str, EvalTask] = {}


def register(cls):
    EVAL_TASKS[cls.name] = cls()
    return cls


@register
class PerplexityTask(EvalTask):
    name, section = "ppl", "ppl"

    def check(self, cfg):
        from mta_repro.eval.ppl import check_window_args

        check_window_args(cfg.ppl.window_sampling, cfg.ppl.window_seed, cfg.ppl.max_batches)

    def lengths(self, cfg, ctx):
        return {"ppl.seq_len": int(cfg.ppl.seq_len or ctx.data_args.seq_len)}

    def run(self, cfg, ctx):
        from mta_repro.eval.ppl import validation_perplexity

        p = cfg.ppl
        return validation_perplexity(
            ctx.model,
            ctx.tokenizer,
            ctx.data_args,
            p.domains,
            p.seq_len,
            p.batch_size,
            p.max_batches,
            window_sampling=p.window_sampling,
            window_seed=p.window_seed,
        )


@register
class NeedleTask(EvalTask):
    name, section = "needle", "needle"

    def check(self, cfg):
        from mta_repro.errors import UserError

        if cfg.needle.query not in ("one", "all"):
            raise UserError(f"eval.needle.query: expected 'one' or 'all', got {cfg.needle.query!r}")
        seed = cfg.needle.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise UserError(f"eval.needle.seed: expected a non-negative integer or null (the run's seed), got {seed!r}")

    def lengths(self, cfg, ctx):
        return {"needle.context_lens": max(int(c) for c in cfg.needle.context_lens)}

    def prepare(self, cfg, ctx):
        # The haystack is built (and the background read) once, here; run() uses it.
        from mta_repro.eval.needle import Haystack, NeedleGenerator

        n = cfg.needle
        hay = Haystack(
            ctx.tokenizer, docs(ctx.data_args, n.background_domain, n.background_splits), n.max_background_chars
        )
        gen = NeedleGenerator(ctx.tokenizer, hay, n.query)
        gen.check_all(n.context_lens, n.needle_counts, n.max_new_tokens)
        ctx.state[self.name] = gen

    def run(self, cfg, ctx):
        from dataclasses import replace

        from mta_repro.eval.needle import needle_seed, run_needle

        record = (getattr(ctx.model, "source", None) or {}).get("record")
        seed, source = needle_seed(cfg.needle.seed, ctx.run_cfg, record)
        args = replace(cfg.needle, seed=seed)
        return run_needle(ctx.model, ctx.tokenizer, args, generator=ctx.state.pop(self.name), seed_source=source)


@register
class BabiLongTask(EvalTask):
    name, section = "babilong", "babilong"

    def check(self, cfg):
        from mta_repro.eval import babilong as bl

        bl.check_args(cfg.babilong)

    def lengths(self, cfg, ctx):
        from mta_repro.eval.babilong import length_tokens, parse_length

        return {"babilong.lengths": max(length_tokens(parse_length(x)) for x in cfg.babilong.lengths)}

    def run(self, cfg, ctx):
        from mta_repro.eval.babilong import run_babilong

        b = cfg.babilong
        bg = docs(ctx.data_args, b.background_domain, b.background_splits) if b.source == "generated" else None
        return run_babilong(ctx.model, ctx.tokenizer, b, background=bg)


class _LMEvalTask(EvalTask):
    section = "lm_eval"

    def task_names(self, cfg) -> list:
        raise NotImplementedError

    def max_length(self, cfg, ctx) -> int | None:
        return cfg.lm_eval.max_length or ctx.trained_seq_len

    def lengths(self, cfg, ctx):
        n = self.max_length(cfg, ctx)
        return {"lm_eval.max_length": int(n)} if n else {}

    def prepare(self, cfg, ctx):
        from mta_repro.eval.hub import offline_if_unreachable
        from mta_repro.eval.lm_eval_tasks import check_task_names, task_manager

        offline_if_unreachable()  # no hub: cached datasets load, missing ones fail in one line
        if "lm_manager" not in ctx.state:  # one task index for benchmarks and LAMBADA
            ctx.state["lm_manager"] = task_manager(cfg.lm_eval.include_path)
        check_task_names(self.task_names(cfg), ctx.state["lm_manager"])

    def settings(self, cfg):
        from dataclasses import asdict

        s = asdict(cfg.lm_eval)
        return {k: v for k, v in s.items() if k not in ("benchmarks", "lambada")} | {"tasks": self.task_names(cfg)}

    def run(self, cfg, ctx):
        from lm_eval.evaluator import simple_evaluate

        from mta_repro.eval.hub import hub_errors
        from mta_repro.eval.lm_eval_model import MTAReproLM

        e = cfg.lm_eval
        lm = MTAReproLM(
            model=ctx.model, tokenizer=ctx.tokenizer, batch_size=e.batch_size, max_length=self.max_length(cfg, ctx)
        )
        names = self.task_names(cfg)
        groups: dict = {}
        for name in names:  # one simple_evaluate call per few-shot count
            groups.setdefault(int(e.num_fewshot.get(name, 0)), []).append(name)
        results: dict = {}
        data: dict = {}  # every task lm-eval ran (a group's subtasks too): what its rows came from
        n_samples: dict = {}  # task -> documents scored (the report's Wilson interval needs n)
        for shots, group in groups.items():
            with hub_errors(group):
                out = simple_evaluate(
                    model=lm,
                    tasks=group,
                    num_fewshot=shots,
                    task_manager=ctx.state["lm_manager"],
                    limit=e.limit,
                    bootstrap_iters=0,
                    log_samples=False,
                )
            if out is None:  # ranks other than 0 under torchrun: rank 0 has the results
                continue
            from mta_repro.eval.lm_eval_tasks import task_data

            for name, config in (out.get("configs") or {}).items():
                data[name] = task_data(config)
            for name, metrics in out["results"].items():  # pyright: ignore[reportTypedDictNotRequiredAccess]  # always set
                results[name] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) or k == "alias"}
            for name, n in (out.get("n-samples") or {}).items():
                if isinstance(n, dict) and isinstance(n.get("effective"), int):
                    n_samples[name] = n["effective"]
        return {
            "tasks": results,
            "summary": summarize_lm_eval(results, names),
            # the metric each summary number is (lambada: perplexity)
            "metrics": {n: headline(n, results.get(n, {})) for n in names if not n.startswith("lambada")},
            "n_samples": n_samples,
            "limit": e.limit,
            "max_length": lm.max_length,
            "data": data,
        }


@register
class BenchmarksTask(_LMEvalTask):
    name = "benchmarks"

    def task_names(self, cfg):
        return list(cfg.lm_eval.benchmarks)


@register
class LambadaTask(_LMEvalTask):
    name = "lambada"

    def task_names(self, cfg):
        return list(cfg.lm_eval.lambada)


def headline(name: str, metrics: dict) -> str:
    """The metric a task's summary uses: the paper's (``eval.benchmarks.headline_metric``),
    or ``acc`` where lm-eval computed no normalised accuracy for the task."""
    from mta_repro.eval.benchmarks import headline_metric

    metric = headline_metric(name)
    return metric if f"{metric},none" in metrics or "acc,none" not in metrics else "acc"


def summarize_lm_eval(results: dict, names) -> dict:
    """One number per task: accuracy in % with its ``headline`` metric, perplexity (and
    accuracy) for LAMBADA; the benchmark average over the accuracy tasks."""
    summary: dict = {}
    for name in names:
        r = results.get(name, {})
        if name.startswith("lambada"):
            summary[name] = {"ppl": r.get("perplexity,none"), "acc": _pct(r.get("acc,none"))}
            continue
        summary[name] = _pct(r.get(f"{headline(name, r)},none"))
    accs = [v for k, v in summary.items() if not k.startswith("lambada") and v is not None]
    if accs:
        summary["average"] = sum(accs) / len(accs)
    return summary


def _pct(x):
    return None if x is None else 100.0 * float(x)
