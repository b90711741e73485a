"""Writes that survive a kill or a power loss: fsync of files and folders, and a file
replaced whole through a temporary file and a rename.

A rename is atomic against a kill, but after a power loss only what was fsynced is
there: the data of a file before the rename that publishes it, the folder after it (its
entries are the folder's data)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder. A folder that cannot be opened or synced (some platforms
    and filesystems) is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # a folder on some filesystems
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folder."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(folder)


def replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``<path>.tmp`` (flushed, fsynced, its mode copied
    from the old file), a rename and an fsync of the folder: a kill at any moment leaves
    the old bytes or the new ones, never a part (a temp file an earlier kill left is
    overwritten)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        except OSError:
            pass
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
