"""Evaluation: model loading, cached generation, per-domain perplexity, lm-eval
benchmarks, multi-needle NIAH and BabiLong (the paper's section 4).

Entry points: ``python -m mta_repro.eval <run_dir> tasks=[ppl,needle,babilong,benchmarks,lambada]``
(``python -m mta_repro.eval.lm_eval_cli`` for lm-eval's own CLI, ``python -m mta_repro.eval.generate``)
writes ``<run_dir>/eval/<name>.json``; ``python -m mta_repro.report`` reads them.
"""
