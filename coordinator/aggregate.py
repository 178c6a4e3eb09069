"""Aggregators: how a round's updates are checked, folded as they land, and turned into the
outer step and what the sites are sent.

One :class:`Aggregator` is chosen when the federation is assembled; each round folds its
updates through a :class:`Fold` the aggregator gives it, and at its close
:meth:`Fold.result` hands the strategy what it merges (:class:`RoundResult`). Two live here:

- :class:`WeightedMean`: each update checked from its encoded values (finite, within the norm
  bound over all its pieces, a sharded site's slices included) and decoded block by block
  straight into a float32 :class:`RunningSum`, each piece at its rows: no float copy of an
  update is ever made, and memory is one float32 sum per open round whatever the number of
  sites, plus the encoded bytes of updates waiting for their turn (:class:`MeanFold`). The
  strategy steps on the weighted mean and the step's delta
  goes down through the downlink codec, the difference to the exact result kept as the
  downlink residual (:func:`outer_step`).
- :class:`SparseForward`: the same checks (whole tensors only), but the updates are kept as they
  arrived and the broadcast forwards them with their weights; the strategy's ordered step (a
  strategy declaring the sparse broadcast provides one,
  :class:`~coordinator.strategies.base.OrderedStep`) runs on them decoded as a site decodes that
  broadcast, so every site lands on the coordinator's parameters bit for bit
  (:func:`sparse_outer_step`).

Late updates (their round closed) fold into a second fold of their round, merged at their
fragment's next sync, down-weighted by the syncs they missed. Sums are float32 (4 bytes a
parameter), and a float32 sum depends on the order of its terms, so a fold adds its updates in
a canonical order, the participants' by site id, whatever order they arrive in (late ones by
site id when they are merged): the same updates give the same mean bit for bit, run after run.
"""

from __future__ import annotations

import math
import weakref
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


class RunningSum:
    """Σ w·x per tensor (float32, added in place) and Σ w, over the updates added so far.

    The sum of a tensor is one float32 array of its shape, written by the first update that
    names it (as ``0 + float32(w) * x``); each later one adds ``float32(w) * x`` to it, rounded
    to float32, a bounded tile at a time (:func:`comm.wire.tensors.accumulate` from the encoded
    update, :meth:`add` from arrays): nothing of the model's size is allocated per update. A
    float32 sum depends on the order the updates are added in: whoever adds them fixes that
    order (:class:`MeanFold`).

    With a ``pool`` the arrays come from it and go back to it once this sum is dropped, so the
    next round's sum reuses them instead of faulting in fresh pages. The arrays are this sum's
    own: it hands out only new arrays (:meth:`tensor_mean`)."""

    def __init__(self, pool: SumPool | None = None) -> None:
        self._sum: dict[str, npt.NDArray[np.float32]] = {}
        self.weight = 0.0
        self.count = 0
        self._pool = pool
        if pool is not None:
            weakref.finalize(self, pool.give, self._sum)

    def _check(self, weight: float, names: Collection[str]) -> None:
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a positive number, got {weight}")
        if self._sum and set(names) != set(self._sum):
            raise ValueError("an update names other tensors than the ones summed so far")

    def _acc(self, name: str, shape: tuple[int, ...]) -> tuple[npt.NDArray[np.float32], bool]:
        """The sum of ``name``, and whether it is new: allocated, not zeroed (the first update
        writes it, which costs a third of reading fresh zero pages and writing them again)."""
        acc = self._sum.get(name)
        if acc is not None:
            return acc, False
        acc = self._pool.take(shape) if self._pool is not None else None
        if acc is None:
            acc = np.empty(shape, dtype=np.float32)
        self._sum[name] = acc
        return acc, True

    def add(self, weight: float, tensors: Mapping[str, np.ndarray]) -> None:
        """Fold one update held as arrays in; its tensors may be freed afterwards. The same
        float32 arithmetic as :meth:`add_encoded` on their encodings' decode."""
        self._check(weight, tensors)
        w = np.float32(weight)
        for name, value in tensors.items():
            src = np.asarray(value).reshape(-1)
            acc, fresh = self._acc(name, tuple(np.shape(value)))
            flat = acc.reshape(-1)
            step = _TILE
            tile = np.empty(min(step, flat.size), dtype=np.float32)
            for a in range(0, flat.size, step):
                t = tile[: min(step, flat.size - a)]
                np.multiply(src[a : a + t.size], w, out=t, dtype=np.float32, casting="unsafe")
                if fresh:
                    np.add(t, np.float32(0.0), out=flat[a : a + t.size])  # as 0 + w·x
                else:
                    flat[a : a + t.size] += t
        self.weight += weight
        self.count += 1

    def add_encoded(
        self, weight: float, pieces: Mapping[str, Sequence[EncodedTensor]], shapes: Shapes
    ) -> None:
        """Fold one update in from its encoded pieces (whole tensors, or slices of rows each
        added at its rows), already checked (:func:`comm.wire.tensors.check_payload`: the
        slices cover each tensor exactly once): each is decoded block by block straight into
        the sum."""
        self._check(weight, pieces)
        for name, encs in pieces.items():
            shape = tuple(shapes[name])
            acc, fresh = self._acc(name, shape)
            flat = acc.reshape(-1)
            row = math.prod(shape[1:])
            for enc in encs:
                at = enc.rows[0] * row if enc.rows is not None else 0
                accumulate(enc, flat[at : at + enc.numel], weight, fresh=fresh)
        self.weight += weight
        self.count += 1

    def mean(self) -> Arrays:
        """Σ w·x / Σ w per tensor, as float32."""
        if not self.count:
            raise ValueError("the mean of no updates")
        return {n: self.tensor_mean(n) for n in self._sum}

    def tensor_mean(self, name: str) -> npt.NDArray[np.float32]:
        """One tensor of :meth:`mean`, computed alone: a new float32 array of its shape."""
        if not self.count:
            raise ValueError("the mean of no updates")
        return np.divide(self._sum[name], np.float32(self.weight))

    @property
    def names(self) -> list[str]:
        """The tensors summed, in the order they were first added."""
        return list(self._sum)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._sum.values())


_TILE = 1 << 16
"""Values per tile where arrays are added to a sum (256 KiB of float32, in cache)."""


class SumPool:
    """Float32 arrays that running sums let go of, by shape, for the next sums to reuse: a
    round's sum then writes into memory already mapped instead of faulting in fresh pages (which
    cost the first update of every round more than its fold here). It keeps at most the bytes of
    the largest set one sum gave back, so at rest it holds one sum's worth."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, ...], list[npt.NDArray[np.float32]]] = {}
        self.nbytes = 0
        self._cap = 0

    def take(self, shape: tuple[int, ...]) -> npt.NDArray[np.float32] | None:
        """An array of ``shape`` (its values stale), or None."""
        free = self._free.get(tuple(shape))
        if not free:
            return None
        arr = free.pop()
        self.nbytes -= arr.nbytes
        return arr

    def give(self, arrays: Mapping[str, npt.NDArray[np.float32]]) -> None:
        """A dropped sum's arrays, kept while the pool stays within its bound."""
        self._cap = max(self._cap, sum(a.nbytes for a in arrays.values()))
        for arr in arrays.values():
            if self.nbytes + arr.nbytes <= self._cap:
                self._free.setdefault(tuple(arr.shape), []).append(arr)
                self.nbytes += arr.nbytes


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


class SumMean(Mapping[str, np.ndarray]):
    """A running sum's mean as a mapping whose tensors are computed one at a time when asked
    (:meth:`RunningSum.tensor_mean`): a close never holds the whole mean."""

    def __init__(self, total: RunningSum) -> None:
        self._total = total
        self._names = total.names

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        if name not in self._names:
            raise KeyError(name)
        return self._total.tensor_mean(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class MeanResult:
    """The on-time updates' running mean and each late round's, for the strategy's step."""

    updates: list[tuple[str, float, Mapping[str, np.ndarray]]]
    """(label, weight, the mean): a mean may be computed tensor by tensor (:class:`SumMean`)."""

    @property
    def count(self) -> int:
        return len(self.updates)

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
    """Updates checked from their encoded values, norm-bounded and folded into one float32
    running sum, in a canonical order whatever order they arrive in.

    The order is the round's participants by site id. An update is checked when it arrives
    (a refusal changes nothing) and folded as soon as every update before it in that order was
    folded; one that arrived ahead of its turn waits as the encoded payload it came as (the
    transport's bytes, bounded by the message size limit) until its predecessors are folded or
    the round's result is taken, which folds what waits in the same order, passing over the
    participants that sent nothing. So the sum, and the mean, of a set of updates is the same
    bit for bit whichever order they arrived in. Without participants (a closed round's late
    updates, which may come from any of them in any order) every update waits until the result
    is taken and they are folded by site id."""

    start_fields: Mapping[str, Any] = {}

    def __init__(
        self,
        max_norm: float,
        participants: Sequence[str] | None = None,
        pool: SumPool | None = None,
    ) -> None:
        self._max_norm = max_norm
        self.sum = RunningSum(pool)
        self._order = sorted(set(participants)) if participants is not None else []
        self._turn = 0
        """Index in ``_order`` of the next update to fold (while it has not arrived, every
        later one waits)."""
        self._waiting: dict[str, tuple[float, dict[str, list[EncodedTensor]], Shapes]] = {}
        self._bound = 0.0
        """Σ w·‖x‖ over the updates taken: a bound on every value of the sum."""

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
        self._waiting[site_id] = (weight, pieces, dict(shapes))
        while self._turn < len(self._order) and self._order[self._turn] in self._waiting:
            self._fold(self._order[self._turn])
            self._turn += 1
        return f"norm={norm:.4g}"

    def _fold(self, site_id: str) -> None:
        weight, pieces, shapes = self._waiting.pop(site_id)
        self.sum.add_encoded(weight, pieces, shapes)

    def fold_waiting(self) -> None:
        """Fold every update still waiting for its turn, in the canonical order: the
        participants' order, then any other site by id."""
        rest = [s for s in self._order[self._turn :] if s in self._waiting]
        rest += sorted(set(self._waiting) - set(rest))
        for site_id in rest:
            self._fold(site_id)
        self._turn = len(self._order)

    def result(self, label: str, late: Sequence[Late]) -> RoundResult:
        """The running mean of the on-time updates, and each late round's once, down-weighted
        by how many syncs of its fragment it missed (late updates of one round share that
        weight, so they come as one mean)."""
        self.fold_waiting()
        updates: list[tuple[str, float, Mapping[str, np.ndarray]]] = []
        if self.sum.count:
            updates.append((f"round {label}", self.sum.weight, SumMean(self.sum)))
        for lf in late:
            assert isinstance(lf.fold, MeanFold)
            lf.fold.fold_waiting()
            updates.append(
                (f"late@{lf.origin}", lf.fold.sum.weight / lf.divisor, SumMean(lf.fold.sum))
            )
        return MeanResult(updates)

    @property
    def nbytes(self) -> int:
        """The sum's bytes and the encoded bytes of the updates waiting for their turn."""
        waiting = sum(
            enc.nbytes
            for _, pieces, _ in self._waiting.values()
            for p in pieces.values()
            for enc in p
        )
        return self.sum.nbytes + waiting


class WeightedMean(_NoKeys):
    """The plain weighted mean of the sites' updates."""

    name = "weighted mean"

    def __init__(self, max_update_norm: float = 1e6) -> None:
        self.max_update_norm = max_update_norm
        self.sums = SumPool()
        """The arrays of closed rounds' sums, which the next rounds' sums reuse."""

    def fold(self, round_id: int, participants: Sequence[str]) -> Fold:
        return MeanFold(self.max_update_norm, participants, self.sums)

    def late_fold(self) -> Fold:
        return MeanFold(self.max_update_norm, pool=self.sums)


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

    def add(
        self, site_id: str, weight: float, payload: Sequence[EncodedTensor], shapes: Shapes
    ) -> Refused | str:
        refused = refuse_slices(payload, "the sparse broadcast forwards whole tensors")
        decoded = refused or check_bounded(payload, shapes, self._max_norm)
        if isinstance(decoded, Refused):
            return decoded
        self.kept[site_id] = (weight, tuple(payload))
        return f"norm={decoded[1]:.4g}"

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
