"""The one tiny configuration the tests build from: a small CPU model and a quiet, short
training run. A test states only what differs (its numbers are compared with stored or
independently computed values, so each caller keeps exactly the settings it had)."""

from __future__ import annotations

from mta_repro.model import ModelArgs

# What a tiny CPU training run sets: short sequences, small batches, no validation, no export,
# a metrics row every step, no wandb and no progress bar (hydra override keys -> values).
TRAIN = {
    "data.seq_len": "32",
    "data.batch_size": "2",
    "data.shuffle_buffer": "4",
    "trainer.device": "cpu",
    "trainer.eval_every": "0",
    "checkpoint.export": "false",
    "logging.every": "1",
    "logging.wandb_mode": "disabled",
    "logging.progress_bar": "false",
}

# The tiny model's size (the vocabulary follows the tokenizer unless a caller sets it).
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "multiple_of": 32}


def tiny_train(*overrides: str, omit: tuple[str, ...] = ()) -> list[str]:
    """TRAIN as hydra overrides: each ``key=value`` in ``overrides`` replaces TRAIN's value or is
    added after it, and the keys in ``omit`` stay at the config's own default."""
    unknown = set(omit) - TRAIN.keys()
    assert not unknown, f"omit names keys TRAIN does not set: {sorted(unknown)}"
    values = {k: v for k, v in TRAIN.items() if k not in omit}
    for o in overrides:
        key, _, value = o.partition("=")
        values[key] = value
    return [f"{k}={v}" for k, v in values.items()]


def tiny_model_overrides(**sizes) -> list[str]:
    """MODEL as ``model.*`` hydra overrides, with ``sizes`` (any ModelArgs field) replacing or added."""
    return [f"model.{k}={v}" for k, v in {**MODEL, **sizes}.items()]


def tiny_model_args(**fields) -> ModelArgs:
    """ModelArgs of the tiny model, with ``fields`` replacing or added to MODEL."""
    return ModelArgs(**{**MODEL, **fields})
