"""Crash-safe file writes, the one way both roles and the key tools write a durable file.

:func:`atomic_write` writes to a temporary file in the target's directory, fsyncs it, moves it
into place (``os.replace``, or a hard link when an existing file must not be overwritten) and
fsyncs the directory, so after a crash the path holds either the old content or the new, never
a part. :func:`fsync_dir` makes a directory entry (a new or renamed file) durable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

PRIVATE_MODE = 0o600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], object] | bytes,
    *,
    mode: int = PRIVATE_MODE,
    replace: bool = True,
) -> None:
    """Write ``path`` whole or not at all: ``write(fileobj)`` (or the bytes given) goes to a
    temporary file created with ``mode``, which is fsynced and moved into place, then the
    directory is fsynced. With ``replace=False`` an existing ``path`` is never overwritten:
    ``FileExistsError`` is raised and nothing changes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # exact, whatever the umask
        with os.fdopen(fd, "wb") as fh:
            if isinstance(write, bytes | bytearray | memoryview):
                fh.write(write)
            else:
                write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic, and refuses an existing path
            os.unlink(tmp)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
