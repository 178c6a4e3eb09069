"""θ0 uploaded by a site to a coordinator of several shards.

Without ``[coordinator.initial_model]`` the first site to join uploads θ0, as to one coordinator
process; with ``[coordinator] shards = S`` its link sends each shard the tensors that shard owns
(``site_agent.shard_links``: the cut of ``comm.wire.partition.partition``). Each shard checks its
part as one coordinator checks θ0 (fp32, finite: ``coordinator.intake.received_model``) and
holds it where the transport reassembled it (:class:`Held`, not yet its state), and reports the
part's shapes and tensor digests to shard 0 (``ShardInitial``). Shard 0 puts every shard's report
together (:class:`Initials`): once every shard reported a part from one site, the parts must be
exactly the cut of the whole model's shapes, and θ0's whole hash is
``comm.wire.partition.combined_hash`` of every shard's digests (``comm.wire.tensors.state_hash``
of θ0 in one piece, bit for bit). Shard 0's word (``ShardInitialDone``) then goes to every shard
and to itself: every shard writes the whole model's shapes and hash in its state directory
(:func:`write_record`: a restarted shard knows the cut and the hash the sites know version 0 by)
and keeps its part as version 0. Parts from different sites, a tensor in two parts or in
another shard's, a part missing because the site left before it arrived (an upload cut
half-way): every shard drops what it holds of that upload, no state is made, the site is told,
and the next upload starts afresh.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from comm.durable import atomic_write
from comm.wire.partition import combined_hash, partition
from comm.wire.schema import ShardInitial, ShardInitialDone
from comm.wire.tensors import tensor_digest
from coordinator.sharding import WholeModel

RECORD = "model.json"


@dataclass(frozen=True)
class Held:
    """A shard's part of θ0 as a site uploaded it, checked and not yet its state."""

    peer: bytes
    site_id: str
    params: dict[str, np.ndarray]
    fingerprint: str

    def report(self, shard: int) -> ShardInitial:
        """What shard ``shard`` tells shard 0 of it: each tensor's shape and digest."""
        return ShardInitial(
            shard=shard,
            site_id=self.site_id,
            shapes={name: list(v.shape) for name, v in self.params.items()},
            digests={name: tensor_digest(name, v).hex() for name, v in self.params.items()},
        )

    def fits(self, done: ShardInitialDone, part: Sequence[str]) -> str:
        """Why this part is not shard's ``part`` of the whole θ0 that ``done`` accepted ("" when
        it is: the same site, exactly the part's tensors, of the whole model's shapes)."""
        if done.site_id != self.site_id:
            return f"shard 0 took θ0 from {done.site_id}, this shard holds {self.site_id}'s"
        if set(self.params) != set(part):
            return "this shard holds other tensors than its part of θ0"
        for name, v in self.params.items():
            if tuple(v.shape) != tuple(done.shapes[name]):
                return f"tensor {name!r} {tuple(v.shape)} is {tuple(done.shapes[name])} at shard 0"
        return ""


def shapes_of(raw: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    """Shapes as a message carries them (lists of ints), as tuples; ValueError otherwise."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in raw.items():
        if not isinstance(shape, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"tensor {name!r}: shape {shape!r}")
        out[str(name)] = tuple(int(d) for d in shape)
    return out


class Initials:
    """Shard 0's record of the θ0 parts every shard holds (see the module doc)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.reports: dict[int, ShardInitial] = {}

    def add(self, report: ShardInitial) -> list[ShardInitialDone]:
        """Shard ``report.shard`` holds a part (one it held before is replaced): shard 0's word
        on the upload once every shard reported (none before)."""
        if not 0 <= report.shard < self.count:
            raise ValueError(f"θ0's part from shard {report.shard} of {self.count}")
        self.reports[report.shard] = report
        if len(self.reports) < self.count:
            return []
        reports, self.reports = self.reports, {}
        sites = sorted({r.site_id for r in reports.values()})
        if len(sites) > 1:
            why = f"the shards hold θ0's parts from different sites ({', '.join(sites)})"
            return [_refused(site, why) for site in sites]
        return [_decide(sites[0], [reports[s] for s in range(self.count)])]

    def gone(self, members: Container[str]) -> list[ShardInitialDone]:
        """The parts of sites no longer ``members`` (they left before every part arrived):
        dropped here, and every shard told to drop them."""
        left = sorted({r.site_id for r in self.reports.values() if r.site_id not in members})
        self.reports = {s: r for s, r in self.reports.items() if r.site_id not in left}
        why = "the site left before every shard held its part of θ0"
        return [_refused(site, why) for site in left]


def _refused(site_id: str, why: str) -> ShardInitialDone:
    return ShardInitialDone(site_id=site_id, state_hash="", shapes={}, reason=why)


def _decide(site_id: str, reports: Sequence[ShardInitial]) -> ShardInitialDone:
    """Every shard's report of one site's upload: accepted with θ0's whole hash when the parts
    are the model's cut, refused naming the first thing wrong otherwise."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for r in reports:
            got = shapes_of(r.shapes)
            if set(got) != set(r.digests):
                raise ValueError(f"shard {r.shard} reports shapes and digests of other tensors")
            twice = sorted(set(got) & set(shapes))
            if twice:
                raise ValueError(f"tensor {twice[0]!r} was sent to two shards")
            shapes.update(got)
        parts = partition(shapes, len(reports))
        for r, part in zip(reports, parts, strict=True):
            if set(r.shapes) != set(part):
                wrong = sorted(set(r.shapes) ^ set(part))
                raise ValueError(
                    f"shard {r.shard} got other tensors than the model's cut gives it "
                    f"(first: {wrong[0]!r})"
                )
        digests = [{n: bytes.fromhex(str(d)) for n, d in r.digests.items()} for r in reports]
        whole = combined_hash(digests)
    except ValueError as exc:
        return _refused(site_id, f"θ0's parts are not one model's cut: {exc}")
    return ShardInitialDone(
        site_id=site_id,
        state_hash=whole,
        shapes={name: list(shape) for name, shape in shapes.items()},
        reason="",
    )


def write_record(state_dir: Path, whole: WholeModel) -> None:
    """The whole model's shapes and θ0's whole hash, durably in the shard's state directory."""
    state_dir.mkdir(parents=True, exist_ok=True)
    body = {
        "shapes": {name: list(shape) for name, shape in whole.shapes.items()},
        "state_hash": whole.state_hash,
    }
    atomic_write(state_dir / RECORD, json.dumps(body).encode())


def read_record(state_dir: Path) -> WholeModel | None:
    """The record :func:`write_record` made, or None where θ0 never came; ValueError names a
    file that is not one."""
    path = state_dir / RECORD
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        shapes, digest = shapes_of(doc["shapes"]), doc["state_hash"]
        if not isinstance(digest, str):
            raise TypeError(digest)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not a record of the whole model") from None
    return WholeModel(shapes, digest)
