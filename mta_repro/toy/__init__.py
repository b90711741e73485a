"""The paper's motivating toy task (section 4.1): find the block holding both query
letters. ``find_block`` = data, tokenizer and metric; ``train`` = one training run;
``report`` = results table and plot; ``scripts/toy_task.py`` runs it all."""

from mta_repro.toy.find_block import CharTokenizer, FindBlockArgs, error_counts, generate_splits

__all__ = ["CharTokenizer", "FindBlockArgs", "error_counts", "generate_splits"]
