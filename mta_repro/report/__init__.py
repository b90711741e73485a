"""Reports: ``python -m mta_repro.report <run_dir>... --out <dir>`` gathers the
``<run_dir>/eval/*.json`` results, metrics.jsonl and weights of one or more runs into
the paper's tables (Markdown, CSV, LaTeX, with the published numbers alongside) and
plots (PNG)."""
