"""Figures of ``crossdc bench chaos`` for a coordinator of several shards, per shard and
combined, from what the run left: each shard's durable state and log, shard 0's commit record
and the sites' checkpoints.

A shard's final state is the one it resumes at: a version it saved and shard 0 never committed
is one it goes back from at its next start (``coordinator.shard_commit``), so it is read as
the version before (a copy of its directory goes back, the run's own is left as it is).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from comm.wire.tensors import state_hash
from coordinator import shard_commit
from coordinator.file_store import FileStateStore
from coordinator.state import GlobalState
from crossdc.bench import chaos_analysis as an


def resumed_state(state_dir: Path, committed: int) -> GlobalState | None:
    """The state the shard in ``state_dir`` runs at its next start, shard 0 having committed
    version ``committed``."""
    state = FileStateStore(state_dir).load()
    if state is None or state.global_version != committed + 1:
        return state
    with tempfile.TemporaryDirectory(prefix="chaos-shard-") as tmp:
        copy = Path(tmp) / "state"
        shutil.copytree(state_dir, copy)
        store = FileStateStore(copy)
        store.load()
        store.roll_back(committed)
        return FileStateStore(copy).load()


def shard_figures(
    shard_dirs: list[Path], logs: list[str], site_dirs: dict[str, Path]
) -> dict[str, Any]:
    """Per shard: its final version, rounds it closed (announced) and does not hold, its part's
    hash and whether every site holds that part; combined: shard 0's commit record, whether
    every shard is at it, whether the whole model (every shard's part) hashes to the record's
    hash and every site holds it at that version."""
    record = shard_commit.read(shard_dirs[0])
    committed = record.global_version if record is not None else 0
    sites = {s: an.site_params(d) for s, d in site_dirs.items()}
    whole: dict[str, np.ndarray] = {}
    shards: list[dict[str, Any]] = []
    for i, (state_dir, text) in enumerate(zip(shard_dirs, logs, strict=True)):
        state = resumed_state(state_dir, committed)
        version = -1 if state is None else state.global_version
        params = {} if state is None else dict(state.params)
        history = [] if state is None else [int(h["round_id"]) for h in state.history]
        closed = sorted(set(an.coordinator_log_ids(text)["closed"]))
        whole.update(params)
        part = state_hash(params) if params else ""
        shards.append(
            {
                "shard": i,
                "version": version,
                "rounds": len(history),
                "history": history,
                "rounds_lost_list": sorted(set(closed) - set(history)),
                "state_hash": part,
                "sites_agree": bool(params)
                and all(
                    v == version and set(params) <= set(p) and state_hash(_part(p, params)) == part
                    for v, p in sites.values()
                ),
            }
        )
    combined = state_hash(whole) if whole else ""
    return {
        "committed": committed,
        "committed_hash": "" if record is None else record.state_hash,
        "combined_hash": combined,
        "shards": shards,
        "params": whole,
        "agree": bool(whole)
        and all(sh["version"] == committed for sh in shards)
        and all(sh["history"] == shards[0]["history"] for sh in shards)
        and (record is None or record.state_hash == combined)
        and all(v == committed and state_hash(p) == combined for v, p in sites.values()),
        "versions": {
            **{f"coordinator-{sh['shard']}": sh["version"] for sh in shards},
            **{s: v for s, (v, _) in sites.items()},
        },
    }


def _part(params: dict[str, np.ndarray], names: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: params[k] for k in names}
