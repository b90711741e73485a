"""The paper's published numbers (spec section 5), keyed by attention variant."""

VARIANT_LABELS = {
    "baseline": "Transformer",
    "diff": "Differential Transformer",
    "talking_heads": "Talking heads",
    "mta": "MTA",
}

# Validation perplexity averaged over domains, 880M, 105B tokens (mean of 2 runs).
AVG_PPL = {"baseline": 11.25, "diff": 11.15, "talking_heads": 11.04, "mta": 10.91}
# ... after the 4K long-context finetune.
AVG_PPL_LONG = {"baseline": 11.02, "diff": 10.89, "talking_heads": 10.88, "mta": 10.65}
# Average accuracy (%) over the benchmarks (BoolQ ... OpenBookQA, MMLU 5-shot).
BENCH_AVG = {"baseline": 43.7, "diff": 43.9, "talking_heads": 44.4, "mta": 44.9}
# LAMBADA perplexity (standard, OpenAI); the paper reports these two variants only.
LAMBADA = {"baseline": (17.6, 9.5), "mta": (13.2, 8.4)}
# Table 5 ablations (avg ppl) that can be recognised from a config.
ABLATIONS = {
    "pre+post-softmax conv, scalar gating": 10.90,
    "pre+post-softmax conv, scalar gating, depth scaling": 10.92,
}
