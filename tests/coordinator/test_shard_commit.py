"""Shard 0's commit record: written atomically, read back, and the version shard 0 starts at
beside what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.shard_commit import RECORD, Committed, read, start_version, write

pytestmark = pytest.mark.timeout(30)


def test_a_record_reads_back_and_a_new_state_dir_has_none(tmp_path: Path) -> None:
    assert read(tmp_path) is None
    write(tmp_path / "shard-0", Committed(7, "ab" * 16))
    assert read(tmp_path / "shard-0") == Committed(7, "ab" * 16)
    write(tmp_path / "shard-0", Committed(8, "cd" * 16))
    assert read(tmp_path / "shard-0") == Committed(8, "cd" * 16)
    assert [p.name for p in (tmp_path / "shard-0").iterdir()] == [RECORD], "no temp file left"


@pytest.mark.parametrize("body", ["{", "[]", '{"global_version": "7", "state_hash": "x"}', "{}"])
def test_a_file_that_is_not_a_record_is_refused(tmp_path: Path, body: str) -> None:
    (tmp_path / RECORD).write_text(body)
    with pytest.raises(ValueError, match="is not a commit record"):
        read(tmp_path)


def test_shard_zero_starts_at_the_committed_version() -> None:
    record = Committed(7, "h")
    assert start_version(7, record) == 7
    assert start_version(8, record) == 7, "saved, never committed: one back"
    # Rounds 8 and 9 aborted, round 10 saved and never committed: its id is its version.
    assert start_version(10, record) == 7
    assert start_version(None, None) is None and start_version(0, None) == 0
    for held in (0, 6):
        with pytest.raises(ValueError, match="different histories"):
            start_version(held, record)
    assert start_version(3, None) == 0, "the first round saved, never committed: back to θ0"
