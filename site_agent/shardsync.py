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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from site_agent.shards import RankShards, gather_slices, local_part, shard_hash

log = logging.getLogger("crossdc.site")

Metrics = Mapping[str, float]


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
    ) -> None:
        """``evaluate``: the validation every rank runs on θ (None: the site has none);
        ``optimizer``: the model's, checkpointed with it."""
        # The layers FSDP2 gathers and frees at every step go back to the system, not to a
        # heap that keeps them (site_agent.allocator).
        return_large_blocks()
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.rank = dist.get_rank(group)
        self.state = federated_state(model)
        self.shards = RankShards(self.state.items(), rank=self.rank, decay=decay)
        self._evaluate = evaluate
        # Per fragment in flight: its local rows at the send, or None where no step is taken
        # before its result (no overlap): the rows as they are then are those.
        self._sent: dict[int, dict[str, torch.Tensor] | None] = {}

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def spec(self) -> dict[str, tuple[int, ...]]:
        """Every federated tensor's whole shape, in ``state_dict`` order."""
        return {name: rows.shape for name, rows in self.shards.ranges.items()}

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
        Not sent (any rank failed): every rank's residuals are as before."""
        before = self.shards.feedback.snapshot()
        slices: list[EncodedTensor] = []
        error, non_finite = "", False
        try:
            slices = self.shards.shard_update(self.state, get_codec(codec_spec), names)
        except NonFiniteError as exc:
            error, non_finite = str(exc), True
        except ValueError as exc:
            error = str(exc)
        mine = (slices, error, non_finite, self.shards.residual_sq_norm())
        parts = _gather(mine, self.group)
        verdict = _broadcast(
            None if parts is None else next((p[1:3] for p in parts if p[1]), ("", False)),
            self.group,
        )
        if verdict[0]:
            self.shards.feedback.restore(before)
            return (
                UpdateResult((), error=verdict[0], non_finite=verdict[1]) if self.leader else None
            )
        self._sent[fragment] = (
            {name: local_part(self.state[name]).to(torch.float32, copy=True) for name in names}
            if keep_reference
            else None
        )
        if parts is None:
            return None
        return UpdateResult(
            tuple(enc for p in parts for enc in p[0]),
            residual_sq_norm=sum(p[3] for p in parts),
        )

    def reset_local(self) -> None:
        """The local rows ← θ, and nothing is in flight (the local training diverged)."""
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
        """A result's encoded tensors (``payload`` on the leader, broadcast from it: None on the
        others), a whole model (``full``) or a delta to θ: each rank decodes its rows; if the
        candidate θ's hash is ``state_hash``, every rank takes it and merges it into its local
        rows. The outcome on the leader (None on the others)."""
        payload = _broadcast(None if payload is None else tuple(payload), self.group)
        assert payload is not None
        candidate: dict[str, torch.Tensor] = {}
        error: tuple[str, str] | None = None
        try:
            candidate = self._candidate(payload, full=full)
        except WireError as exc:
            error = (exc.code.name.lower(), str(exc))
        errors = _gather(error, self.group)
        failed = _broadcast(
            None if errors is None else next((e for e in errors if e is not None), ("", "")),
            self.group,
        )
        if failed[0]:
            return ResultOutcome(False, failed[0], failed[1]) if self.leader else None
        before = self.shards.replace_theta(candidate)
        digest = shard_hash(self.shards, group=self.group)
        matches = _broadcast(None if digest is None else digest == state_hash, self.group)
        if not matches:
            self.shards.replace_theta(before)
            detail = f"state hash {digest} != coordinator {state_hash}"
            return ResultOutcome(False, "hash_mismatch", detail) if self.leader else None
        self._merge(candidate, before, full=full, fragment=fragment)
        return ResultOutcome(True) if self.leader else None

    def _candidate(
        self, payload: Sequence[EncodedTensor], *, full: bool
    ) -> dict[str, torch.Tensor]:
        """θ's new rows of every tensor ``payload`` names, each rank decoding only the range of
        elements it holds (``comm.wire.tensors.decode_into``); WireError when the payload does
        not fit the model (a name, a shape, a slice where a whole tensor belongs, a whole model
        missing a tensor) or a value in the rank's range is not finite."""
        ranges = self.shards.ranges
        named = {enc.name for enc in payload}
        wrong = next(
            (
                enc
                for enc in payload
                if enc.name not in ranges
                or enc.rows is not None
                or tuple(enc.shape) != ranges[enc.name].shape
            ),
            None,
        )
        if wrong is not None or len(named) != len(payload) or (full and named != set(ranges)):
            decode_tensors(payload, self.spec())  # raises, naming what is wrong
            raise WireError(ErrorCode.BAD_PAYLOAD, "a result that does not fit the model")
        out: dict[str, torch.Tensor] = {}
        for enc in payload:
            rows = ranges[enc.name]
            if rows.stop <= rows.start:
                continue  # no rows here: nothing decoded
            theta = self.shards.theta(enc.name)
            host = np.empty(tuple(theta.shape), dtype=np.float32)
            decode_into(enc, host.reshape(-1), rows.flat_start)
            part = torch.from_numpy(host).to(theta.device)
            out[enc.name] = part if full else theta + part
        return out

    def _merge(
        self,
        new: Mapping[str, torch.Tensor],
        old: Mapping[str, torch.Tensor],
        *,
        full: bool,
        fragment: int | None,
    ) -> None:
        """The local rows after a result: θ_new for a whole model (nothing is in flight then);
        for a delta, the progress since the fragment's send kept on top of θ_new."""
        if full:
            self._sent.clear()
            self.shards.load_into(self.state)
            return
        sent: dict[str, torch.Tensor] | None = {}  # not sent: θ before the result
        if fragment is not None and fragment in self._sent:
            sent = self._sent.pop(fragment)
        with torch.no_grad():
            for name, theta in new.items():
                local = local_part(self.state[name])
                rows = local.to(torch.float32)
                ref = rows if sent is None else sent.get(name, old[name])
                local.copy_(rows + (theta - ref))

    # ---- the rest --------------------------------------------------------------------------

    def state_hash(self) -> str | None:
        """``state_hash`` of the whole θ, on the leader (None on the others)."""
        return shard_hash(self.shards, group=self.group)

    def validate(self) -> dict[str, float] | None:
        """The script's ``evaluate`` of θ (every rank runs it: a sharded forward is collective),
        the local rows put back afterwards; its metrics on the leader (None elsewhere, or
        without an ``evaluate``)."""
        if self._evaluate is None:
            return None
        local = {n: local_part(t).clone() for n, t in self.state.items()}
        self.shards.load_into(self.state)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = dict(self._evaluate(self.model))
        finally:
            self.model.train(was_training)
            _reshard(self.model)
            with torch.no_grad():
                for name, t in self.state.items():
                    local_part(t).copy_(local[name])
        return metrics if self.leader else None

    def initial_payload(self) -> tuple[EncodedTensor, ...] | None:
        """θ as fp32 slices gathered to the leader (a coordinator that holds no model yet takes
        θ0 from the first site to join): None on the others."""
        codec = get_codec("fp32")
        mine = [
            self.shards.encode_theta(name, codec)
            for name in self.shards.ranges
            if self.shards.owns(name)
        ]
        gathered = gather_slices(mine, group=self.group)
        return None if gathered is None else tuple(gathered)

    def num_parameters(self) -> int:
        return sum(math.prod(rows.shape) for rows in self.shards.ranges.values())

    # ---- checkpoint ------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """θ, the residuals, the model and its optimizer with ``torch.distributed.checkpoint``
        into directory ``path`` (each rank writes its shards)."""
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self._checkpoint_state(), checkpoint_id=path, process_group=self.group)

    def load(self, path: str) -> None:
        """What :meth:`save` wrote to ``path`` (in another layout too: it reshards), then the
        local rows ← θ (progress not synced when the site stopped is not trusted)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        optimizer = self.optimizer
        state = self._checkpoint_state()
        load(state, checkpoint_id=path, process_group=self.group)
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
        self.reset_local()

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


def _reshard(model: nn.Module) -> None:
    """Free what a forward without backward left gathered (FSDP2 keeps the root's parameters
    unsharded after its forward), so the local rows are the parameters again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """``obj`` of every rank on the leader in rank order (None on the others)."""
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(obj, out, group=group, group_dst=0)
    return out


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """The leader's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


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
