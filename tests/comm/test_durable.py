"""comm.durable.atomic_write: whole or nothing, exact mode, never overwriting unless asked."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

import pytest

from comm.durable import atomic_write

pytestmark = pytest.mark.timeout(30)


def test_replaces_with_the_exact_mode_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(b"old")
    old_umask = os.umask(0o077)
    try:
        atomic_write(path, b"new", mode=0o644)
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def write(fh: IO[bytes]) -> None:
        fh.write(b"half")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(path, write)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_without_replace_an_existing_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "ca.key"
    atomic_write(path, b"first", replace=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", replace=False)
    assert path.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.key"]
