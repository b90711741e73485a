"""The paper's published numbers (the paper's tables and Appendix I), keyed by attention variant, and
what they were measured on (so a report can say when a run is not comparable)."""

VARIANT_LABELS = {
    "baseline": "Transformer",
    "diff": "Differential Transformer",
    "talking_heads": "Talking heads",
    "mta": "MTA",
}

# What the paper's numbers were measured on, per stage: model size (configs/model name and
# its (dim, n_layers, n_heads)), optimizer steps and tokens.
# "label": the size as the paper names it (configs/model/1b.yaml is the paper's "1.4B").
PAPER_SETTING = {
    "pretrain": {"size": "880m", "label": "880M", "steps": 400_000, "tokens": "105B", "what": "880M, 105B tokens"},
    "long_context": {
        "size": "880m",
        "label": "880M",
        "steps": 40_054,
        "tokens": "10.5B",
        "what": "880M, 105B tokens + 10.5B tokens at 4K",
    },
    "insertion": {
        "size": "1b",
        "label": "1.4B",
        "steps": 40_054,
        "tokens": "10.5B",
        "what": "1.4B Transformer + 10.5B tokens (Appendix I)",
    },
    # the Appendix I control: the baseline trained on alike (same length, no MTA)
    "continued": {
        "size": "1b",
        "label": "1.4B",
        "steps": 40_054,
        "tokens": "10.5B",
        "what": "1.4B Transformer trained on for 10.5B tokens (Appendix I control)",
    },
}
# The perplexity window (tokens) of each stage's published perplexity. Pretraining and
# Appendix I (trained on at 2048): the release's evaluation (projects/mta/eval.py,
# ppl_seq_len 2048, batches of 4, 256 batches). After the 4K finetune: the finetuned
# context, 4096 (the paper reports the finetuned models' perplexity without printing
# the window; the release's ppl_seq_len is a setting; this project takes the context
# the model was finetuned for; docs/evaluation.md). A run evaluated at another window
# is not compared with these numbers.
PPL_SEQ_LEN = {"pretrain": 2048, "long_context": 4096, "insertion": 2048, "continued": 2048}
SIZES = {  # (dim, n_layers, n_heads) of configs/model/<name>.yaml
    "300m": (1024, 20, 16),
    "550m": (1280, 24, 10),
    "880m": (1536, 24, 16),
    "1b": (2048, 24, 16),
    # Meta's public Llama 3 checkpoints of Appendix I (configs/model/llama3_*.yaml)
    "llama3_2_1b": (2048, 16, 32),
    "llama3_2_3b": (3072, 28, 24),
    "llama3_1_8b": (4096, 32, 32),
}

# Validation perplexity averaged over domains, 880M, 105B tokens (mean of 2 runs).
AVG_PPL = {"baseline": 11.25, "diff": 11.15, "talking_heads": 11.04, "mta": 10.91}
# ... after the 4K long-context finetune.
AVG_PPL_LONG = {"baseline": 11.02, "diff": 10.89, "talking_heads": 10.88, "mta": 10.65}
# Appendix I, own 1.4B model: MTA inserted vs the Transformer trained on alike.
AVG_PPL_INSERTION = {"baseline": 10.69, "mta": 10.61}
# Appendix I of the paper (Golovneva et al., 2025, "Multi-Token Attention", Appendix I
# "Finetuning with MTA"), per model finetuned at 2048 on SlimPajama: MTA inserted with
# identity-initialised new parts vs the same model trained on alike without MTA (the
# control), validation perplexity averaged over domains (the paper's evaluation: 2048-token
# windows). Tokens: 10.5B for the own 1.4B and the Llama 3.2 models, 5.3B for Llama 3.1 8B
# (our reading of the appendix, docs/llama3.md); steps at 262,144 tokens per step (4 x 2048
# x 32 GPUs), as the experiments configure them. Keyed by SIZES name: a run's row is
# compared with its own model's pair.
APPENDIX_I = {
    "1b": {"label": "1.4B", "steps": 40_054, "tokens": "10.5B", "mta": 10.61, "baseline": 10.69},
    "llama3_2_1b": {"label": "Llama 3.2 1B", "steps": 20_218, "tokens": "5.3B", "mta": 10.46, "baseline": 10.53},
    "llama3_2_3b": {"label": "Llama 3.2 3B", "steps": 20_218, "tokens": "5.3B", "mta": 8.89, "baseline": 8.93},
    "llama3_1_8b": {"label": "Llama 3.1 8B", "steps": 20_218, "tokens": "5.3B", "mta": 8.48, "baseline": 8.53},
}
APPENDIX_I_STAGES = ("insertion", "continued")  # the MTA insertion and its control


def appendix_i_setting(size: str, stage: str) -> dict:
    """PAPER_SETTING-like entry of one Appendix I model for the insertion or its control."""
    a = APPENDIX_I[size]
    what = (
        f"{a['label']} + {a['tokens']} tokens (Appendix I)"
        if stage == "insertion"
        else f"{a['label']} trained on for {a['tokens']} tokens (Appendix I control)"
    )
    return {"size": size, "label": a["label"], "steps": a["steps"], "tokens": a["tokens"], "what": what}


AVG_PPL_BY_STAGE = {
    "pretrain": AVG_PPL,
    "long_context": AVG_PPL_LONG,
    "insertion": AVG_PPL_INSERTION,
    "continued": {"baseline": AVG_PPL_INSERTION["baseline"]},
}

# Average accuracy (%) over the nine benchmarks (BoolQ ... OpenBookQA zero-shot, MMLU
# 5-shot), pretrained 880M models.
BENCH_AVG = {"baseline": 43.7, "diff": 43.9, "talking_heads": 44.4, "mta": 44.9}
# LAMBADA perplexity (standard, OpenAI); the paper reports these two variants only.
LAMBADA = {"baseline": (17.6, 9.5), "mta": (13.2, 8.4)}

# Table 5 (880M MTA, avg ppl). A row matches a run when the run is the release's MTA
# (6x11 kernels before and after softmax in layers 2,6,...,22, head mixing, group norm,
# scalar gate) with these changes:
TABLE5 = {
    # the release's configuration: pre+post-softmax convolutions with scalar gating
    "pre+post-softmax conv, scalar gating": 10.90,
    # ... with depth scaling (group norm times 1 - lambda_init)
    "pre+post-softmax conv, scalar gating, depth scaling": 10.92,
    # the release's curse_norm (block norms times 1 - lambda_init(layer), "layer-norm
    # scaling", arXiv 2502.05795): the paper's one layer-norm-scaling configuration, 11.41
    "pre+post-softmax conv, scalar gating, layer-norm scaling": 11.41,
}
