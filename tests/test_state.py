"""Durable state: contract suite over both stores, atomicity and retention of the file store."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coordinator.state import FileStateStore, GlobalState, MemoryStateStore, StateStore

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
    assert names == ["global-v00000003.npz", "global-v00000004.npz", "meta.json"]
    got = fs.load()
    assert got is not None and got.global_version == 4


def test_file_store_survives_a_crash_between_npz_and_meta(tmp_path: Path) -> None:
    fs = FileStateStore(tmp_path, keep=3)
    fs.save(make_state(1))
    # A crash after the new .npz landed but before meta.json moved: the old version is intact.
    (tmp_path / "global-v00000002.npz").write_bytes(b"partial garbage")
    got = fs.load()
    assert got is not None and got.global_version == 1
