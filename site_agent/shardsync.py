"""A sharded site's sync, rank by rank: what every rank of the site does when the agent syncs.

A site whose model is sharded over its ranks (FSDP2's ``fully_shard``: ``site_agent.shards``)
syncs shard by shard. The agent runs on the leader (rank 0, the only WAN endpoint); each sync
step is a collective call that every rank makes with the same arguments, in the same order, on
:class:`RankSync` (library mode: ``site_agent.library`` has the leader name the call to the other
ranks over the site's process group). What crosses the process group is encoded bytes only:

- :meth:`RankSync.update`: each rank computes its rows' pseudo-gradient, adds its residual and
  encodes it where its shard lives; the encoded slices are gathered to the leader, which sends
  them as one update. When a rank cannot encode (a non-finite value, a codec that refuses), no
  rank keeps anything of the attempt: every residual owes what it owed before.
- :meth:`RankSync.result`: the leader broadcasts a result's encoded tensors as they came over the
  WAN; each rank decodes the rows it holds, computes the candidate θ, and the state hash of the
  whole candidate is computed from the shards (``shards.shard_hash``); only when it is the
  coordinator's does every rank take it and merge it into its local rows, keeping the progress
  made since the fragment was sent (θ_local ← θ_local + (θ_new − θ_local at the send)).
- :meth:`RankSync.validate`, :meth:`RankSync.reset_local`, :meth:`RankSync.state_hash`,
  :meth:`RankSync.initial_payload`, and the checkpoint (:meth:`RankSync.save`,
  :meth:`RankSync.load`: ``torch.distributed.checkpoint``, each rank its shards).

Each rank decodes only the elements of the rows it holds (``comm.wire.tensors.decode_into``:
the blockwise codecs read only the blocks covering them); a tensor of which the rank holds no
rows it does not decode.

A rank whose own part of a call fails (a bug, ``MemoryError``: not a value it cannot encode nor
a result that does not fit, which have answers of their own) still makes the call's next
collective, carrying the failure, and there every rank raises the same ``RankFailure`` naming
it (``site_agent.rankfailure``): no rank is left waiting for it, and the ranks stay in step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from comm.codecs.base import EncodedTensor, NonFiniteError
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode
from comm.wire.tensors import decode_into, decode_tensors
from site_agent.allocator import return_large_blocks
from site_agent.jobs.contract import federated_state
from site_agent.rankbytes import broadcast_encoded, gather_encoded
from site_agent.rankfailure import Failed, agree, failed, raise_first
from site_agent.shards import RangeDigests, RankShards, digest_range, local_part, shard_hash

log = logging.getLogger("crossdc.site")

Metrics = Mapping[str, float]
_T = TypeVar("_T")


def is_sharded(model: nn.Module) -> bool:
    """Whether any federated tensor of ``model`` is a DTensor (FSDP2's ``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in federated_state(model).values())


@dataclass(frozen=True)
class UpdateResult:
    """What the leader gets of :meth:`RankSync.update`: the encoded slices of every rank (in
    rank order), or why none went out; and the squared residual norm summed over the ranks."""

    tensors: tuple[EncodedTensor, ...]
    error: str = ""
    non_finite: bool = False
    residual_sq_norm: float = 0.0


@dataclass(frozen=True)
class ResultOutcome:
    """What the leader gets of :meth:`RankSync.result`: whether every rank took it, and why not
    (``rejected``: the metric's reason; ``detail``: for the log)."""

    applied: bool
    rejected: str = ""
    detail: str = ""


class RankSync:
    """One rank's side of its site's sync (see the module docstring). ``group``: the site's
    process group (None: the default one). Not thread-safe: one caller per instance."""

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        decay: float = 1.0,
        evaluate: Callable[[nn.Module], Metrics] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        shards: RankShards | None = None,
    ) -> None:
        """``evaluate``: the validation every rank runs on θ (None: the site has none);
        ``optimizer``: the model's, checkpointed with it; ``shards``: what this rank keeps of
        ``federated_state(model)``, where not the default (a pipeline stage's rank holds some
        tensors of the model only: ``site_agent.pipeline.stagesync``)."""
        # The layers FSDP2 gathers and frees at every step go back to the system, not to a
        # heap that keeps them (site_agent.allocator).
        return_large_blocks()
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.rank = dist.get_rank(group)
        self.state = federated_state(model)
        self.shards = shards or RankShards(self.state.items(), rank=self.rank, decay=decay)
        self._evaluate = evaluate
        # Per fragment in flight: its local rows at the send, or None where no step is taken
        # before its result (no overlap): the rows as they are then are those.
        self._sent: dict[int, dict[str, torch.Tensor] | None] = {}

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _local(self, what: str, work: Callable[[], _T]) -> _T:
        """``work()``, this rank's own part between two collectives, then every rank learns
        whether every rank's succeeded: RankFailure on all of them where one failed (naming
        it and ``what`` it was doing), so that none waits for it in a later collective."""
        out: Any = None
        own: Failed | None = None
        cause: BaseException | None = None
        try:
            out = work()
        except Exception as exc:
            own, cause = failed(exc, self.rank, what), exc
        agree(own, self.group, cause)
        return out  # type: ignore[no-any-return]

    def spec(self) -> dict[str, tuple[int, ...]]:
        """Every federated tensor's whole shape, in ``state_dict`` order."""
        return dict(self.shards.shapes)

    # ---- the update ------------------------------------------------------------------------

    def update(
        self,
        fragment: int,
        names: Sequence[str],
        codec_spec: str,
        *,
        keep_reference: bool = True,
    ) -> UpdateResult | None:
        """This rank's slices of fragment ``fragment`` (tensors ``names``) encoded with
        ``codec_spec`` through its residuals, gathered to the leader (None on the others).
        Sent: with ``keep_reference`` (the site trains on while the result is in flight) each
        rank keeps a copy of its local rows of ``names``, the reference its result is merged
        against; without, no step comes before the result and the rows then are the reference.
        Not sent (a rank could not encode: a non-finite value, a codec that refuses): every
        rank's residuals are as before. A rank that failed otherwise: RankFailure on every rank
        (``site_agent.rankfailure``)."""
        slices: list[EncodedTensor] = []
        refused: tuple[str, bool] | None = None  # why not sent, and whether non-finite
        own: Failed | None = None
        cause: BaseException | None = None
        try:
            codec = get_codec(codec_spec)
            slices = self.shards.encode_update(self.state, codec, names)
        except NonFiniteError as exc:
            refused = (str(exc), True)
        except ValueError as exc:
            refused = (str(exc), False)
        except Exception as exc:
            own, cause = failed(exc, self.rank, "encoding its update"), exc
        statuses = _everyone((own, refused), self.group)
        raise_first((f for f, _ in statuses), own, cause)
        why = next((r for _, r in statuses if r is not None), None)
        if why is not None:
            return UpdateResult((), error=why[0], non_finite=why[1]) if self.leader else None
        norm = 0.0
        try:
            # Every rank encoded: the residuals keep what the encodings lost, in place.
            self.shards.settle_update(self.state, codec, slices)
            self._sent[fragment] = (
                {
                    name: local_part(self.state[name]).to(torch.float32, copy=True)
                    for name in names
                    if name in self.state
                }
                if keep_reference
                else None
            )
            norm = self.shards.residual_sq_norm()
        except Exception as exc:
            own, cause = failed(exc, self.rank, "keeping the residuals of its update"), exc
        norms = _everyone((own, norm), self.group)
        raise_first((f for f, _ in norms), own, cause)
        gathered = gather_encoded(slices, group=self.group)
        del slices
        if gathered is None:
            return None
        return UpdateResult(tuple(gathered), residual_sq_norm=sum(n for _, n in norms))

    def reset_local(self) -> None:
        """The local rows ← θ, and nothing is in flight (the local training diverged)."""
        self._local("resetting its rows to θ", self._reset_here)

    def _reset_here(self) -> None:
        """:meth:`reset_local` on this rank alone."""
        self.shards.load_into(self.state)
        self._sent.clear()

    # ---- a result --------------------------------------------------------------------------

    def result(
        self,
        payload: Sequence[EncodedTensor] | None,
        *,
        full: bool,
        fragment: int | None,
        state_hash: str,
    ) -> ResultOutcome | None:
        """A result's encoded tensors (``payload`` on the leader, None on the others), a whole
        model (``full``) or a delta to θ, in two passes over it, the leader broadcasting its
        tensors' bytes one at a time in each (``site_agent.rankbytes``):

        1. each rank decodes the elements of its rows a few hash blocks at a time, only to hash
           the candidate θ they make (``shards.digest_range``); the whole candidate's hash is
           combined from the ranks' parts (``shards.shard_hash``), nothing gathered;
        2. only when it is ``state_hash`` does every rank decode its rows again and take them,
           in place: θ's rows, then the local rows (see :meth:`_take`).

        No rank holds a candidate copy of its rows or more than one tensor's encoding of the
        result. The outcome on the leader (None on the others). A rank that fails in its part
        (not a result that does not fit: a bug, memory) still makes every collective of the pass,
        and every rank raises the same RankFailure at its end (``site_agent.rankfailure``): in
        the first pass no rank has taken anything; in the second θ may be taken in part."""
        own: Failed | None = None
        cause: BaseException | None = None
        fits: tuple[str, str] | None = None
        if payload is not None:
            try:
                fits = self._fits(payload, full=full)
            except Exception as exc:
                own, cause = failed(exc, self.rank, "checking the result's tensors"), exc
        count, bad, leader_failed = _broadcast(
            None if payload is None else (len(payload), fits or ("", ""), own), self.group
        )
        raise_first([leader_failed], own, cause)
        if bad[0]:
            return ResultOutcome(False, bad[0], bad[1]) if self.leader else None
        parts: dict[str, RangeDigests] = {}
        error: tuple[str, str] | None = None
        for i in range(count):
            enc = broadcast_encoded(None if payload is None else payload[i], group=self.group)
            if error is None and own is None and self.shards.owns(enc.name):
                try:
                    parts[enc.name] = self._candidate_digests(enc, full=full)
                except WireError as exc:
                    error = (exc.code.name.lower(), str(exc))
                except Exception as exc:
                    own, cause = failed(exc, self.rank, "decoding its rows of the result"), exc
            del enc
        errors = _everyone((own, error), self.group)
        raise_first((f for f, _ in errors), own, cause)
        rejected = next((e for _, e in errors if e is not None), None)
        if rejected is not None:
            return ResultOutcome(False, *rejected) if self.leader else None
        digest = shard_hash(self.shards, group=self.group, parts=parts)
        del parts
        matches = _broadcast(None if digest is None else digest == state_hash, self.group)
        if not matches:
            detail = f"state hash {digest} != coordinator {state_hash}"
            return ResultOutcome(False, "hash_mismatch", detail) if self.leader else None
        sent: dict[str, torch.Tensor] | None = {}  # not sent: θ before the result
        if full:
            self._sent.clear()
        elif fragment is not None and fragment in self._sent:
            sent = self._sent.pop(fragment)
        for i in range(count):
            enc = broadcast_encoded(None if payload is None else payload[i], group=self.group)
            if own is None:
                try:
                    self._take(enc, full=full, sent=sent)
                except Exception as exc:
                    own, cause = failed(exc, self.rank, "taking its rows of the result"), exc
            del enc
        agree(own, self.group, cause)
        return ResultOutcome(True) if self.leader else None

    def _fits(self, payload: Sequence[EncodedTensor], *, full: bool) -> tuple[str, str] | None:
        """Why ``payload`` does not fit the model (a name, a shape, a slice where a whole
        tensor belongs, a tensor named twice, a whole model missing a tensor): the metric's
        reason and the detail; None when it fits (checked by the leader, before any bytes
        cross)."""
        shapes = self.spec()
        named = {enc.name for enc in payload}
        wrong = any(
            enc.name not in shapes or enc.rows is not None or tuple(enc.shape) != shapes[enc.name]
            for enc in payload
        )
        if not wrong and len(named) == len(payload) and (not full or named == set(shapes)):
            return None
        try:
            decode_tensors(payload, shapes)  # raises, naming what is wrong
        except WireError as exc:
            return exc.code.name.lower(), str(exc)
        return ErrorCode.BAD_PAYLOAD.name.lower(), "a result that does not fit the model"

    def _candidate_digests(self, enc: EncodedTensor, *, full: bool) -> RangeDigests:
        """The hash's part of this rank's rows of θ after ``enc`` (θ's new value of its tensor,
        or its delta), decoded a few hash blocks at a time (``comm.wire.tensors.decode_into``:
        the blockwise codecs read only the blocks covering them); WireError when a value in the
        rank's range is not finite."""
        rows = self.shards.ranges[enc.name]
        theta = self.shards.theta(enc.name).reshape(-1)
        on_host = theta.device.type == "cpu"
        host_theta = theta.numpy() if on_host else None
        lo = rows.flat_start
        count = theta.numel()
        buf = np.empty(min(count, _TILE), dtype=np.float32)

        def values_at(at: int, n: int) -> np.ndarray:
            out = buf[:n] if n <= buf.size else np.empty(n, dtype=np.float32)
            decode_into(enc, out, at)
            if not full:
                a = at - lo
                base = host_theta[a : a + n] if host_theta is not None else _cpu(theta[a : a + n])
                np.add(base, out, out=out)  # θ + Δ, as the rows are taken in pass 2
            return out

        return digest_range(enc.name, rows.shape, lo, count, values_at)

    def _take(
        self, enc: EncodedTensor, *, full: bool, sent: Mapping[str, torch.Tensor] | None
    ) -> None:
        """This rank's rows of ``enc`` taken in place, a tile of rows at a time: θ ← the new
        value (``full``) or θ + Δ; the local rows ← θ for a whole model (nothing is in flight
        then), else local + (θ_new − the reference), the reference being the rows at the
        fragment's send (``sent``: None when no step came after it, so the rows now are the
        reference; a tensor it does not name: θ before the result)."""
        rows = self.shards.ranges.get(enc.name)
        if rows is None or rows.stop <= rows.start:
            return  # no rows here (or another stage's tensor): nothing decoded
        theta = self.shards.theta(enc.name)
        nrows = theta.shape[0] if theta.dim() else 1
        theta2d = theta.reshape(nrows, -1)
        param = local_part(self.state[enc.name])
        local = param if param.is_contiguous() else param.contiguous()
        local2d = local.reshape(nrows, -1)
        width = theta2d.shape[1]
        ref = None if sent is None else sent.get(enc.name)
        ref2d = None if ref is None else ref.reshape(nrows, -1)
        step = max(1, _TILE // max(width, 1))
        buf = np.empty(min(nrows, step) * width, dtype=np.float32)
        with torch.no_grad():
            for r0 in range(0, nrows, step):
                r1 = min(nrows, r0 + step)
                host = buf[: (r1 - r0) * width]
                decode_into(enc, host, rows.flat_start + r0 * width)
                value = torch.from_numpy(host).view(r1 - r0, width).to(theta.device)
                th, loc = theta2d[r0:r1], local2d[r0:r1]
                if full:
                    th.copy_(value)
                    loc.copy_(th)
                    continue
                old = th.clone() if sent is not None and ref2d is None else None
                th.add_(value)
                current = loc.to(torch.float32)
                if sent is None:
                    base = current
                elif ref2d is not None:
                    base = ref2d[r0:r1]
                else:
                    assert old is not None
                    base = old
                loc.copy_(current + (th - base))
        if local is not param:
            with torch.no_grad():
                param.copy_(local)

    # ---- the rest --------------------------------------------------------------------------

    def state_hash(self) -> str | None:
        """``state_hash`` of the whole θ, on the leader (None on the others)."""
        return shard_hash(self.shards, group=self.group)

    def validate(self) -> dict[str, float] | None:
        """The script's ``evaluate`` of θ (every rank runs it: a sharded forward is collective),
        the local rows put back afterwards; its metrics on the leader (None elsewhere, or
        without an ``evaluate``). Float32 local rows trade places with θ's, a tile at a time,
        and back after (no copy of them); others are copied aside. A rank that fails here:
        RankFailure on every rank."""
        if self._evaluate is None:
            return None
        metrics = self._local("validating θ", self._validate_here)
        return metrics if self.leader else None

    def _validate_here(self) -> dict[str, float]:
        assert self._evaluate is not None
        kept = self._swap_in_theta()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = dict(self._evaluate(self.model))
        finally:
            self.model.train(was_training)
            _reshard(self.model)
            self._swap_in_theta(kept)
        return metrics

    def _swap_in_theta(
        self, kept: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The local rows ← θ and θ's storage ← the local rows (float32 rows: exchanged), or
        for other rows a copy of them returned (``kept``); called again with that, it undoes
        it exactly."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in self.state.items():
                local, theta = local_part(t), self.shards.theta(name)
                if kept is not None and name in kept:
                    local.copy_(kept[name])
                    continue
                if not _exchangeable(local, theta):
                    out[name] = local.clone()
                    local.copy_(theta)
                    continue
                a, b = local.view(-1), theta.view(-1)
                for lo in range(0, a.numel(), _TILE):
                    tile = a[lo : lo + _TILE].clone()
                    a[lo : lo + _TILE].copy_(b[lo : lo + _TILE])
                    b[lo : lo + _TILE].copy_(tile)
        return out

    def initial_payload(self) -> tuple[EncodedTensor, ...] | None:
        """θ as fp32 slices gathered to the leader (a coordinator that holds no model yet takes
        θ0 from the first site to join): None on the others."""

        def encode() -> list[EncodedTensor]:
            codec = get_codec("fp32")
            return [
                self.shards.encode_theta(name, codec)
                for name in self.shards.ranges
                if self.shards.owns(name)
            ]

        mine = self._local("encoding its rows of θ", encode)
        gathered = gather_encoded(mine, group=self.group)
        return None if gathered is None else tuple(gathered)

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shards.shapes.values())

    # ---- checkpoint ------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """θ, the residuals, the model and its optimizer with ``torch.distributed.checkpoint``
        into directory ``path`` (each rank writes its shards; a rank's failure in the save is
        raised on every rank, by torch's checkpoint or as RankFailure)."""
        from torch.distributed.checkpoint.state_dict_saver import save

        state = self._local("collecting its checkpoint", self._checkpoint_state)
        save(state, checkpoint_id=path, process_group=self.group)

    def load(self, path: str) -> None:
        """What :meth:`save` wrote to ``path`` (in another layout too: it reshards), then the
        local rows ← θ (progress not synced when the site stopped is not trusted)."""
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._local("preparing to load the checkpoint", lambda: self._load_target(path))
        load(state, checkpoint_id=path, process_group=self.group)
        self._local("taking the checkpoint", lambda: self._take_loaded(state))

    def _load_target(self, path: str) -> dict[str, Any]:
        """What :meth:`load` reads ``path`` into (this rank's part of every entry)."""
        return self._checkpoint_state()

    def _take_loaded(self, state: dict[str, Any]) -> None:
        """This rank's part of a loaded checkpoint taken; the local rows ← θ."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizer = self.optimizer
        self.shards.load_state_dict(state["shards"])
        if optimizer is not None:
            set_state_dict(
                self.model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        else:
            self.model.load_state_dict(state["model"])
        self._reset_here()

    def _checkpoint_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizer = self.optimizer
        state: dict[str, Any] = {"shards": self.shards.state_dict()}
        if optimizer is not None:
            model_state, optim_state = get_state_dict(self.model, optimizer)
            state["model"], state["optimizer"] = model_state, optim_state
        else:
            state["model"] = self.model.state_dict()
        return state


_TILE = 1 << 20
"""Values of a result decoded at a time (4 MiB of float32)."""


def _exchangeable(local: torch.Tensor, theta: torch.Tensor) -> bool:
    """Whether a rank's local rows and θ's can trade places exactly (same dtype, float32,
    shape and device, both contiguous)."""
    return (
        local.dtype == theta.dtype == torch.float32
        and local.shape == theta.shape
        and local.device == theta.device
        and local.is_contiguous()
        and theta.is_contiguous()
    )


def _cpu(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.detach().cpu().numpy())


def _reshard(model: nn.Module) -> None:
    """Free what a forward without backward left gathered (FSDP2 keeps the root's parameters
    unsharded after its forward), so the local rows are the parameters again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """The leader's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _everyone(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``obj`` of every rank on every rank, in rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class LeaderSync:
    """The leader's handle on its site's :class:`RankSync`: each method tells the other ranks to
    make the same call (``announce(method, args, kwargs)``, e.g. over the site's process group)
    and makes it on the leader, returning the leader's result. The agent's replica of a sharded
    site (``site_agent.shardreplica``) syncs through it."""

    def __init__(
        self, ranks: RankSync, announce: Callable[[str, tuple[Any, ...], dict[str, Any]], None]
    ) -> None:
        assert ranks.leader, "the leader is rank 0"
        self.ranks = ranks
        self._announce = announce

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._announce(method, args, kwargs)
        return getattr(self.ranks, method)(*args, **kwargs)

    def spec(self) -> dict[str, tuple[int, ...]]:
        return self.ranks.spec()  # the same on every rank: no call

    def num_parameters(self) -> int:
        return self.ranks.num_parameters()

    def update(
        self, fragment: int, names: Sequence[str], codec_spec: str, *, keep_reference: bool = True
    ) -> UpdateResult:
        result = self._call(
            "update", fragment, list(names), codec_spec, keep_reference=keep_reference
        )
        assert isinstance(result, UpdateResult)
        return result

    def reset_local(self) -> None:
        self._call("reset_local")

    def result(
        self,
        payload: Sequence[EncodedTensor],
        *,
        full: bool,
        fragment: int | None,
        state_hash: str,
    ) -> ResultOutcome:
        # The other ranks get the payload from the leader's broadcast inside the call.
        self._announce(
            "result", (None,), {"full": full, "fragment": fragment, "state_hash": state_hash}
        )
        outcome = self.ranks.result(payload, full=full, fragment=fragment, state_hash=state_hash)
        assert outcome is not None
        return outcome

    def state_hash(self) -> str:
        digest = self._call("state_hash")
        assert isinstance(digest, str)
        return digest

    def validate(self) -> dict[str, float] | None:
        metrics: dict[str, float] | None = self._call("validate")
        return metrics

    def initial_payload(self) -> tuple[EncodedTensor, ...]:
        payload = self._call("initial_payload")
        assert payload is not None
        return tuple(payload)

    def save(self, path: str) -> None:
        self._call("save", path)

    def load(self, path: str) -> None:
        self._call("load", path)
