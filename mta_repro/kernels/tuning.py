"""The kernels' tuning (``model.kernels``): which key-query convolution backend runs, the tile
of its Triton kernel, and the options of a registered attention implementation, kept for it
unread. Every field is checked where it is set (an implementation's options by it)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mta_repro.errors import UserError

KQ_CONV_CHOICES = ("auto", "c", "triton", "conv2d")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _shape(where: str, spec: str | None, example: str) -> tuple[int, int] | None:
    """``"RxC"`` -> (R, C), powers of two >= 16 (None stays None)."""
    if spec is None:
        return None
    try:
        r, c = (int(v) for v in str(spec).lower().split("x"))
    except ValueError:
        raise UserError(f"{where}: {spec!r}: expected ROWSxCOLS, e.g. {example}") from None
    if r < 16 or c < 16 or not _pow2(r) or not _pow2(c):
        raise UserError(f"{where}: {spec!r}: both sizes must be powers of two, at least 16 (e.g. {example})")
    return r, c


def _impl_options(value) -> dict[str, dict[str, Any]]:
    """``model.kernels.impl_options`` as plain nested dicts (a copy), or one line saying its
    shape: {implementation name: {option: value}}."""
    where = "model.kernels.impl_options"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: {value!r}: expected a mapping {{implementation: {{option: value}}}}")
    out = {}
    for name, opts in value.items():
        if not isinstance(name, str) or not (opts is None or isinstance(opts, Mapping)):
            raise UserError(
                f"{where}.{name}: {opts!r}: expected the options of implementation {name!r} as a mapping "
                "{option: value}"
            )
        out[name] = {str(k): copy.deepcopy(v) for k, v in (opts or {}).items()}
    return out


@dataclass(unsafe_hash=True)
class KernelTuning:
    """How the attention kernels compute (config section ``model.kernels``), never what.

    Every choice here gives the same numbers within float tolerance (another summation
    order, another tile), so a run dir may continue under another tuning (``RUN_DIR =
    "free"``) and a checkpoint does not depend on it. The defaults are what runs without a
    setting. Carried to the kernels per model (``Attention.kernels`` ->
    ``ExplicitAttnParams.tuning``), so two models in one process tune independently.
    Immutable after construction (``dataclasses.replace`` for a variant): a plain
    ``frozen=True`` would make OmegaConf's node read-only and refuse command-line overrides.
    """

    RUN_DIR: ClassVar[str] = "free"

    # The kernel of the ``blocked`` path's key-query convolutions
    # (``attention_blocked.kq_conv_backend``): auto | c | triton | conv2d. ``auto``: the C
    # kernel (kq_conv_cpu) on CPU fp32/fp64, the Triton kernel (kq_conv_triton) on CUDA,
    # ATen's F.conv2d elsewhere; ``c`` is ``auto`` (the C kernel where it runs);
    # ``triton`` asks for the Triton kernel on CPU too (under TRITON_INTERPRET=1; F.conv2d
    # where triton cannot run); ``conv2d`` always F.conv2d (what ``attn_impl=blocked+conv2d``
    # runs whatever this says).
    kq_conv: str = "auto"
    # Run ``blocked``'s query block through torch.compile: null = on CUDA only (eager is
    # launch-bound there; on CPU the C kernel dominates and a compile costs tens of seconds),
    # true / false force it on / off.
    compile_block: bool | None = None
    # The torch.compile backend of that block: inductor, or a debugging one (aot_eager).
    compile_block_backend: str = "inductor"
    # Output tile (rows x keys) of the Triton key-query convolution: ROWSxCOLS, powers of two
    # >= 16. 64x64: a c_k <= 65 kernel's key window is then 128 wide and a program fits in
    # registers at 8 warps (kq_conv_triton.tiles; tests use 16x16 to cross tile borders).
    kq_tile: str = "64x64"
    # Options of attention implementations registered outside the core, by their name in the
    # registry (``model.attn_impl``): {name: {option: value}}. The core hands them to the
    # kernels (``ExplicitAttnParams.tuning``) without reading them; the implementation of that
    # name checks its own (``AttnImpl.options``) when the model's args are validated. Plain
    # containers (configs, checkpoints and run-dir checks serialise them), copied here and
    # not to be written to; left out of the hash (equality still compares them).
    impl_options: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kq_conv not in KQ_CONV_CHOICES:
            raise UserError(f"model.kernels.kq_conv: {self.kq_conv!r}: expected auto, c, triton or conv2d")
        if self.compile_block is not None and not isinstance(self.compile_block, bool):
            raise UserError(f"model.kernels.compile_block: {self.compile_block!r}: expected true, false or null")
        if not isinstance(self.compile_block_backend, str) or not self.compile_block_backend:
            raise UserError(
                f"model.kernels.compile_block_backend: {self.compile_block_backend!r}: expected the "
                "name of a torch.compile backend (inductor, aot_eager, ...)"
            )
        tile = _shape("model.kernels.kq_tile", self.kq_tile, "64x64")
        if tile is None:
            raise UserError("model.kernels.kq_tile: expected ROWSxCOLS, e.g. 64x64")
        options = _impl_options(self.impl_options)
        # parsed once: the compiled query block reads it as a plain attribute (no string
        # parsing for Dynamo to trace)
        self._tile: tuple[int, int] = tile  # not yet sealed: __setattr__ lets it through
        self.impl_options = options
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name, value) -> None:
        if getattr(self, "_sealed", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} (use dataclasses.replace)")
        object.__setattr__(self, name, value)

    @property
    def kq_tile_shape(self) -> tuple[int, int]:
        """(rows, keys) of ``kq_tile``."""
        return self._tile


DEFAULT_TUNING = KernelTuning()
