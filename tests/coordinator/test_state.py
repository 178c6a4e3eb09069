"""Durable state: contract suite over both stores, atomicity and retention of the file store."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.file_store import FileStateStore
from coordinator.history_log import HISTORY_FILE, VAL_LOSSES_FILE, RoundLog, read_history
from coordinator.state import GlobalState, MemoryStateStore, StateStore
from coordinator.status_board import STATUS_HISTORY_TAIL, StatusBoard

pytestmark = pytest.mark.timeout(30)


def make_state(version: int = 0) -> GlobalState:
    p = {"a": np.arange(6, dtype=np.float32).reshape(2, 3) + version, "b": np.ones(4, np.float32)}
    z = {k: np.full_like(v, 0.5) for k, v in p.items()}
    return GlobalState(
        p, z, {k: v * 0 for k, v in z.items()}, version, version, "fp", ({"round_id": 1},), {0: 5.5}
    )


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    return MemoryStateStore() if request.param == "memory" else FileStateStore(tmp_path / "state")


def test_empty_store_loads_none(store: StateStore) -> None:
    assert store.load() is None


def test_save_then_load_round_trips(store: StateStore) -> None:
    s = make_state(3)
    store.save(s)
    got = store.load()
    assert got is not None
    assert (got.global_version, got.round_counter, got.model_fingerprint) == (3, 3, "fp")
    assert got.history == s.history and got.val_losses == {0: 5.5}
    for k in s.params:
        assert got.params[k].tobytes() == s.params[k].tobytes()
        assert got.momentum[k].tobytes() == s.momentum[k].tobytes()


def test_counter_save_keeps_parameters(store: StateStore) -> None:
    s = make_state(2)
    store.save(s)
    store.save_counter(replace(s, round_counter=9, val_losses={0: 5.5, 2: 4.0}))
    got = store.load()
    assert got is not None
    assert got.round_counter == 9 and got.global_version == 2 and got.val_losses[2] == 4.0
    assert got.params["a"].tobytes() == s.params["a"].tobytes()


def test_file_store_keeps_last_n_and_leaves_no_temp_files(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path, keep=2)
    for v in range(5):
        fs.save(make_state(v))
    names = sorted(p.name for p in tmp_path.iterdir())
    # One round so far: it sits in meta.json until the next one moves it to history.jsonl.
    assert names == ["global-v00000003.npz", "global-v00000004.npz", "meta.json", VAL_LOSSES_FILE]
    got = fs.load()
    assert got is not None and got.global_version == 4


def test_file_store_never_holds_more_than_keep_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save makes room before it writes: a checkpoint is a model's worth of disk (three at
    1B parameters on four shards would be 36 GB)."""
    fs = FileStateStore(tmp_path, keep=2)
    fs.save(make_state(0))
    fs.save(make_state(1))
    seen: list[list[str]] = []
    savez = np.savez

    def watched(fh: Any, **arrays: Any) -> None:
        seen.append(sorted(p.name for p in tmp_path.glob("global-v*.npz")))
        savez(fh, **arrays)

    monkeypatch.setattr(np, "savez", watched)
    fs.save(make_state(2))
    assert seen == [["global-v00000001.npz"]]  # the newest kept while the next is written
    assert sorted(p.name for p in tmp_path.glob("global-v*.npz")) == [
        "global-v00000001.npz",
        "global-v00000002.npz",
    ]
    got = fs.load()
    assert got is not None and got.global_version == 2


def test_file_store_survives_a_crash_between_npz_and_meta(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path, keep=3)
    fs.save(make_state(1))
    # A crash after the new .npz landed but before meta.json moved: the old version is intact.
    (tmp_path / "global-v00000002.npz").write_bytes(b"partial garbage")
    got = fs.load()
    assert got is not None and got.global_version == 1


# ---- history on disk: append-only, crash-consistent, O(1) bytes per save -------------------


def _entry(round_id: int) -> dict[str, Any]:
    return {"round_id": round_id, "global_version": round_id, "train_loss": 3.0, "pad": "x" * 200}


def _grown(state: GlobalState, round_id: int) -> GlobalState:
    return replace(
        state,
        global_version=round_id,
        round_counter=round_id,
        history=(*state.history, _entry(round_id)),
        val_losses={**state.val_losses, round_id: round_id + 0.5},
    )


def test_history_and_val_losses_accumulate_across_saves(store: StateStore) -> None:
    s = replace(make_state(0), history=(), val_losses={0: 5.5})
    store.save(s)
    for r in range(1, 6):
        s = _grown(s, r)
        store.save(s)
        store.save_counter(replace(s, round_counter=r + 1))
    got = store.load()
    assert got is not None
    assert got.history == tuple(_entry(r) for r in range(1, 6))
    assert got.val_losses == s.val_losses
    assert (got.global_version, got.round_counter) == (5, 6)


def test_counter_save_appends_history_and_keeps_the_saved_version(store: StateStore) -> None:
    s = replace(make_state(1), history=(_entry(1),))
    store.save(s)
    store.save_counter(replace(s, round_counter=3, history=(_entry(1), _entry(2))))
    got = store.load()
    assert got is not None and got.global_version == 1 and got.round_counter == 3
    assert got.history == (_entry(1), _entry(2))


def test_a_history_that_does_not_extend_the_stored_one_is_refused(store: StateStore) -> None:
    s = replace(make_state(3), history=(_entry(1), _entry(2), _entry(3)))
    store.save(s)
    with pytest.raises(ValueError, match="history"):
        store.save(replace(s, history=(_entry(1), _entry(2))))
    with pytest.raises(ValueError, match="history"):
        store.save_counter(replace(s, history=(_entry(1), _entry(7), _entry(3), _entry(4))))
    got = store.load()
    assert got is not None and got.history == s.history


def test_the_last_round_amended_after_its_save_is_stored_by_the_next(store: StateStore) -> None:
    # The coordinator adds a round's broadcast figures to its entry after saving it.
    first = _entry(1)
    s = replace(make_state(1), history=(first,))
    store.save(s)
    first["broadcast_bytes"] = 528
    store.save_counter(replace(s, round_counter=2))
    got = store.load()
    assert got is not None and got.history == ({**_entry(1), "broadcast_bytes": 528},)
    second = _entry(2)
    store.save(replace(s, global_version=2, round_counter=2, history=(first, second)))
    second["broadcast_bytes"] = 600
    store.save(replace(s, global_version=3, round_counter=3, history=(first, second, _entry(3))))
    got = store.load()
    assert got is not None
    assert got.history == (first, {**_entry(2), "broadcast_bytes": 600}, _entry(3))


def test_file_store_writes_history_once_and_keeps_meta_small(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(0), history=(), val_losses={})
    fs.save(s)
    for r in range(1, 4):
        s = _grown(s, r)
        fs.save(s)
    lines = (tmp_path / HISTORY_FILE).read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [_entry(1), _entry(2)]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert "history" not in meta and "val_losses" not in meta
    assert (meta["global_version"], meta["round_counter"]) == (3, 3)
    assert meta["history_rounds"] == 3 and meta["last_round"] == _entry(3)


def _bytes_per_save(directory: Path, save: Callable[[], None]) -> tuple[int, int]:
    """Bytes one save writes: (growth of the append-only logs, meta.json rewritten whole)."""
    logs = [directory / HISTORY_FILE, directory / VAL_LOSSES_FILE]
    before = {p: p.stat().st_size if p.exists() else 0 for p in logs}
    save()
    grown = sum((p.stat().st_size if p.exists() else 0) - before[p] for p in logs)
    return grown, (directory / "meta.json").stat().st_size


def test_file_store_bytes_per_save_do_not_grow_with_history(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(0), history=(), val_losses={})
    fs.save(s)
    per_save: dict[int, list[tuple[int, int]]] = {}
    for r in range(1, 91):
        s = _grown(s, r)
        per_save[r] = [
            _bytes_per_save(tmp_path, partial(fs.save, s)),
            _bytes_per_save(tmp_path, partial(fs.save_counter, replace(s, round_counter=r + 1))),
        ]
    # Rounds 20 and 90 (appending 19 and 89) have ids and losses of one width: the figures
    # match to the byte.
    early, late = per_save[20], per_save[90]
    assert late == early, (early, late)
    assert late[1][0] == 0, "a counter save with nothing new appends nothing"
    assert 0 < late[0][0] < 400 and late[0][1] < 1000, late
    got = FileStateStore(tmp_path).load()
    assert got is not None and len(got.history) == 90 and len(got.val_losses) == 90


def test_file_store_tolerates_a_torn_last_history_line(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(1), history=(_entry(1),), val_losses={0: 5.5})
    fs.save(s)
    # A crash while appending round 2's line: half a line, no newline, meta.json never moved.
    with open(tmp_path / HISTORY_FILE, "ab") as fh:
        fh.write(b'{"round_id": 2, "glob')
    with open(tmp_path / VAL_LOSSES_FILE, "ab") as fh:
        fh.write(b'{"global_ver')
    fresh = FileStateStore(tmp_path)
    got = fresh.load()
    assert got is not None and got.history == (_entry(1),) and got.val_losses == {0: 5.5}
    assert read_history(tmp_path).history == (_entry(1),)
    # The next save cuts the torn tail off before appending.
    fresh.save(_grown(got, 2))
    again = FileStateStore(tmp_path).load()
    assert again is not None and again.history == (_entry(1), _entry(2))
    assert again.val_losses == {0: 5.5, 2: 2.5}
    for name in (HISTORY_FILE, VAL_LOSSES_FILE):
        for line in (tmp_path / name).read_bytes().splitlines():
            json.loads(line)


def test_file_store_recovers_from_history_ahead_of_meta(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(2), history=(_entry(1), _entry(2)))
    fs.save(s)
    # A crash after round 2's line was fsynced (round 3 being saved) but before meta.json
    # pointed past it.
    with open(tmp_path / HISTORY_FILE, "ab") as fh:
        fh.write(json.dumps(_entry(2)).encode() + b"\n")
    fresh = FileStateStore(tmp_path)
    got = fresh.load()
    assert got is not None and got.global_version == 2 and got.history == (_entry(1), _entry(2))
    assert read_history(tmp_path).history == (_entry(1), _entry(2))
    # Round 2 was amended and round 3 redone differently after the restart.
    amended, redo = {**_entry(2), "broadcast_bytes": 9}, {**_entry(3), "train_loss": 2.5}
    fresh.save(replace(got, global_version=3, round_counter=3, history=(_entry(1), amended, redo)))
    again = FileStateStore(tmp_path).load()
    assert again is not None and again.history == (_entry(1), amended, redo)
    lines = (tmp_path / HISTORY_FILE).read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [_entry(1), amended]


def test_file_store_refuses_a_history_shorter_than_meta_says(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    fs.save(replace(make_state(3), history=(_entry(1), _entry(2), _entry(3))))
    lines = (tmp_path / HISTORY_FILE).read_bytes().splitlines(keepends=True)
    (tmp_path / HISTORY_FILE).write_bytes(lines[0])
    with pytest.raises(ValueError, match="history.jsonl"):
        FileStateStore(tmp_path).load()


def test_file_store_migrates_an_old_meta_with_history_inside(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(2), history=(_entry(1), _entry(2)), val_losses={0: 5.5, 2: 4.5})
    fs.save(s)
    # The previous layout: history and val_losses inside meta.json, no .jsonl files.
    meta = json.loads((tmp_path / "meta.json").read_text())
    old = {k: meta[k] for k in ("file", "global_version", "round_counter", "model_fingerprint")}
    old["history"] = [_entry(1), _entry(2)]
    old["val_losses"] = {"0": 5.5, "2": 4.5}
    (tmp_path / "meta.json").write_text(json.dumps(old, indent=1))
    (tmp_path / HISTORY_FILE).unlink()
    (tmp_path / VAL_LOSSES_FILE).unlink()
    assert read_history(tmp_path) == RoundLog((_entry(1), _entry(2)), {0: 5.5, 2: 4.5})
    migrated = FileStateStore(tmp_path)
    got = migrated.load()
    assert got is not None and got.history == s.history and got.val_losses == s.val_losses
    assert "history" not in json.loads((tmp_path / "meta.json").read_text())
    migrated.save(_grown(got, 3))
    again = FileStateStore(tmp_path).load()
    assert again is not None and again.history == (_entry(1), _entry(2), _entry(3))
    assert read_history(tmp_path).val_losses == {0: 5.5, 2: 4.5, 3: 3.5}


def test_read_history_of_an_empty_dir_is_empty(tmp_path: Path) -> None:
    assert read_history(tmp_path / "nothing") == RoundLog((), {})


def test_read_history_ignores_lines_meta_does_not_vouch_for(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path)
    s = replace(make_state(2), history=(_entry(1), _entry(2)), val_losses={0: 5.5, 1: 4.0})
    fs.save(s)
    with open(tmp_path / HISTORY_FILE, "ab") as fh:
        fh.write(json.dumps(_entry(2)).encode() + b"\n" + b'{"round')
    assert read_history(tmp_path) == RoundLog((_entry(1), _entry(2)), {0: 5.5, 1: 4.0})


# ---- status.json: counters and the last rounds, not the whole history ----------------------


def test_status_board_file_keeps_the_last_rounds_and_the_count(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    board = StatusBoard(path, lambda: 0.0)
    sizes = {}
    history: list[dict[str, Any]] = []
    for r in range(1, 101):
        history.append(_entry(r))
        board.publish({"rounds_completed": r, "history": list(history), "global_version": r})
        sizes[r] = path.stat().st_size
    status = json.loads(path.read_text())
    assert status["history"] == [_entry(r) for r in range(81, 101)]
    assert status["history_count"] == 100 and status["rounds_completed"] == 100
    assert len(status["history"]) == STATUS_HISTORY_TAIL
    assert board.get()["history"] == status["history"]
    assert sizes[100] <= sizes[30] + 16, sizes  # bounded, not growing with the run
    # Early on, everything fits.
    small = StatusBoard(None, lambda: 0.0)
    small.publish({"history": [_entry(1)]})
    assert small.get() == {"history": [_entry(1)], "history_count": 1}
    # A caller that builds only the tail itself gives the count.
    small.publish({"history": [_entry(r) for r in range(90, 101)], "history_count": 100})
    assert small.get()["history_count"] == 100 and len(small.get()["history"]) == 11


def test_status_board_can_bound_val_losses_too(tmp_path: Path) -> None:
    board = StatusBoard(tmp_path / "status.json", lambda: 0.0, val_losses_tail=3)
    board.publish({"val_losses": {str(v): 1.0 / (v + 1) for v in range(12)}})
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["val_losses"] == {"9": 0.1, "10": 1 / 11, "11": 1 / 12}
    assert status["val_losses_count"] == 12
    unbounded = StatusBoard(None, lambda: 0.0)
    unbounded.publish({"val_losses": {"0": 1.0, "1": 0.5}})
    assert unbounded.get()["val_losses"] == {"0": 1.0, "1": 0.5}


def test_file_store_logs_are_private_as_its_state_files(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        fs = FileStateStore(tmp_path)
        s = replace(make_state(0), history=(), val_losses={})
        fs.save(s)
        for r in range(1, 3):
            s = _grown(s, r)
            fs.save(s)
        # A log an older version created 0644 is made private at its next append.
        os.chmod(tmp_path / VAL_LOSSES_FILE, 0o644)
        fs.save(_grown(s, 3))
    finally:
        os.umask(old)
    for name in (HISTORY_FILE, VAL_LOSSES_FILE, "meta.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name


def test_a_signed_checkpoint_is_signed_over_its_bytes_and_checked_at_load(tmp_path: Path) -> None:
    # The file is hashed piecewise; the signature is the one over its bytes as a whole.
    from comm.security.signing import generate_signing_key, verify_blob

    key = generate_signing_key()
    fs = FileStateStore(tmp_path, signing_key=key)
    fs.save(make_state(1))
    npz = tmp_path / "global-v00000001.npz"
    verify_blob(key.public_key(), npz.read_bytes(), (tmp_path / (npz.name + ".sig")).read_bytes())
    got = FileStateStore(tmp_path, signing_key=key).load()
    assert got is not None and got.params["a"].tobytes() == make_state(1).params["a"].tobytes()
    data = bytearray(npz.read_bytes())
    data[-40] ^= 1
    npz.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="failed its signature check"):
        FileStateStore(tmp_path, signing_key=key).load()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_store_goes_back_to_the_version_before_its_newest(kind: str, tmp_path: Path) -> None:
    """A shard saved a version never committed: the store's previous version is the stored
    one again (its round dropped, the round counter kept), and the next save extends it; a file
    store reopened reads the same."""
    store: Any = MemoryStateStore() if kind == "memory" else FileStateStore(tmp_path / "state")

    def state(version: int, rounds: tuple[int, ...], counter: int) -> GlobalState:
        history = tuple({"round_id": r, "global_version": r} for r in rounds)
        return replace(make_state(version), history=history, round_counter=counter)

    store.save(state(0, (), 0))
    store.save(state(1, (1,), 1))
    store.save(state(2, (1, 2), 2))
    store.save_counter(state(2, (1, 2), 3))
    store.roll_back(1)
    got = store.load()
    assert got is not None and got.global_version == 1 and got.round_counter == 3
    assert [h["round_id"] for h in got.history] == [1]
    np.testing.assert_array_equal(got.params["a"], make_state(1).params["a"])
    with pytest.raises(ValueError):
        store.roll_back(0)  # one version back at most
    store.save(state(4, (1, 4), 4))
    reread = FileStateStore(tmp_path / "state") if kind == "file" else store
    got = reread.load()
    assert got is not None and got.global_version == 4
    assert [h["round_id"] for h in got.history] == [1, 4]
    if kind == "file":
        assert not (tmp_path / "state" / "global-v00000002.npz").exists()
