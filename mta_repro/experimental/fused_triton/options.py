"""``TritonOptions``: this experiment's own tuning, the config mapping
``model.kernels.impl_options.triton`` (the core keeps it for us unread; ``IMPL.options``
checks it when the model's args are validated, ``of`` reads it where the kernels run).

Each option only changes how the kernels compute (tiles, launch sizes), never what, so a run
dir may continue under other values (the core's ``KernelTuning.RUN_DIR = "free"``). Defaults
are the kernels' own (``tiles.frame``, ``launch.programs``, ``launch.slab_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mta_repro.dataclass_config import nearest_field
from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning

# The name the entry point registers this implementation under (pyproject.toml), and so the
# key of its options in ``model.kernels.impl_options``.
NAME = "triton"
WHERE = f"model.kernels.impl_options.{NAME}"


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class TritonOptions:
    """The experimental ``attn_impl=triton`` kernels' tuning; every field checked on construction
    (``where``: the config path its errors name)."""

    # Frame of every pass: ROWSxCOLS, powers of two >= 16, larger than the pass's halo;
    # null = tiles.frame's default (128x128 for a mixing layer's passes, 128x64 for a kq-conv
    # layer's, 256x64 for its backward_b, doubled where a halo needs it).
    frame: str | None = None
    # Persistent programs of each launch: null = tiles.PROGRAMS_PER_SM per SM on a GPU, one
    # per item in the interpreter (tests set 2-3 to run a GPU's multi-item programs there).
    programs: int | None = None
    # Frame rows per head-mixing slab: a power of two dividing the frame's rows; null = 4 on
    # a GPU (1 in a mixing layer's backward, 2 in a kq-conv layer's backward_dc), the whole
    # frame in the interpreter.
    slab_rows: int | None = None
    where: str = dataclasses.field(default=WHERE, compare=False, repr=False)

    def __post_init__(self) -> None:
        shape = None
        if self.frame is not None:
            example, what = "128x64", f"{self.where}.frame: {self.frame!r}"
            try:
                r, c = (int(v) for v in str(self.frame).lower().split("x"))
            except ValueError:
                raise UserError(f"{what}: expected ROWSxCOLS, e.g. {example}") from None
            if r < 16 or c < 16 or not _pow2(r) or not _pow2(c):
                raise UserError(f"{what}: both sizes must be powers of two, at least 16 (e.g. {example})")
            shape = (r, c)
        for name, what in (("programs", "positive"), ("slab_rows", "pow2")):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < 1
                or (what == "pow2" and not _pow2(value))
            ):
                expected = "a power of two" if what == "pow2" else "a positive integer"
                raise UserError(f"{self.where}.{name}: {value!r}: expected {expected} or null")
        object.__setattr__(self, "_frame", shape)

    @property
    def frame_shape(self) -> tuple[int, int] | None:
        """(rows, cols) of ``frame``, None for the default."""
        return self._frame  # type: ignore[attr-defined]


FIELDS = tuple(f.name for f in dataclasses.fields(TritonOptions) if f.name != "where")


def parse(options: Mapping[str, Any] | None, where: str = WHERE) -> TritonOptions:
    """``options`` (the mapping at config path ``where``) as ``TritonOptions``; one line naming
    the field and the implementation where a key is unknown or a value wrong. ``IMPL.options``."""
    options = dict(options or {})
    for key in options:
        if key not in FIELDS:
            close = nearest_field(str(key), list(FIELDS))
            hint = f" (did you mean {close}?)" if close else ""
            raise UserError(
                f"{where}.{key}: no option of attention implementation {NAME!r}{hint}; its options: {', '.join(FIELDS)}"
            )
    return TritonOptions(**options, where=where)


@functools.lru_cache(maxsize=64)
def of(tuning: KernelTuning) -> TritonOptions:
    """The options a model's ``tuning`` (``model.kernels``, ``ExplicitAttnParams.tuning``) holds
    for these kernels, checked (cached per tuning: read on every launch)."""
    return parse(tuning.impl_options.get(NAME))


def kernel_tuning(base: KernelTuning | None = None, **options: Any) -> KernelTuning:
    """``base`` (default: the defaults) with these kernels' ``options`` set, checked; for tests
    and scripts that build a tuning by hand."""
    parse(options)
    base = base or KernelTuning()
    return dataclasses.replace(base, impl_options={**base.impl_options, NAME: options})
