"""Data pipeline: corpus readers, tokenizers, mixture/packing loader with exact resume.

Public interface (details in the module docstrings):
``DataArgs``, ``TokenizerArgs``, ``build_tokenizer``, ``build_train_loader``,
``iter_validation_docs``, ``domains``.
"""

from mta_repro.data.args import DataArgs, TokenizerArgs, to_data_args
from mta_repro.data.loader import TrainLoader, build_train_loader, domains, iter_validation_docs
from mta_repro.data.tokenizers import Tokenizer, build_tokenizer

__all__ = [
    "DataArgs",
    "TokenizerArgs",
    "to_data_args",
    "Tokenizer",
    "build_tokenizer",
    "TrainLoader",
    "build_train_loader",
    "domains",
    "iter_validation_docs",
]
