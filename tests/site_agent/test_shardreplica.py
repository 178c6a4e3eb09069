"""A sharded site's checkpoint directories (site_agent.shardreplica): a save never writes into
the directory ``checkpoint.json`` names, a restart at the same version included, and the older
directories go only once the new one is named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from site_agent.metrics import SiteMetrics
from site_agent.rounds import SiteRounds
from site_agent.shardreplica import ShardedReplica

pytestmark = pytest.mark.timeout(30)


class _Sync:
    """The ranks' side as the replica sees it: a save writes one file into its directory and
    records what the named directory held while it wrote."""

    def __init__(self, state_path: Path) -> None:
        self.state_path = state_path
        self.saves: list[dict[str, Any]] = []

    def spec(self) -> dict[str, tuple[int, ...]]:
        return {"w": (2, 2)}

    def state_hash(self) -> str:
        return "h" * 32

    def load(self, path: str) -> None:
        assert (Path(path) / "shard.bin").is_file()

    def save(self, path: str) -> None:
        meta = self.state_path / "checkpoint.json"
        named = json.loads(meta.read_text())["dir"] if meta.exists() else None
        held = (self.state_path / named / "shard.bin").read_text() if named else None
        self.saves.append({"path": Path(path).name, "named": named, "named_held": held})
        Path(path).mkdir(parents=True)
        (Path(path) / "shard.bin").write_text(Path(path).name)


def _replica(state_path: Path, sync: _Sync) -> ShardedReplica:
    return ShardedReplica(
        site_id="s",
        sync=sync,  # type: ignore[arg-type]
        rounds=SiteRounds(),
        state_path=state_path,
        metrics=SiteMetrics("s"),
    )


def _named(state_path: Path) -> str:
    return str(json.loads((state_path / "checkpoint.json").read_text())["dir"])


def test_a_restart_at_the_same_version_saves_beside_the_named_checkpoint(tmp_path: Path) -> None:
    first = _Sync(tmp_path)
    replica = _replica(tmp_path, first)
    replica.adopt(3)
    replica.save_checkpoint()
    assert _named(tmp_path) == "checkpoint-v3-1"
    # A leftover of a save that stopped part way, not named: never written into either.
    (tmp_path / "checkpoint-v3-2").mkdir()

    # The process restarts at the same version: its count of saves starts again.
    again = _Sync(tmp_path)
    restarted = _replica(tmp_path, again)
    restarted.load_checkpoint()
    assert restarted.global_version == 3
    restarted.save_checkpoint()

    (save,) = again.saves
    assert save["named"] == "checkpoint-v3-1"
    assert save["path"] not in ("checkpoint-v3-1", "checkpoint-v3-2")
    # While the new directory was written, the named one held its checkpoint, untouched.
    assert save["named_held"] == "checkpoint-v3-1"
    assert _named(tmp_path) == save["path"]
    # Once the new one is named, the older directories go.
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == [save["path"]]
    assert (tmp_path / save["path"] / "shard.bin").read_text() == save["path"]
