"""Safetensors files (Hugging Face folders), read only after their header is checked.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. A file from elsewhere can carry any
header: a length of 2^62, one past the end of the file, a dtype whose size does not match
the byte range, ranges that overlap or leave the buffer. ``read_header`` checks all of it
before any tensor is read, so such a file is one line naming it and what is wrong
(``CorruptFileError``), never a ``SafetensorError`` traceback or a read past the end.
``SafetensorsFile`` then reads the tensors (``safetensors.safe_open``, memory-mapped).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

from mta_repro.errors import CorruptFileError

# safetensors' own limit on the header (its MAX_HEADER_SIZE): a real header is kilobytes.
MAX_HEADER_BYTES = 100_000_000
# Bytes per element of every dtype the format names.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# The float dtypes model weights are stored in, and their torch names.
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype (the format's name, e.g. "BF16"), shape, byte range in the buffer."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int


def _bad(path: Path, what: str) -> CorruptFileError:
    return CorruptFileError(f"{path}: not a valid safetensors file: {what}")


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file by name, every entry checked against the file:
    a known dtype, a shape of non-negative integers, a byte range of exactly shape x dtype
    bytes inside the file, the ranges tiling the buffer without overlap (as the format
    requires). ``CorruptFileError`` naming the file and the first fault otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise _bad(path, f"header length {n} bytes is over the format's limit of {MAX_HEADER_BYTES}")
        if n > size - 8:
            raise _bad(path, f"header length {n} bytes runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the header is a JSON {type(header).__name__}, expected an object")
    buffer = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r}: expected {{dtype, shape, data_offsets}}, got {str(e)[:80]}")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise _bad(path, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _bad(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise _bad(path, f"tensor {name!r}: data_offsets {offsets!r} are not two integers")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= buffer:
            raise _bad(path, f"tensor {name!r}: bytes [{begin}, {end}) do not fit the file's {buffer}-byte buffer")
        if end - begin != numel * DTYPE_BYTES[dtype]:
            raise _bad(
                path,
                f"tensor {name!r}: {dtype} {shape} needs {numel * DTYPE_BYTES[dtype]} bytes, its "
                f"data_offsets hold {end - begin}",
            )
        out[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    at = 0
    for t in sorted(out.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != at:
            where = "overlaps the previous tensor" if t.begin < at else f"leaves a gap after byte {at}"
            raise _bad(path, f"tensor {t.name!r}: bytes [{t.begin}, {t.end}) {where}")
        at = t.end
    if at != buffer:
        raise _bad(path, f"the tensors end at byte {at} of a {buffer}-byte buffer")
    return out


class SafetensorsFile:
    """A safetensors file with a checked header (``read_header``); tensors read one at a
    time, memory-mapped (``with SafetensorsFile(path) as f: f.tensor(name)``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors = read_header(self.path)
        self._st = None

    def __enter__(self) -> SafetensorsFile:
        try:
            from safetensors import safe_open
        except ImportError:
            from mta_repro.errors import UserError

            raise UserError(
                f"{self.path}: reading safetensors needs the safetensors package: pip install -e '.[hf]'"
            ) from None
        try:
            self._cm = safe_open(str(self.path), framework="pt", device="cpu")
            self._st = self._cm.__enter__()
        except Exception as e:  # noqa: BLE001 - a file changed since its header was read
            raise _bad(self.path, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self._st is not None:
            self._cm.__exit__(*exc)
            self._st = None

    def tensor(self, name: str):
        """The named tensor (its dtype and shape as the checked header says)."""
        st = self._st
        assert st is not None, "SafetensorsFile.tensor outside its with block"
        try:
            return st.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a file cut or rewritten since its header was read raises many types
            raise _bad(self.path, f"tensor {name!r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
