"""Evaluation: model loading, cached generation, per-domain perplexity, lm-eval
benchmarks, multi-needle NIAH and BabiLong (spec section 4).

Entry point: ``python -m mta_repro.eval <run_dir> tasks=[ppl,needle,babilong,lm_eval]``
writes ``<run_dir>/eval/<name>.json``; ``python -m mta_repro.report`` reads them.
"""
