"""The official release (facebookresearch/RAM ``projects/mta``, built on Meta Lingua) in and out.

- ``mta_repro.release.config``: a release training YAML (or the ``params.json`` beside a
  Lingua checkpoint) -> our config (``release_to_config``, ``release_file_to_config``,
  ``experiment_yaml``, ``release_model_args``).
- ``mta_repro.release.cli``: ``python -m mta_repro.release convert PATH [--name NAME]
  [--config-dir DIR] [--print] [key=value ...]`` writes ``configs/experiment/<name>.yaml``;
  ``python -m mta_repro.estimate --release-config PATH`` prints the same JSON as our Hydra
  config. The converted experiment trains with ``python -m mta_repro.train
  experiment=<name> [data.root_dir=...]``.
- Checkpoints are *not* here: reading the release's and Lingua's weights (state-dict keys,
  ``consolidated/`` folders, DCP step folders, dump dirs) is ``mta_repro.weights`` (the
  trainer's ``checkpoint.init_from`` and eval read them there, without this converter).
"""

from mta_repro.release.cli import main
from mta_repro.release.config import (
    BYTES_N_WORDS,
    LLAMA3_N_WORDS,
    RELEASE_DEFAULTS,
    RELEASE_MTA_DEFAULTS,
    Conversion,
    default_name,
    experiment_yaml,
    load_release_config,
    release_file_to_config,
    release_model_args,
    release_to_config,
)

__all__ = [
    "BYTES_N_WORDS",
    "LLAMA3_N_WORDS",
    "RELEASE_DEFAULTS",
    "RELEASE_MTA_DEFAULTS",
    "Conversion",
    "default_name",
    "experiment_yaml",
    "load_release_config",
    "release_file_to_config",
    "release_model_args",
    "release_to_config",
    "main",
]
