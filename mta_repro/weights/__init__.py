"""Finding and reading model weights: the one owner, used by training (``checkpoint.init_from``),
eval, generate, the HF export, the pipeline's finished check and the release loader.

    from mta_repro.weights import find_weights, read_weights, load_weights

    find_weights(path)   # [Candidate(kind, path, step, problem)], newest first
    read_weights(cand)   # Weights(state, step, config, source): our key layout, fp32, CPU
    load_weights(path)   # the newest readable candidate; a damaged one is named, the next used

A path is a run directory (export and complete DCP checkpoints), a checkpoint folder, a
consolidated ``.pt``, or the official release's / Meta Lingua's ``consolidated/`` folder,
``consolidated.pth``, DCP step folder or dump dir.

Every file is read without running code it may carry (``mta_repro.weights.safe``;
docs/trust.md): ``torch.load(weights_only=True)``, DCP metadata through an allow-list,
safetensors after their header is checked (``safetensors_file``). A file that needs more is
refused with ``UnsafeFileError`` naming it, never loaded. What is read is checked before a
model takes it (``check``): float tensors only, the model's keys and shapes (the file's own
config, or ``load_weights(expect=)``), no interpolation in a stored config.
"""

from mta_repro.weights.check import ModelMismatchError, check_against, check_float, expected_shapes
from mta_repro.weights.find import Candidate, NoWeightsError, export_step, find_weights
from mta_repro.weights.layout import (
    COMPLETE,
    EXPORT,
    complete_checkpoints,
    latest_checkpoint,
    saved_world_size,
    step_dir_name,
    verify_checkpoint,
)
from mta_repro.weights.lingua import release_checkpoint_path, release_state_dict_to_ours
from mta_repro.weights.read import FallbackWarning, Weights, load_weights, read_config, read_dcp_model, read_weights
from mta_repro.weights.safe import load_pt
from mta_repro.weights.safetensors_file import FLOAT_DTYPES as SAFETENSORS_FLOAT_DTYPES
from mta_repro.weights.safetensors_file import SafetensorsFile, TensorInfo, read_header

__all__ = [
    "COMPLETE",
    "EXPORT",
    "SAFETENSORS_FLOAT_DTYPES",
    "Candidate",
    "FallbackWarning",
    "ModelMismatchError",
    "NoWeightsError",
    "SafetensorsFile",
    "TensorInfo",
    "Weights",
    "check_against",
    "check_float",
    "complete_checkpoints",
    "expected_shapes",
    "export_step",
    "find_weights",
    "latest_checkpoint",
    "load_pt",
    "load_weights",
    "read_config",
    "read_dcp_model",
    "read_header",
    "read_weights",
    "release_checkpoint_path",
    "release_state_dict_to_ours",
    "saved_world_size",
    "step_dir_name",
    "verify_checkpoint",
]
