"""Triton's interpreter (``TRITON_INTERPRET=1``: the kernels on CPU tensors, for tests) made
to run our kernels under every Triton we support (3.6 to 3.9).

The interpreter holds a scalar as a one-element numpy array, and Triton 3.6 turns it into
a loop bound (``range(r_first, R, BR)`` with a computed ``r_first``) with ``int(array)``,
which numpy 2.4 refuses for an array that is not 0-d ("only 0-dimensional arrays can be
converted to Python scalars"); Triton 3.9 squeezes it first. ``install()`` gives 3.6 the
3.9 conversion. Only the interpreter is touched: a compiled kernel never sees it."""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (read when kernels are defined, as Triton does)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _index(self) -> int:
    return int(self.handle.data.squeeze())


def install() -> None:
    """Patch the interpreter's tensor-to-index conversion (idempotent; a no-op when not
    interpreting or where the interpreter has no such hook)."""
    if not interpreting():
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_mta_repro_index", False):
        return

    @functools.wraps(patch)
    def patched(tensor, scope, *args, **kwargs):
        out = patch(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest after the run
        return out

    patched._mta_repro_index = True  # pyright: ignore[reportAttributeAccessIssue]  # marker on a function
    interpreter._patch_lang_tensor = patched
