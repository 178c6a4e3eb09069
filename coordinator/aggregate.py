"""Aggregators: how a round's updates are checked as they land, held, folded at its close, and
turned into the outer step and what the sites are sent.

One :class:`Aggregator` is chosen when the federation is assembled; each round folds its
updates through a :class:`Fold` the aggregator gives it, and at its close
:meth:`Fold.result` hands the strategy what it merges (:class:`RoundResult`). Two live here:

- :class:`WeightedMean`: each update checked on arrival from its encoded values (finite,
  within the norm bound over all its pieces, a sharded site's slices included) and then held
  as the encoded payload it came as, the transport's bytes, until the round's result is taken
  (:class:`MeanFold`). The mean is folded at the close tensor by tensor, each tensor decoded
  block by block from every held update straight into one float32 buffer of the largest
  tensor's size (:class:`HeldMean`): no float copy of an update is ever made and no round
  holds a sum of the model, only its updates' compressed bytes. The strategy steps on that
  mean tensor by tensor and the step's delta goes down through the downlink codec, the
  difference to the exact result kept as the downlink residual (:func:`outer_step`).
- :class:`SparseForward`: the same checks (whole tensors only), but the updates are kept as they
  arrived and the broadcast forwards them with their weights; the strategy's ordered step (a
  strategy declaring the sparse broadcast provides one,
  :class:`~coordinator.strategies.base.OrderedStep`) runs on them decoded as a site decodes that
  broadcast, so every site lands on the coordinator's parameters bit for bit
  (:func:`sparse_outer_step`).

Late updates (their round closed) are held by a second fold of their round, merged at their
fragment's next sync, down-weighted by the syncs they missed. Sums are float32, and a float32
sum depends on the order of its terms, so a mean adds its updates in a canonical order, the
participants' by site id, whatever order they arrived in (late ones by site id): the same
updates give the same mean bit for bit, run after run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode, Join
from comm.wire.tensors import (
    accumulate,
    check_payload,
    check_slices,
    decode_tensors,
    encode_tensors,
    split_parts,
)
from coordinator.state import GlobalState
from coordinator.strategies.base import (
    OrderedStep,
    Revealed,
    Strategy,
    as_ordered,
)

Arrays = dict[str, npt.NDArray[np.float32]]
Shapes = Mapping[str, tuple[int, ...]]
"""The tensors a round covers, by name: the fragment's (or a shard's share of it)."""


@dataclass(frozen=True)
class Refused:
    """An update's payload the aggregator will not fold: the Error code and detail."""

    code: ErrorCode
    detail: str


@dataclass(frozen=True)
class Late:
    """A closed round's late updates, merged into a later close of the same fragment."""

    origin: int
    """The round they were trained for."""
    divisor: int
    """What their weights are divided by: 1 + the syncs of their fragment they missed."""
    fold: Fold


@dataclass(frozen=True)
class OuterStep:
    """What one close computes for the tensors its round covers."""

    state: GlobalState
    """The new state (params, momentum and residual updated for the round's tensors)."""
    encoded: tuple[EncodedTensor, ...]
    """What the sites are sent and apply: the only copy of the result."""
    rule: str
    """How the step was taken (the strategy's words)."""
    outer_grad_norm: float
    numel: int
    """The values the result covers (the round's tensors)."""
    part_weights: tuple[float, ...] = ()
    """A sparse broadcast: the weight of each update ``encoded`` holds (empty: a delta)."""
    outer_lr: float = 0.0
    """A sparse broadcast: the step's learning rate, which the sites apply too."""
    downlink: str = ""
    """The codec the result went down in, as the round's history names it."""


def _nothing() -> None:
    return None


class RoundResult(Protocol):
    """What a closed round hands the strategy: ``step`` runs it and encodes the broadcast."""

    @property
    def count(self) -> int:
        """Updates (or means of them) merged."""
        ...

    @property
    def fold_cpu_seconds(self) -> float:
        """CPU time spent so far folding held updates into what the step reads (the step
        folds them as it goes: read it after the step)."""
        ...

    def step(
        self,
        strategy: Strategy,
        st: GlobalState,
        names: Sequence[str],
        *,
        downlink: str,
        inner_steps: int,
        final: bool,
        averaged: Collection[str],
        prepare: Callable[[], None] = _nothing,
    ) -> OuterStep:
        """``prepare`` runs once before the state's arrays are changed in place: then no save
        and no announcement may still read them."""
        ...


class Fold(Protocol):
    """One round's (or one closed round's late updates') running aggregate."""

    start_fields: Mapping[str, Any]
    """What this attempt adds to each participant's RoundStart (empty for most)."""

    def add(
        self, site_id: str, weight: float, payload: Sequence[EncodedTensor], shapes: Shapes
    ) -> Refused | str:
        """Check one update's payload against the round's tensors and fold it in: a refusal,
        or a note for the log."""
        ...

    def result(self, label: str, late: Sequence[Late]) -> RoundResult:
        """What the strategy merges: this fold (on-time updates of round ``label``) and the
        late folds given."""
        ...

    def squared_norm(self, site_id: str) -> float:
        """Σ x² over the values of the update held from ``site_id`` (the square of the norm
        its check bounded): a coordinator of several shards bounds a site's whole update by
        its shards' parts (``coordinator.shard_plane``). KeyError: none held."""
        ...

    def leave_out(self, site_id: str) -> None:
        """Let go of the update held from ``site_id`` as if it had never been taken (the shards
        of a coordinator agreed to merge it nowhere); nothing when none is held."""
        ...

    @property
    def nbytes(self) -> int: ...


class Aggregator(Protocol):
    """How rounds aggregate; chosen once per federation."""

    name: str
    """For the log: what aggregates."""
    reveals: Revealed
    """What the outer step sees of a round's updates (a strategy that needs more cannot run on
    this aggregation: ``coordinator.strategies.problem``)."""
    whole_rounds: bool
    """A round merges all of its participants' updates or is retried with those that remain
    (:meth:`retry`); False: it may close with a quorum."""
    late_refusal: str
    """Why a closed round takes no late update ("" when it does)."""
    arrivals_time_training: bool
    """Whether an on-time update's arrival times its site's training, so that arrival
    alignment may plan extra steps from it; False where an update may come from no training
    (a retry's survivors send again the update they already trained): rounds record no
    arrival then."""
    holds_updates: bool
    """Whether a fold holds each update as the bytes it came as until its round's result is
    taken (charged to its sender meanwhile: ``coordinator.allowance``); False where it folds
    an update on arrival and lets it go."""

    def check_join(self, msg: Join) -> None:
        """Refuse (ValueError naming the site) a join that could not take part."""

    def joined(self, peer: bytes, msg: Join) -> None:
        """What a join (checked by :meth:`check_join`) brings that rounds will need."""

    def forget(self, site_id: str) -> None:
        """A member left or was removed."""

    def fold(self, round_id: int, participants: Sequence[str]) -> Fold:
        """A fresh fold for a round opening with ``participants``."""
        ...

    def late_fold(self) -> Fold:
        """A fresh fold for a closed round's late updates."""
        ...

    def retry(
        self, round_id: int, fold: Fold, received: Sequence[str]
    ) -> tuple[tuple[tuple[str, ...], Fold] | None, str]:
        """A whole round lacking updates: its next attempt (who takes part, and its fold; None:
        it is abandoned), and why."""
        ...


def check_bounded(
    payload: Sequence[EncodedTensor], shapes: Shapes, max_norm: float, *, slices: bool = False
) -> tuple[dict[str, list[EncodedTensor]], float] | Refused:
    """An update's pieces by tensor and its norm, or why not: they do not fit the round's
    shapes or are not finite (checked from the encoded values, nothing decoded into an array),
    or they exceed the norm bound. ``slices``: a tensor may come as slices of its rows (a
    sharded site's), which must cover it exactly once; the norm and the checks cover every
    slice, so the bound is the whole update's."""
    try:
        pieces, norm = check_payload(payload, dict(shapes), slices=slices)
    except WireError as exc:
        return Refused(exc.code, exc.detail)
    if norm > max_norm:
        return Refused(ErrorCode.BAD_PAYLOAD, f"update norm {norm:.3g} > bound {max_norm:.3g}")
    return pieces, norm


def refuse_slices(payload: Sequence[EncodedTensor], why: str) -> Refused | None:
    """A refusal naming the first tensor that comes in slices, to an aggregator that takes
    whole tensors only (``why``); None when every tensor comes whole."""
    for enc in payload:
        if enc.rows is not None:
            return Refused(ErrorCode.BAD_PAYLOAD, f"tensor {enc.name!r} comes in slices: {why}")
    return None


class _NoKeys:
    """Joins need nothing, rounds are never retried, closed rounds take late updates."""

    name = "aggregation"
    reveals = Revealed.EACH_UPDATE
    whole_rounds = False
    late_refusal = ""
    arrivals_time_training = True
    holds_updates = True

    def check_join(self, msg: Join) -> None:
        return None

    def joined(self, peer: bytes, msg: Join) -> None:
        return None

    def forget(self, site_id: str) -> None:
        return None

    def retry(
        self, round_id: int, fold: Fold, received: Sequence[str]
    ) -> tuple[tuple[tuple[str, ...], Fold] | None, str]:
        raise AssertionError("only whole rounds are retried")


# ---- the weighted mean ---------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One accepted update as a fold holds it until its round's result is taken: its weight
    and its encoded pieces by tensor, which are views of the bytes the transport reassembled
    (nothing decoded, nothing copied)."""

    site_id: str
    weight: float
    pieces: Mapping[str, Sequence[EncodedTensor]]
    shapes: Shapes
    norm: float = 0.0
    """Its L2 norm over every piece, as its check computed it."""

    @property
    def nbytes(self) -> int:
        return sum(enc.nbytes for p in self.pieces.values() for enc in p)


class HeldMean(Mapping[str, np.ndarray]):
    """The weighted mean of held updates, Σ w·x / Σ w, as a mapping whose tensors are folded
    one at a time when asked: a close never holds the whole mean, nor a sum of the model.

    A tensor is folded from each update's pieces (whole tensors, or slices of rows each at its
    rows), in the updates' order, straight into one float32 buffer of the largest tensor's
    size that every tensor reuses: the first update writes it (as ``0 + float32(w) * x``),
    each later one adds ``float32(w) * x`` to it rounded to float32, a bounded tile at a time
    (:func:`comm.wire.tensors.accumulate`), and the sum is divided by ``float32(Σ w)`` in
    place. A float32 sum depends on the order of its terms: whoever gives the updates fixes it
    (:class:`MeanFold`). The array handed out is that buffer: it holds the tensor until the
    next one is asked for (read it, or copy it, before). ``cpu_seconds`` is the CPU time of
    the folds so far (the thread's), ``folded`` how many tensors they folded."""

    def __init__(self, updates: Sequence[Held]) -> None:
        if not updates:
            raise ValueError("the mean of no updates")
        names = list(updates[0].pieces)
        for u in updates:
            if not (np.isfinite(u.weight) and u.weight > 0):
                raise ValueError(f"weight must be a positive number, got {u.weight}")
            if set(u.pieces) != set(names):
                raise ValueError("an update names other tensors than the first one")
        self._updates = tuple(updates)
        self._names = names
        self._shapes = {n: tuple(updates[0].shapes[n]) for n in names}
        self.weight = 0.0
        for u in updates:
            self.weight += u.weight
        self.cpu_seconds = 0.0
        self.folded = 0
        """Tensors folded so far (a tensor asked for twice is folded twice)."""
        self._buffer: npt.NDArray[np.float32] | None = None

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        if name not in self._shapes:
            raise KeyError(name)
        cpu = time.thread_time()
        shape = self._shapes[name]
        if self._buffer is None:
            largest = max(math.prod(s) for s in self._shapes.values())
            self._buffer = np.empty(largest, dtype=np.float32)
        flat = self._buffer[: math.prod(shape)]
        row = math.prod(shape[1:])
        for i, u in enumerate(self._updates):
            for enc in u.pieces[name]:
                at = enc.rows[0] * row if enc.rows is not None else 0
                accumulate(enc, flat[at : at + enc.numel], u.weight, fresh=i == 0)
        np.divide(flat, np.float32(self.weight), out=flat)
        self.folded += 1
        self.cpu_seconds += time.thread_time() - cpu
        return flat.reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class MeanResult:
    """The on-time updates' mean and each late round's, for the strategy's step."""

    updates: list[tuple[str, float, Mapping[str, np.ndarray]]]
    """(label, weight, the mean): a mean may be folded tensor by tensor (:class:`HeldMean`)."""

    @property
    def count(self) -> int:
        return len(self.updates)

    @property
    def fold_cpu_seconds(self) -> float:
        """CPU time its means spent folding held updates so far (the step asks for them)."""
        return sum(m.cpu_seconds for _, _, m in self.updates if isinstance(m, HeldMean))

    def step(
        self,
        strategy: Strategy,
        st: GlobalState,
        names: Sequence[str],
        *,
        downlink: str,
        inner_steps: int,
        final: bool,
        averaged: Collection[str],
        prepare: Callable[[], None] = _nothing,
    ) -> OuterStep:
        return outer_step(
            strategy,
            st,
            names,
            self.updates,
            downlink=downlink,
            inner_steps=inner_steps,
            final=final,
            averaged=averaged,
            prepare=prepare,
        )


_SUM_LIMIT = float(np.finfo(np.float32).max) / 2
"""What Σ w·‖x‖ over a round's updates must stay below (see :meth:`MeanFold.add`)."""


class MeanFold:
    """Updates checked from their encoded values and norm-bounded as they arrive, held as the
    encoded payloads they came as, and folded into their mean when the round's result is
    taken, tensor by tensor, in a canonical order whatever order they arrived in.

    An update is checked when it arrives (a refusal changes nothing) and then held: its pieces
    are the transport's reassembled bytes, so holding it costs what it weighed on the wire
    (the uplink codec's size) and nothing else. The result's mean (:class:`HeldMean`) folds
    each tensor from every held update when the step asks for it, in the canonical order: the
    round's participants by site id, then any other site by id. So the mean of a set of
    updates is the same bit for bit whichever order they arrived in, and an open round holds
    no float32 sum at all. Without participants (a closed round's late updates, which may come
    from any of them in any order) the order is by site id."""

    start_fields: Mapping[str, Any] = {}

    def __init__(self, max_norm: float, participants: Sequence[str] | None = None) -> None:
        self._max_norm = max_norm
        self._order = sorted(set(participants)) if participants is not None else []
        self._held: dict[str, Held] = {}
        self._bound = 0.0
        """Σ w·‖x‖ over the updates taken: a bound on every value of their sum."""

    def add(
        self, site_id: str, weight: float, payload: Sequence[EncodedTensor], shapes: Shapes
    ) -> Refused | str:
        checked = check_bounded(payload, shapes, self._max_norm, slices=True)
        if isinstance(checked, Refused):
            return checked
        if not (np.isfinite(weight) and weight > 0):
            return Refused(ErrorCode.BAD_PAYLOAD, f"update weight {weight} must be > 0")
        pieces, norm = checked
        # Every value of the float32 sum is at most Σ w·‖x‖ in magnitude (‖x‖ bounds each of
        # x's values): kept below half float32's largest, no product or sum overflows.
        bound = self._bound + weight * norm
        if not bound < _SUM_LIMIT:
            return Refused(
                ErrorCode.OUT_OF_RANGE,
                f"update weight {weight:.3g} times its norm {norm:.3g} would overflow the "
                f"round's float32 sum (limit {_SUM_LIMIT:.3g} over its updates)",
            )
        self._bound = bound
        self._held[site_id] = Held(site_id, weight, pieces, dict(shapes), norm)
        return f"norm={norm:.4g}"

    def squared_norm(self, site_id: str) -> float:
        norm = self._held[site_id].norm
        return norm * norm

    def leave_out(self, site_id: str) -> None:
        if self._held.pop(site_id, None) is None:
            return
        self._bound = 0.0
        for u in self.ordered():
            self._bound += u.weight * u.norm

    def ordered(self) -> list[Held]:
        """The updates held, in the canonical order: the participants' order, then any other
        site by id."""
        order = [s for s in self._order if s in self._held]
        order += sorted(set(self._held) - set(order))
        return [self._held[s] for s in order]

    @property
    def count(self) -> int:
        """Updates held."""
        return len(self._held)

    @property
    def weight(self) -> float:
        """Σ w over the updates held, added in the canonical order."""
        total = 0.0
        for u in self.ordered():
            total += u.weight
        return total

    def mean(self) -> HeldMean:
        """The mean of the updates held, folded tensor by tensor when asked (ValueError: none
        held)."""
        return HeldMean(self.ordered())

    def result(self, label: str, late: Sequence[Late]) -> RoundResult:
        """The mean of the on-time updates, and each late round's once, down-weighted by how
        many syncs of its fragment it missed (late updates of one round share that weight, so
        they come as one mean); each folded when the step reads it."""
        updates: list[tuple[str, float, Mapping[str, np.ndarray]]] = []
        if self._held:
            mean = self.mean()
            updates.append((f"round {label}", mean.weight, mean))
        for lf in late:
            assert isinstance(lf.fold, MeanFold)
            mean = lf.fold.mean()
            updates.append((f"late@{lf.origin}", mean.weight / lf.divisor, mean))
        return MeanResult(updates)

    @property
    def nbytes(self) -> int:
        """The encoded bytes of the updates held."""
        return sum(u.nbytes for u in self._held.values())


class WeightedMean(_NoKeys):
    """The plain weighted mean of the sites' updates."""

    name = "weighted mean"

    def __init__(self, max_update_norm: float = 1e6) -> None:
        self.max_update_norm = max_update_norm

    def fold(self, round_id: int, participants: Sequence[str]) -> Fold:
        return MeanFold(self.max_update_norm, participants)

    def late_fold(self) -> Fold:
        return MeanFold(self.max_update_norm)


def outer_step(
    strategy: Strategy,
    st: GlobalState,
    names: Sequence[str],
    updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
    *,
    downlink: str,
    inner_steps: int,
    final: bool,
    averaged: Collection[str],
    prepare: Callable[[], None] = _nothing,
) -> OuterStep:
    """The strategy's outer step over ``names`` from ``st`` (its residual carried in), the delta
    encoded for the sites, and the state they will hold: params plus the decoded delta, the
    difference to the exact result kept as the downlink residual.

    A strategy with a :meth:`~coordinator.strategies.base.OuterStrategy.tensor_step` is run a
    tensor at a time, in place: each tensor's exact result, delta, encoding and decoding are
    made and dropped in turn, and its params, momentum and residual are overwritten (``st``'s
    arrays become the new state's; ``prepare`` runs first, once everything that could refuse
    the step has been checked). Held besides the state: the encoded result, which is what the
    sites are sent, and a few temporaries of one tensor. Another strategy steps whole models
    (:func:`whole_model_step`)."""
    steps = getattr(strategy, "tensor_step", None)
    plan = steps(inner_steps=inner_steps, final=final) if callable(steps) else None
    if plan is None:  # new arrays: nothing changes in place, nothing to prepare
        return whole_model_step(
            strategy,
            st,
            names,
            updates,
            downlink=downlink,
            inner_steps=inner_steps,
            final=final,
            averaged=averaged,
        )
    ordered = _checked(st, names, updates)
    codec = get_codec(downlink)
    wanted = set(names)
    first = [k for k in ordered[0][2] if k in wanted]  # the gradient's order, as its norm sums
    prepare()
    encoded: dict[str, EncodedTensor] = {}
    squared = 0.0
    for k in first:
        theta, residual = st.params[k], st.residual[k]
        exact = theta + residual
        values = [(w, u[k]) for _, w, u in ordered]
        new, sq = plan.step(exact, st.momentum[k], values, statistics=k in averaged)
        del exact, values
        squared += sq
        enc = codec.encode(k, np.subtract(new, theta))
        np.add(theta, decode_tensors([enc])[k], out=theta)
        np.subtract(new, theta, out=residual)
        encoded[k] = enc
    stats = sum(1 for k in names if k in averaged)
    return OuterStep(
        st,
        tuple(encoded[k] for k in names),
        plan.rule(stats),
        float(np.sqrt(squared)),
        sum(int(st.params[k].size) for k in names),
        downlink=downlink,
    )


def _checked(
    st: GlobalState,
    names: Sequence[str],
    updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
) -> list[tuple[str, float, Mapping[str, np.ndarray]]]:
    """The updates in label order (site order, which fixes the float summation order), once
    everything a step in place relies on holds: ValueError otherwise, nothing changed."""
    if not updates:
        raise ValueError("an outer step of no updates")
    total = float(sum(w for _, w, _ in updates))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    for k in names:
        shape = st.params[k].shape
        if st.momentum[k].shape != shape or st.residual[k].shape != shape:
            raise ValueError(f"tensor {k!r}: the state's arrays differ in shape")
        for label, _, u in updates:
            if k not in u:
                raise ValueError(f"{label} has no tensor {k!r}")
    return sorted(updates, key=lambda u: u[0])


def whole_model_step(
    strategy: Strategy,
    st: GlobalState,
    names: Sequence[str],
    updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
    *,
    downlink: str,
    inner_steps: int,
    final: bool,
    averaged: Collection[str],
) -> OuterStep:
    """:func:`outer_step` of a strategy that steps whole models only (its ``outer_step``): the
    new params, momentum and residual are new arrays, ``st``'s are left as they were."""
    result = strategy.outer_step(
        {k: st.params[k] + st.residual[k] for k in names},
        {k: st.momentum[k] for k in names},
        list(updates),
        inner_steps=inner_steps,
        final=final,
        averaged=averaged,
    )
    delta = {k: result.params[k] - st.params[k] for k in names}
    encoded = tuple(encode_tensors(delta, get_codec(downlink)))
    decoded = decode_tensors(list(encoded))
    params, residual, momentum = dict(st.params), dict(st.residual), dict(st.momentum)
    for k in names:
        params[k] = st.params[k] + decoded[k]
        residual[k] = result.params[k] - params[k]
        momentum[k] = result.momentum[k]
    new = replace(st, params=params, momentum=momentum, residual=residual)
    numel = sum(int(v.size) for v in delta.values())
    return OuterStep(new, encoded, result.rule, result.outer_grad_norm, numel, downlink=downlink)


# ---- the sparse forward --------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardResult:
    """The round's updates as they arrived, with their weights: the broadcast forwards them."""

    parts: list[tuple[float, tuple[EncodedTensor, ...]]]

    @property
    def count(self) -> int:
        return len(self.parts)

    @property
    def fold_cpu_seconds(self) -> float:
        """Nothing is folded: the step decodes the updates as the sites do."""
        return 0.0

    def step(
        self,
        strategy: Strategy,
        st: GlobalState,
        names: Sequence[str],
        *,
        downlink: str,
        inner_steps: int,
        final: bool,
        averaged: Collection[str],
        prepare: Callable[[], None] = _nothing,
    ) -> OuterStep:
        return sparse_outer_step(
            as_ordered(strategy), st, names, self.parts, averaged=averaged, prepare=prepare
        )


class ForwardFold:
    """Updates checked as :class:`MeanFold` checks them and kept as they arrived."""

    start_fields: Mapping[str, Any] = {}

    def __init__(self, max_norm: float) -> None:
        self._max_norm = max_norm
        self.kept: dict[str, tuple[float, tuple[EncodedTensor, ...]]] = {}
        self._norms: dict[str, float] = {}

    def add(
        self, site_id: str, weight: float, payload: Sequence[EncodedTensor], shapes: Shapes
    ) -> Refused | str:
        refused = refuse_slices(payload, "the sparse broadcast forwards whole tensors")
        decoded = refused or check_bounded(payload, shapes, self._max_norm)
        if isinstance(decoded, Refused):
            return decoded
        self.kept[site_id] = (weight, tuple(payload))
        self._norms[site_id] = decoded[1]
        return f"norm={decoded[1]:.4g}"

    def squared_norm(self, site_id: str) -> float:
        norm = self._norms[site_id]
        return norm * norm

    def leave_out(self, site_id: str) -> None:
        self.kept.pop(site_id, None)
        self._norms.pop(site_id, None)

    def result(self, label: str, late: Sequence[Late]) -> RoundResult:
        """The on-time updates in site order, then each late one (by round, then site),
        down-weighted as :class:`MeanFold` weighs them."""
        parts = [self.kept[s] for s in sorted(self.kept)]
        for lf in late:
            assert isinstance(lf.fold, ForwardFold)
            for s in sorted(lf.fold.kept):
                weight, encoded = lf.fold.kept[s]
                parts.append((weight / lf.divisor, encoded))
        return ForwardResult(parts)

    @property
    def nbytes(self) -> int:
        return sum(enc.nbytes for _, part in self.kept.values() for enc in part)


class SparseForward(WeightedMean):
    """The sparse broadcast: the round's encoded updates forwarded, the step run on them."""

    name = "sparse forward"

    def fold(self, round_id: int, participants: Sequence[str]) -> Fold:
        return ForwardFold(self.max_update_norm)

    def late_fold(self) -> Fold:
        return ForwardFold(self.max_update_norm)


def sparse_outer_step(
    strategy: OrderedStep,
    st: GlobalState,
    names: Sequence[str],
    parts: Sequence[tuple[float, tuple[EncodedTensor, ...]]],
    *,
    averaged: Collection[str],
    prepare: Callable[[], None] = _nothing,
) -> OuterStep:
    """The strategy's ordered step over the round's encoded updates ``parts`` (weight, tensors),
    in their order, decoded as a site decodes the broadcast that forwards them: the sites compute
    the same parameters bit for bit, so there is no downlink residual to keep. Run a tensor at a
    time, in place (as :func:`outer_step`): each update's tensor is decoded when it is stepped,
    the params overwritten; the momentum is left as it is."""
    payload = tuple(enc for _, part in parts for enc in part)
    weights = tuple(w for w, _ in parts)
    split = split_parts(payload, weights)
    spec = {k: tuple(st.params[k].shape) for k in names}
    unknown = [enc.name for enc in split[0][1] if enc.name not in spec]
    if unknown:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"unknown tensors {unknown[:3]}")
    stepped = [enc.name for enc in split[0][1]]
    checked = [check_slices(part, {k: spec[k] for k in stepped}) for _, part in split]
    plan = strategy.ordered_tensor_step()
    prepare()
    squared = 0.0
    for k in stepped:
        values = [
            (w, decode_tensors(groups[k], {k: spec[k]})[k])
            for (w, _), groups in zip(split, checked, strict=True)
        ]
        new, sq = plan.step(st.params[k], st.momentum[k], values, statistics=k in averaged)
        del values
        squared += sq
        np.copyto(st.params[k], new)
    stats = sum(1 for k in stepped if k in averaged)
    rule = f"{plan.rule(stats)}; sparse broadcast of {len(parts)} update(s)"
    numel = sum(int(st.params[k].size) for k in stepped)
    return OuterStep(
        st,
        payload,
        rule,
        float(np.sqrt(squared)),
        numel,
        weights,
        strategy.lr,
        downlink="sparse",
    )
