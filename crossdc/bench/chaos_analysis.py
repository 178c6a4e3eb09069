"""Figures of ``crossdc bench chaos`` from what a run left: logs, durable state, events.

Every function here reads files or the event list of a finished :class:`Federation`; none
starts a process.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from comm.wire.tensors import state_hash
from coordinator.file_store import FileStateStore

OPEN_RE = re.compile(r"\[coordinator round=(\d+)\] open:")
CLOSED_RE = re.compile(r"\[coordinator round=(\d+)\] closed:")
ABORTED_RE = re.compile(r"\[coordinator round=(\d+)\] aborted:")


def coordinator_log_ids(log: str) -> dict[str, list[int]]:
    """Round ids in the coordinator's log (every incarnation): opened, closed, aborted."""
    return {
        "open": [int(m) for m in OPEN_RE.findall(log)],
        "closed": [int(m) for m in CLOSED_RE.findall(log)],
        "aborted": [int(m) for m in ABORTED_RE.findall(log)],
    }


def reused_ids(opened: list[int]) -> list[int]:
    """Round ids opened more than once."""
    return sorted(rid for rid, n in Counter(opened).items() if n > 1)


def final_coordinator(state_dir: Path) -> tuple[int, str, list[int]]:
    """The durable state: global version, its state hash, and the closed round ids in it."""
    state = FileStateStore(state_dir).load()
    if state is None:
        return -1, "", []
    history = [int(h["round_id"]) for h in state.history]
    return state.global_version, state_hash(state.params), history


def site_checkpoint(state_dir: Path) -> tuple[int, str]:
    """A site's checkpointed global version and the state hash of its global parameters."""
    version, params = site_params(state_dir)
    return version, state_hash(params) if version >= 0 else ""


def site_params(state_dir: Path) -> tuple[int, dict[str, np.ndarray]]:
    """A site's checkpointed global version and its global parameters (-1, {}: none)."""
    import torch

    path = state_dir / "checkpoint.pt"
    if not path.exists():
        return -1, {}
    ckpt = torch.load(path, weights_only=True)
    params = {k: v.numpy() for k, v in ckpt["global_params"].items()}
    return int(ckpt["global_version"]), params


def stall_figures(
    samples: list[tuple[float, bool]], closes: list[float]
) -> tuple[float, list[float]]:
    """Longest eligible time between consecutive round closes, and where it ended.

    ``samples`` are (time, eligible) at each tick; the time from one sample to the next counts
    when the earlier one was eligible. ``closes`` are the times rounds were seen closed."""
    closes = sorted(closes)
    best, best_span = 0.0, [0.0, 0.0]
    acc, since, ci = 0.0, samples[0][0] if samples else 0.0, 0
    for (t, ok), (t_next, _) in zip(samples, samples[1:], strict=False):
        while ci < len(closes) and closes[ci] <= t:
            acc, since, ci = 0.0, closes[ci], ci + 1
        if ok:
            acc += t_next - t
        if acc > best:
            best, best_span = acc, [round(since, 2), round(t_next, 2)]
    return round(best, 2), best_span


def coordinator_recoveries(events: list[dict[str, Any]], closes: list[float]) -> list[float]:
    """Seconds from each fault that stopped the coordinator (or one of its shards) to the first
    round closed after that process's next start (``inf`` when none closed)."""
    out = []
    for i, ev in enumerate(events):
        if ev["event"] != "fault" or not str(ev["target"]).startswith("coordinator"):
            continue
        restart = next(
            (
                e["t"]
                for e in events[i + 1 :]
                if e["event"] == "start" and e["role"] == ev["target"]
            ),
            None,
        )
        first = min((c for c in closes if restart is not None and c > restart), default=None)
        out.append(math.inf if first is None else round(first - ev["t"], 2))
    return out


def site_rejoins(
    events: list[dict[str, Any]], closed_at: dict[int, float], merged: dict[int, list[str]]
) -> list[dict[str, Any]]:
    """For each restart of a site (a start after its first) and each end of a partition: the
    rounds closed from then until one merged the site's update (None: never merged again)."""
    order = sorted(closed_at, key=lambda r: (closed_at[r], r))
    starts: dict[str, int] = {}
    out = []
    links_up: set[tuple[str, float]] = set()
    for ev in events:
        role = ev.get("role", "")
        if role == "" or role.startswith("coordinator"):
            continue
        if ev["event"] == "start":
            starts[role] = starts.get(role, 0) + 1
            if starts[role] == 1:
                continue
        elif ev["event"] != "link_up" or (role, ev["t"]) in links_up:
            continue  # with several shards a site's links come up together: one rejoin
        else:
            links_up.add((role, ev["t"]))
        after = [r for r in order if closed_at[r] > ev["t"]]
        rounds = next((i + 1 for i, r in enumerate(after) if role in merged[r]), None)
        out.append({"site": role, "t": ev["t"], "after": ev["event"], "rounds": rounds})
    return out


def evaluate(site_config: Path, params: dict[str, np.ndarray] | None) -> float:
    """Validation loss as a site computes it (its job's ``evaluate``), of ``params`` or of the
    initial model when ``params`` is None; any job, the byte GPT included."""
    from site_agent.config import load_site_config
    from site_agent.launch import build_job_trainer

    trainer = build_job_trainer(load_site_config(site_config))
    if params is not None:
        trainer.load_parameters(params)
    return float(trainer.validate()["loss"])


def final_params(state_dir: Path) -> dict[str, np.ndarray] | None:
    state = FileStateStore(state_dir).load()
    return None if state is None else dict(state.params)
