"""What weights from elsewhere must satisfy before a model takes them, checked where the
file is opened (``read_weights``, ``load_weights(expect=)``, the HF import), each fault
one line naming the file and the tensor or config key.

- Every tensor of the model state is a float tensor (float32, bfloat16, float16, float64):
  an integer or boolean one is a relabelled or foreign file (an ``I32`` embedding would be
  cast to float and train at loss 1e11), never cast.
- Every tensor the model has is there with the model's shape (the model built on ``meta``
  from the file's own config, or from the caller's), before anything is permuted or copied;
  no tensor the model lacks. A tied model may omit ``output.weight``.
- A config stored in a weights file is data: it may refer to its own keys (``${model.n_heads}``,
  as the attention configs do) but call no resolver (``${oc.env:VAR}``, ``${oc.decode:...}``,
  any ``${name:...}``), which would read this machine's environment variables or run code
  of ours on the file's arguments when the config is resolved.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mta_repro.errors import CorruptFileError, UnsafeFileError, UserError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ModelMismatchError(UserError, ValueError):
    """Weights that do not fit the model they are loaded into (another size or variant)."""


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_float(where: str, name: str, dtype) -> None:
    """``CorruptFileError`` unless ``dtype`` (a torch dtype, or its name: "bfloat16") is a
    float dtype of model weights."""
    if dtype not in FLOAT_DTYPES and dtype not in {_dtype_name(d) for d in FLOAT_DTYPES}:
        shown = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        raise CorruptFileError(
            f"{where}: tensor {name!r} is {shown}, expected a float dtype "
            f"({', '.join(_dtype_name(d) for d in FLOAT_DTYPES)}): not model weights, or a relabelled file"
        )


def expected_shapes(model_args) -> dict[str, tuple]:
    """{state-dict key: shape} of the model ``model_args`` describes (built on ``meta``: no memory)."""
    from mta_repro.model import build_model

    return {k: tuple(v.shape) for k, v in build_model(model_args, device="meta").state_dict().items()}


def check_state(
    state: dict,
    want: dict[str, tuple],
    where: str,
    tied: bool = False,
    error: type = CorruptFileError,
    against: str = "its config's model",
) -> None:
    """Keys, shapes and float dtypes of ``state`` against ``want`` (``expected_shapes``);
    ``error`` (naming ``where``, the first tensor at fault and ``against``) otherwise."""
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            check_float(where, k, v.dtype)
    optional = {"output.weight"} if tied else set()
    missing = sorted(set(want) - set(state) - optional)
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. {missing[:3]})"] if missing else []
        parts += [f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"] if unexpected else []
        raise error(f"{where}: its tensors do not match {against}: {', '.join(parts)}")
    for k, shape in want.items():
        v = state.get(k)
        got = tuple(v.shape) if v is not None else None
        if got is not None and got != shape:
            raise error(f"{where}: tensor {k!r} has shape {list(got)}, expected {list(shape)} ({against})")


def check_against(state: dict, model_args, where: str, against: str = "the model") -> None:
    """``check_state`` against the model ``model_args`` describes (``ModelMismatchError``)."""
    check_state(
        state,
        expected_shapes(model_args),
        where,
        bool(getattr(model_args, "weight_tying", False)),
        ModelMismatchError,
        against,
    )


# ``${name:`` (a resolver call), as opposed to ``${a.b}`` / ``${.a}`` (a key of the same config).
_RESOLVER = re.compile(r"\$\{\s*[A-Za-z_][\w.\-]*\s*:")


def _interpolation(node: Any, path: str) -> tuple | None:
    if isinstance(node, str):
        return (path, node) if _RESOLVER.search(node) else None
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        found = _interpolation(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def check_plain_config(config: dict | None, where: str) -> None:
    """``UnsafeFileError`` if a config read from a weights file calls a resolver."""
    found = _interpolation(config, "") if config is not None else None
    if found:
        key, value = found
        raise UnsafeFileError(
            f"{where}: its config sets {key}: {value[:80]!r}, a resolver interpolation; a config read from a "
            "weights file is data and its resolvers are never run (they read this machine's environment or "
            "files): refusing it. Re-export it from a resolved config, or set the values yourself"
        )
