"""The one place that turns bytes from disk into Python objects: nothing here runs code a
file brings along.

- ``.pt``/``.pth`` files: ``torch.load(weights_only=True)`` (tensors, containers, numbers,
  strings); a file that needs anything else is refused (``UnsafeFileError``), never loaded.
- DCP checkpoint folders (ours and Lingua's): the ``.metadata`` file is a pickle, which
  ``torch.distributed.checkpoint``'s own reader unpickles with plain ``pickle.load``, and
  non-tensor entries are read with ``torch.load(weights_only=False)``. ``SafeReader``
  unpickles the metadata with an allow-list (DCP's own metadata dataclasses, ``torch.Size``,
  dtypes, paths) and ``SafePlanner`` reads non-tensor entries with ``weights_only=True``.
- Run-state (LR scheduler, RNG, data-loader position) is written by ``encode_state`` as a
  ``torch.save`` of tensors and plain types and read back by ``decode_state`` with
  ``weights_only=True``.

A test (tests/test_weights_safety.py) fails if ``torch.load``, ``pickle.load(s)``,
``dcp.load`` or DCP's metadata reader is called anywhere else in the package.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from mta_repro.errors import CorruptFileError, UnsafeFileError

_REFUSE_HINT = "refusing to unpickle it (only tensors and plain types are read from files)"


def _unsafe_global(text: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", text)
    return m.group(1) if m else "an object that is not a tensor or a plain type"


def _refused(e: BaseException) -> bool:
    """torch's weights_only unpickler refused an object (an unsafe file), as opposed to
    failing on garbage bytes ("Unsupported operand 0": a damaged file)."""
    text = str(e)
    return "Weights only load failed" in text and bool(re.search(r"GLOBAL|[Uu]nsupported class", text))


def load_pt(path: str | Path, map_location: Any = "cpu", mmap: bool = True) -> Any:
    """The content of a ``torch.save`` file, read with ``weights_only=True``.

    ``UnsafeFileError`` for a file that would unpickle anything else, ``CorruptFileError``
    for a truncated or unreadable one; both name the file on one line."""
    path = Path(path)
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as e:  # an old-format (non-zip) file cannot be memory-mapped
            if not mmap or "mmap" not in str(e):
                raise
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if _refused(e):
            raise UnsafeFileError(
                f"{path}: not a plain weights file (it would unpickle {_unsafe_global(str(e))}); {_REFUSE_HINT}"
            ) from None
        raise CorruptFileError(
            f"{path} is unreadable (damaged pickle data); the file is truncated or corrupt"
        ) from None
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated/corrupt files raise many types
        raise CorruptFileError(f"{path} is unreadable ({_first_line(e)}); the file is truncated or corrupt") from None


def _first_line(e: BaseException) -> str:
    """``Type: first sentence`` of an error (torch's zip errors run on for lines)."""
    text = " ".join(str(e).strip().splitlines()[:1])
    text = text.split(". ")[0].rstrip(".")[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ------------------------------------------------------------------ run-state blobs
def encode_state(obj: Any) -> bytes:
    """Run-state (tensors and plain types only) as bytes for a DCP entry."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def decode_state(blob: bytes, what: str) -> Any:
    """``encode_state``'s object back, with ``weights_only=True``. ``what`` names the
    checkpoint entry in errors (run-state pickled by an older version is refused)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise CorruptFileError(f"{what}: expected a saved run-state, found {type(blob).__name__}")
    if not bytes(blob[:4]) == b"PK\x03\x04":  # a torch.save zip; older versions wrote pickle.dumps
        raise UnsafeFileError(
            f"{what}: the run-state is a raw pickle (written by an mta_repro before run-state was "
            f"stored as plain data); {_REFUSE_HINT}. Resume it with the version that wrote it, or start "
            "a new run from its weights with checkpoint.init_from"
        )
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _refused(e):
            raise UnsafeFileError(f"{what}: would unpickle {_unsafe_global(str(e))}; {_REFUSE_HINT}") from None
        raise CorruptFileError(f"{what}: cannot be read ({_first_line(e)})") from None


# ------------------------------------------------------------------ DCP
def _dcp_allowed() -> dict:
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed = {
        ("torch.distributed.checkpoint.metadata", n): getattr(md, n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(md, n)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("torch._utils", "_get_layout")] = torch.serialization._get_layout  # older pickles
    for name in dir(torch):  # dtypes, layouts and memory formats are pickled as torch.<name>
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = obj
    import collections
    import pathlib

    for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", n)] = getattr(pathlib, n)
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for obj in (set, frozenset, slice):
        allowed[("builtins", obj.__name__)] = obj
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of; anything else is refused by name."""

    allowed: dict = {}

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafeFileError(f"would unpickle {module}.{name}") from None

    def persistent_load(self, pid):
        raise UnsafeFileError("would unpickle a persistent object")


def read_dcp_metadata(path: str | os.PathLike):
    """DCP's ``Metadata`` of a checkpoint folder, unpickled with an allow-list."""
    path = Path(path)
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _dcp_allowed()
    meta_file = path / ".metadata"
    try:
        with open(meta_file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except UnsafeFileError as e:
        raise UnsafeFileError(f"{meta_file}: not a plain DCP metadata file ({e}); {_REFUSE_HINT}") from None
    # The data files it names must lie inside the folder (no absolute paths, no "..").
    for info in (getattr(meta, "storage_data", None) or {}).values():
        rel = Path(str(getattr(info, "relative_path", "")))
        if rel.is_absolute() or ".." in rel.parts:
            raise UnsafeFileError(f"{meta_file}: names a data file outside its folder ({rel}); refusing to read it")
    return meta


def _reader_class():
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader with the metadata unpickled through the allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:  # per-rank metadata files: not written by us or Lingua
                raise UnsafeFileError(f"{self.path}: per-rank DCP metadata is not supported")
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's default load planner; non-tensor entries read with ``weights_only=True``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                if not _refused(e):
                    raise  # damaged bytes: the caller names the checkpoint as unreadable
                fqn = read_item.dest_index.fqn
                raise UnsafeFileError(f"entry {fqn!r} would unpickle {_unsafe_global(str(e))}") from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import (
                    set_element,  # as DCP's own planner
                )

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner


def dcp_load(state: dict, path: str | Path, no_dist: bool = False, process_group=None) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (filled in place) from ``path``,
    with the metadata and non-tensor entries read safely. An ``UnsafeFileError`` inside
    DCP's collective machinery is raised as itself, naming the folder."""
    import torch.distributed.checkpoint.state_dict_loader as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming ... a single process": with no_dist, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(
                state,
                storage_reader=_reader_class()(str(path)),
                planner=_planner_class()(),
                no_dist=no_dist,
                process_group=process_group,
            )
    except CheckpointException as e:
        unsafe = [exc for exc in _wrapped(e) if isinstance(exc, UnsafeFileError)]
        if unsafe:
            raise UnsafeFileError(
                f"{path}: {unsafe[0]}" if str(path) not in str(unsafe[0]) else str(unsafe[0])
            ) from None
        raise


def _wrapped(e: BaseException) -> list:
    """The exceptions a DCP ``CheckpointException`` wraps (one per failing rank)."""
    out = []
    for failure in (getattr(e, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) and failure else failure  # (exception, stack)
        if isinstance(exc, BaseException):
            out.append(exc)
    return out


def dcp_error_line(e: BaseException) -> str:
    """One line for a failed DCP load: the first wrapped exception, not DCP's dump of
    every rank's traceback."""
    inner = _wrapped(e)
    return _first_line(inner[0] if inner else e)
