"""Reading a corpus file's bytes: lines of a .jsonl or .jsonl.zst file from an offset of
its decompressed text, every byte handed out hashed.

A file is reopened at a saved offset by reading its text up to it, which also recomputes
the sha256 of those bytes, so a stream's state can say what the run read of each file
(``mta_repro/data/loader.py`` records and checks it; docs/provenance.md). A truncated
.zst raises ``CorruptFileError`` instead of ending in silence. A record longer than
``data.max_record_bytes`` is read past, never held whole (an ``OversizeRecord``).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from mta_repro.errors import CorruptFileError

# data.max_record_bytes' default (mta_repro/data/args.py says why this size).
MAX_RECORD_BYTES = 16 << 20
# Compressed bytes fed to the zstd decompressor at a time: a zstd block of one repeated byte
# expands ~32,000x, so 512 bytes make at most ~16 MiB (measured: a 400 MB record of one
# byte, 12 KB compressed, comes out in pieces of 16 MiB); as fast as 1 MiB feeds on text.
_ZSTD_FEED = 512


class _CheckedZstd(io.RawIOBase):
    """The decompressed bytes of a .zst file (any number of frames), raising
    CorruptFileError when the file ends inside a frame: a truncated download, which
    ``zstandard``'s stream reader would end in silence."""

    def __init__(self, raw, path: Path) -> None:
        import zstandard

        self._zstd = zstandard
        self.raw, self.path = raw, path
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._out: list = []  # decompressed pieces not yet read, each held once (no copy into a buffer)
        self._pos = 0  # read position in self._out[0]
        self._in_frame = False
        self._eof = False
        self._pending = memoryview(b"")  # compressed bytes read and not yet fed

    def readable(self) -> bool:
        return True

    def _feed(self, data: bytes) -> None:
        while data:
            try:
                out = self._d.decompress(data)
            except self._zstd.ZstdError as e:
                raise CorruptFileError(f"{self.path}: not a valid zstd stream ({e})") from e
            if out:
                self._out.append(out)
            if self._d.eof:
                data = self._d.unused_data
                self._d = self._zstd.ZstdDecompressor().decompressobj()
                self._in_frame = False
            else:
                self._in_frame = True
                data = b""

    def readinto(self, b) -> int:
        while not self._out and not self._eof:
            if not self._pending:
                chunk = self.raw.read(1 << 20)
                if not chunk:
                    self._eof = True
                    if self._in_frame:
                        raise CorruptFileError(f"{self.path}: truncated (the file ends inside a zstd frame)")
                    break
                self._pending = memoryview(chunk)
            self._feed(bytes(self._pending[:_ZSTD_FEED]))
            self._pending = self._pending[_ZSTD_FEED:]
        if not self._out:
            return 0
        piece = self._out[0]
        n = min(len(b), len(piece) - self._pos)
        b[:n] = memoryview(piece)[self._pos : self._pos + n]
        self._pos += n
        if self._pos == len(piece):
            self._out.pop(0)
            self._pos = 0
        return n


class ShortFileError(EOFError):
    """A file that ends before the offset a stream saved in it (it changed since)."""


class OversizeRecord(bytes):
    """What ``LineReader.readline`` gives for a line over the record limit: not its bytes
    but a stand-in whose ``len()`` is the line's length in the file (so byte offsets stay
    right) and which ``parse_line`` counts as a bad record ("oversize")."""

    size: int

    def __new__(cls, size: int) -> OversizeRecord:
        obj = super().__new__(cls, b"{}\n")
        obj.size = size
        return obj

    def __len__(self) -> int:
        return self.size


class LineReader:
    """Lines of a .jsonl or .jsonl.zst file from a byte offset of the decompressed text,
    hashing every byte of text it reads: ``digest()`` is the sha256 of the first ``pos``
    bytes (the skipped prefix included), ``size``/``mtime_ns`` the file's stat when opened.

    A file shorter than ``offset`` raises ShortFileError; a truncated or corrupt .zst raises
    CorruptFileError (naming the file) when the reading gets to the damage. A line of more
    than ``max_bytes`` (its newline aside) is read past in 1 MiB pieces (hashed, never held
    whole) and returned as an ``OversizeRecord``; with the decompressor fed in small pieces,
    a record holds at most about twice the limit plus 16 MiB, however well it compresses."""

    def __init__(self, path: Path, offset: int, max_bytes: int = MAX_RECORD_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.raw = open(path, "rb")  # noqa: SIM115 - held by the reader, closed by close()
        self.f = self.raw
        st = os.fstat(self.raw.fileno())
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.hash = hashlib.sha256()
        self.pos = 0
        try:
            if path.name.endswith(".zst"):
                self.f = io.BufferedReader(_CheckedZstd(self.raw, path), buffer_size=1 << 20)
            left = offset
            # Read and drop (no random access in a zstd frame), hashing what the run read before.
            while left > 0:
                chunk = self.f.read(min(left, 1 << 24))
                if not chunk:
                    raise ShortFileError(f"{path}: shorter than the saved offset {offset}")
                self.hash.update(chunk)
                left -= len(chunk)
        except BaseException:
            self.close()
            raise
        self.pos = offset

    def readline(self) -> bytes:
        line = self.f.readline(self.max_bytes + 1)
        self.hash.update(line)
        self.pos += len(line)
        if len(line) <= self.max_bytes or line.endswith(b"\n"):
            return line
        size = len(line)
        del line
        while True:  # the rest of the record, hashed, never held whole
            part = self.f.readline(1 << 20)
            self.hash.update(part)
            self.pos += len(part)
            size += len(part)
            if not part or part.endswith(b"\n"):
                return OversizeRecord(size)

    def digest(self) -> str:
        return self.hash.hexdigest()

    def close(self) -> None:
        self.f.close()
        self.raw.close()


def text_digest(path: Path, nbytes: int) -> tuple[str, int, int]:
    """(sha256 of the first ``nbytes`` bytes of the file's text, size, mtime_ns); raises
    FileNotFoundError, ShortFileError or CorruptFileError."""
    r = LineReader(path, nbytes)
    try:
        return r.digest(), r.size, r.mtime_ns
    finally:
        r.close()
