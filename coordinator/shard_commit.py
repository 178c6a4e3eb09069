"""Shard 0's commit record: the last version every shard of a sharded coordinator saved.

Every shard, shard 0 included, saves a round's version before it is committed
(``coordinator.shard_plane``: the prepare step), and shard 0 commits it by writing this record
(``state_dir/committed.json``, atomically, after every shard reported its save and before any
shard announces). What a shard holds beyond the record was never announced: at its start, shard
0 reads the record and goes back to it (:func:`start_version`), and every other shard learns it
from shard 0 (:func:`coordinator.shard_plane.resume`). Every other shard writes the same record
in its own state directory when it announces a commit: at its next start it knows the hash the
sites hold its version by (its delta log's chain is checked against it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from comm.durable import atomic_write

RECORD = "committed.json"


@dataclass(frozen=True)
class Committed:
    """The last committed version, and the combined state hash of the model at it."""

    global_version: int
    state_hash: str


def write(state_dir: Path, committed: Committed) -> None:
    """Record ``committed`` durably (the commit point of its round)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    body = {"global_version": committed.global_version, "state_hash": committed.state_hash}
    atomic_write(state_dir / RECORD, json.dumps(body).encode())


def read(state_dir: Path) -> Committed | None:
    """The record, or None where none was ever written (a new federation). ValueError names a
    record that is not one (a hand-edited or foreign file: nothing is guessed)."""
    path = state_dir / RECORD
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        version, digest = doc["global_version"], doc["state_hash"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a commit record") from None
    if isinstance(version, bool) or not isinstance(version, int) or not isinstance(digest, str):
        raise ValueError(f"{path} is not a commit record")
    return Committed(version, digest)


def start_version(held: int | None, record: Committed | None) -> int | None:
    """The version shard 0 runs at its start, holding version ``held`` (None: no state yet)
    with ``record``: the held one when it is committed; the one before when shard 0 saved a
    version and stopped before committing it (a version is its round's id: rounds aborted
    since the commit took the ids between). ValueError for anything else (a state and a
    record from different histories)."""
    if record is None:
        # Nothing committed yet: θ0 (version 0), nothing, or the first round's version saved and
        # never committed (going back checks that θ0 is the checkpoint kept before it).
        return held if held is None or held <= 0 else 0
    if held == record.global_version:
        return held
    if held is not None and held > record.global_version:
        return record.global_version
    raise ValueError(
        f"shard 0 holds version {held} but committed {record.global_version}: its state and "
        "its commit record come from different histories"
    )
