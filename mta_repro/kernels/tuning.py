"""The kernels' tuning (``model.kernels``): which key-query convolution backend runs and the
tile and launch sizes of the Triton kernels. Every field is checked where it is set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

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


def _count(where: str, value, what: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1 or (what == "pow2" and not _pow2(value))
    ):
        expected = "a power of two" if what == "pow2" else "a positive integer"
        raise UserError(f"{where}: {value!r}: expected {expected} or null")


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
    # (``attention_ops.kq_conv_backend``): auto | c | triton | conv2d. ``auto``: the C
    # kernel (kq_conv_cpu) on CPU fp32/fp64, the Triton kernel (kq_conv_triton) on CUDA,
    # ATen's F.conv2d elsewhere; ``c`` is ``auto`` (the C kernel where it runs);
    # ``triton`` asks for the Triton kernel on CPU too (under TRITON_INTERPRET=1; F.conv2d
    # where triton cannot run); ``conv2d`` always F.conv2d (the self-check's
    # ``blocked+conv2d`` fallback).
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
    # The next three tune the experimental attn_impl=triton kernels
    # (mta_repro/experimental/fused_triton; geometry in its tiles.py).
    # Frame of every pass: ROWSxCOLS, powers of two >= 16, larger than the pass's halo;
    # null = tiles.frame's default (128x128 for a mixing layer's passes, 128x64 for a kq-conv
    # layer's, 256x64 for its backward_b, doubled where a halo needs it).
    triton_frame: str | None = None
    # Persistent programs of each launch: null = tiles.PROGRAMS_PER_SM per SM on a GPU, one
    # per item in the interpreter (tests set 2-3 to run a GPU's multi-item programs there).
    triton_programs: int | None = None
    # Frame rows per head-mixing slab: a power of two dividing the frame's rows; null = 4 on
    # a GPU (1 in a mixing layer's backward, 2 in a kq-conv layer's backward_dc), the whole
    # frame in the interpreter.
    triton_slab_rows: int | None = None

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
        frame = _shape("model.kernels.triton_frame", self.triton_frame, "128x64")
        _count("model.kernels.triton_programs", self.triton_programs, "positive")
        _count("model.kernels.triton_slab_rows", self.triton_slab_rows, "pow2")
        # parsed once: the compiled query block reads them as plain attributes (no string
        # parsing for Dynamo to trace)
        self._tile: tuple[int, int] = tile  # not yet sealed: __setattr__ lets it through
        self._frame: tuple[int, int] | None = frame
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name, value) -> None:
        if getattr(self, "_sealed", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} (use dataclasses.replace)")
        object.__setattr__(self, name, value)

    @property
    def kq_tile_shape(self) -> tuple[int, int]:
        """(rows, keys) of ``kq_tile``."""
        return self._tile

    @property
    def triton_frame_shape(self) -> tuple[int, int] | None:
        """(rows, cols) of ``triton_frame``, None for the default."""
        return self._frame


DEFAULT_TUNING = KernelTuning()
