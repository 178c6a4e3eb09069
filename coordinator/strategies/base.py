"""What an outer strategy is: the contract, the settings it is built from, and the shared math.

DiLoCo (Douillard et al., 2023): the outer gradient is the token-weighted mean of the sites'
pseudo-gradients Δ_s = θ_t − θ_s, then an outer optimizer step. Every strategy is float32 and
iterates sites in a fixed order, so the same inputs give bit-identical outputs.

A strategy is a class deriving from :class:`OuterStrategy`: it declares its ``name`` (the value
of ``coordinator.outer_strategy``), which broadcasts it can be paired with and what it needs to
see of a round's updates (:class:`Revealed`), and builds itself from :class:`OuterSettings`. The
registry (:mod:`coordinator.strategies`) finds it by name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol, Self, cast

import numpy as np
import numpy.typing as npt

from comm.codecs.broadcast import sparse_step

Arrays = dict[str, npt.NDArray[np.float32]]


def weighted_mean(updates: Sequence[tuple[float, Mapping[str, np.ndarray]]]) -> Arrays:
    """Σ w_i x_i / Σ w_i per tensor, accumulated in float32 in the given order."""
    total = _total_weight(updates)
    return {
        name: mean_of_tensor([(w, t[name]) for w, t in updates], total) for name in updates[0][1]
    }


def _total_weight(updates: Sequence[tuple[float, object]]) -> float:
    if not updates:
        raise ValueError("weighted_mean of no updates")
    total = float(sum(w for w, _ in updates))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    return total


def mean_of_tensor(
    values: Sequence[tuple[float, np.ndarray]], total: float | None = None
) -> npt.NDArray[np.float32]:
    """One tensor's Σ w_i x_i / Σ w_i, accumulated in float32 in the given order (``total``:
    Σ w_i, when the caller has it)."""
    if total is None:
        total = _total_weight(values)
    acc = np.zeros(np.shape(values[0][1]), dtype=np.float32)
    for weight, value in values:
        acc += np.float32(weight / total) * np.asarray(value, dtype=np.float32)
    return acc


def nesterov_step(
    params: Mapping[str, np.ndarray],
    grad: Mapping[str, np.ndarray],
    momentum_buf: Mapping[str, np.ndarray],
    *,
    lr: float,
    momentum: float,
) -> tuple[Arrays, Arrays]:
    """One SGD-Nesterov step: b ← μb + g; θ ← θ − lr (g + μb). Returns (θ', b')."""
    new_params: Arrays = {}
    new_buf: Arrays = {}
    for name, p in params.items():
        buf = np.array(momentum_buf[name], dtype=np.float32)
        new_params[name] = nesterov_in_place(p, grad[name], buf, lr=lr, momentum=momentum)
        new_buf[name] = buf
    return new_params, new_buf


def nesterov_in_place(
    param: np.ndarray, grad: np.ndarray, buf: npt.NDArray[np.float32], *, lr: float, momentum: float
) -> npt.NDArray[np.float32]:
    """One tensor's SGD-Nesterov step with its buffer updated in place: b ← μb + g; returns
    θ − lr (g + μb). The float32 operations of :func:`nesterov_step`, element for element."""
    lr32, mu32 = np.float32(lr), np.float32(momentum)
    g = np.asarray(grad, dtype=np.float32)
    np.multiply(buf, mu32, out=buf)
    np.add(buf, g, out=buf)
    step = mu32 * buf
    np.add(g, step, out=step)
    np.multiply(step, lr32, out=step)
    np.subtract(np.asarray(param, dtype=np.float32), step, out=step)
    return step


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(t.ravel(), t.ravel())) for t in tensors.values())))


class Revealed(Enum):
    """What a round's aggregation lets the outer step see of the round's updates. A strategy
    declares what it ``needs``, an aggregator what it ``reveals``; the registry's ``problem``
    compares the two for a configuration."""

    SUM = "only the sum of the updates"
    """Their weighted sum, nothing of each one."""
    EACH_UPDATE = "each update as its site encoded it"
    """Every update, as it came off the wire (and so their sum too)."""

    def covers(self, needed: Revealed) -> bool:
        """Whether an aggregation revealing this gives a strategy that needs ``needed``
        enough."""
        return self is Revealed.EACH_UPDATE or needed is Revealed.SUM


@dataclass(frozen=True)
class OuterResult:
    params: Arrays
    momentum: Arrays
    outer_grad_norm: float
    rule: str = ""
    """How the step was taken, for logs and round history."""


class TensorStep(Protocol):
    """One close's outer step taken a tensor at a time (the step is elementwise), so that a
    coordinator never holds a second copy of the model: what a strategy's ``tensor_step``
    gives, and ``coordinator.aggregate.outer_step`` runs over the round's tensors."""

    def rule(self, statistics: int) -> str:
        """How the step was taken, for logs and round history (``statistics``: how many of
        the stepped tensors are statistics, stepped by their plain mean)."""
        ...

    def step(
        self,
        exact: npt.NDArray[np.float32],
        momentum: npt.NDArray[np.float32],
        updates: Sequence[tuple[float, np.ndarray]],
        *,
        statistics: bool,
    ) -> tuple[npt.NDArray[np.float32], float]:
        """One tensor's new exact value from ``exact`` (the parameters plus the downlink
        residual; the caller's temporary, which the step may overwrite), its outer momentum
        (updated in place) and the round's ``updates`` of it (weight, value) in the order of
        their labels (which fixes the float summation order); with the squared norm of its
        outer gradient.
        ``statistics``: a statistics tensor, always the plain mean."""
        ...


@dataclass(frozen=True)
class NesterovTensors:
    """DiLoCo's step per tensor: the weighted mean, then SGD-Nesterov (statistics tensors:
    lr 1, no momentum), the arithmetic of :func:`weighted_mean` and :func:`nesterov_step`."""

    lr: float
    momentum: float
    base_rule: str

    def rule(self, statistics: int) -> str:
        if statistics:
            return f"{self.base_rule}; {statistics} statistics tensors: mean"
        return self.base_rule

    def step(
        self,
        exact: npt.NDArray[np.float32],
        momentum: npt.NDArray[np.float32],
        updates: Sequence[tuple[float, np.ndarray]],
        *,
        statistics: bool,
    ) -> tuple[npt.NDArray[np.float32], float]:
        grad = mean_of_tensor(updates)
        lr, mu = (1.0, 0.0) if statistics else (self.lr, self.momentum)
        new = nesterov_in_place(exact, grad, momentum, lr=lr, momentum=mu)
        return new, _squared_norm(grad)


@dataclass(frozen=True)
class SgdTensors:
    """The sparse broadcast's step per tensor, θ − lr · (weighted mean), statistics tensors at
    lr 1, no momentum: the arithmetic of ``comm.codecs.broadcast.sparse_step``."""

    lr: float
    base_rule: str

    def rule(self, statistics: int) -> str:
        return f"{self.base_rule}; statistics tensors: mean" if statistics else self.base_rule

    def step(
        self,
        exact: npt.NDArray[np.float32],
        momentum: npt.NDArray[np.float32],
        updates: Sequence[tuple[float, np.ndarray]],
        *,
        statistics: bool,
    ) -> tuple[npt.NDArray[np.float32], float]:
        acc = mean_of_tensor(updates)
        step_lr = np.float32(1.0 if statistics else self.lr)
        new = (np.asarray(exact, dtype=np.float32) - step_lr * acc).astype(np.float32)
        return new, _squared_norm(acc)


def _squared_norm(t: np.ndarray) -> float:
    """The term :func:`global_norm` sums for one tensor."""
    return float(np.dot(t.ravel(), t.ravel()))


def tensorwise_outer_step(
    steps: TensorStep,
    params: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    weighted: Sequence[tuple[float, Mapping[str, np.ndarray]]],
    averaged: Collection[str],
) -> OuterResult:
    """``steps`` over whole models, changing none of the inputs: the outer step as a function
    (:meth:`Strategy.outer_step`), the same arithmetic as a close's tensor by tensor."""
    _total_weight(weighted)
    new_params: Arrays = {}
    new_buf: Arrays = {}
    squared = 0.0
    for name in weighted[0][1]:  # the gradient's order, as global_norm sums it
        if name not in params:
            continue
        buf = np.array(momentum[name], dtype=np.float32)
        exact = np.array(params[name], dtype=np.float32)
        values = [(w, t[name]) for w, t in weighted]
        new_params[name], sq = steps.step(exact, buf, values, statistics=name in averaged)
        new_buf[name] = buf
        squared += sq
    stats = sum(1 for k in params if k in averaged)
    ordered = {k: new_params[k] for k in params}
    buffers = {k: new_buf[k] for k in params}
    return OuterResult(ordered, buffers, float(np.sqrt(squared)), steps.rule(stats))


class OrderedStep(Protocol):
    """What the sparse broadcast needs of its strategy: the step over the updates in the order
    given, the broadcast's, which each site re-runs on the forwarded updates to land on the
    coordinator's parameters bit for bit, and the learning rate the broadcast carries for that
    step. The sites run one step only (``comm.codecs.broadcast.sparse_step``), so the one
    implementation is :class:`SparseBroadcastStep`'s."""

    @property
    def lr(self) -> float: ...

    def ordered_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        weighted: Sequence[tuple[float, Mapping[str, np.ndarray]]],
        *,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """The step over ``weighted`` (weight, update), in the order given."""
        ...

    def ordered_tensor_step(self) -> TensorStep:
        """:meth:`ordered_step` a tensor at a time."""
        ...


class SparseBroadcastStep:
    """The sparse broadcast's step, as every site runs it on the forwarded updates:
    θ ← θ − lr · (their weighted mean), :func:`comm.codecs.broadcast.sparse_step` itself, no
    momentum (the buffer passes through unchanged), statistics tensors at lr 1.

    A strategy declaring the ``sparse`` broadcast derives from this and keeps its
    ``ordered_step``: the sites know no other step, so any other would leave every site's
    state hash differing from the coordinator's (the registry refuses such a strategy,
    :func:`runs_sites_sparse_step`). The strategy provides ``lr``."""

    lr: float

    def ordered_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        weighted: Sequence[tuple[float, Mapping[str, np.ndarray]]],
        *,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """The step over ``weighted`` (weight, update) in the order given: the arithmetic a site
        runs on a sparse broadcast, whose order is the broadcast's."""
        new_params = sparse_step(params, weighted, lr=self.lr, averaged=averaged)
        grad = weighted_mean(weighted)
        rule = f"sparse sgd lr={self.lr:g} (no momentum)"
        if any(k in averaged for k in params):
            rule += "; statistics tensors: mean"
        buf: Arrays = {k: np.asarray(v, dtype=np.float32) for k, v in momentum.items()}
        return OuterResult(new_params, buf, global_norm(grad), rule)

    def ordered_tensor_step(self) -> TensorStep:
        """:meth:`ordered_step` a tensor at a time (the same arithmetic)."""
        return SgdTensors(self.lr, f"sparse sgd lr={self.lr:g} (no momentum)")


def runs_sites_sparse_step(cls: type) -> bool:
    """Whether ``cls``'s ordered step is the one the sites run on a sparse broadcast
    (:class:`SparseBroadcastStep`'s, not overridden)."""
    return getattr(cls, "ordered_step", None) is SparseBroadcastStep.ordered_step


def as_ordered(strategy: object) -> OrderedStep:
    """``strategy`` as the sparse broadcast runs it: one declaring the ``sparse`` broadcast
    and running the sites' step (:class:`SparseBroadcastStep`); ``TypeError`` for any other."""
    name = type(strategy).__name__
    if "sparse" not in getattr(strategy, "broadcasts", ()):
        raise TypeError(f"{name} does not declare the sparse broadcast")
    if not runs_sites_sparse_step(type(strategy)):
        raise TypeError(f"{name} does not run the step the sites run on a sparse broadcast")
    return cast(OrderedStep, strategy)


class Strategy(Protocol):
    """Turns accepted updates into the next exact global parameters."""

    def outer_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
        *,
        inner_steps: int | None = None,
        final: bool = False,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """``inner_steps``: inner steps behind the model this step produces (None: unknown);
        ``final``: no round will start from this model (the run's last step of these tensors);
        ``averaged``: tensors that are statistics, not weights (BatchNorm's running mean and
        variance): always the plain mean, never extrapolated by momentum (a variance could
        turn negative)."""
        ...


@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer's settings as the configuration gives them (``coordinator.outer_lr``,
    ``outer_momentum``, ``outer_warmup_steps``); each strategy takes the ones it uses."""

    lr: float = 0.7
    momentum: float = 0.9
    warmup_steps: int = 0


class OuterStrategy:
    """Base of every registered outer strategy: what it declares, and how it is built.

    Subclasses are frozen dataclasses implementing :class:`Strategy`'s ``outer_step``; the class
    attributes below are read by the registry, never compared by name elsewhere.
    """

    name: ClassVar[str]
    """The value of ``coordinator.outer_strategy`` (and of the demo's and benches' flags)."""
    summary: ClassVar[str]
    """One line for a command's help."""
    broadcasts: ClassVar[frozenset[str]] = frozenset({"dense"})
    """Broadcasts (``coordinator.broadcast``) the strategy's result can be sent by: ``dense``
    (the outer delta through the downlink codec) and/or ``sparse`` (the round's encoded updates
    forwarded, each site re-running the step on them: a strategy declaring it derives from
    :class:`SparseBroadcastStep` and keeps its ``ordered_step``)."""
    why_not_other_broadcasts: ClassVar[str] = ""
    """Why a broadcast outside ``broadcasts`` is refused, for the message naming it."""
    keeps_momentum: ClassVar[bool] = True
    """Whether the step writes the outer momentum buffer (one float32 per parameter the
    coordinator keeps); False: the buffer passes through untouched, its zeros never take
    memory (``coordinator.memory.state_bytes_per_param``)."""
    needs: ClassVar[Revealed] = Revealed.SUM
    """What the strategy needs to see of a round's updates: their weighted sum is enough for a
    step on their mean; ``EACH_UPDATE``: the updates must reach the coordinator as their sites
    encoded them, so the strategy cannot run where rounds reveal only their sum."""
    why_each_update: ClassVar[str] = ""
    """Why it needs each update, for the message refusing an aggregation that reveals less."""

    @classmethod
    def from_settings(cls, settings: OuterSettings) -> Self:
        """The strategy as ``settings`` configure it."""
        raise NotImplementedError

    def outer_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
        *,
        inner_steps: int | None = None,
        final: bool = False,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """See :class:`Strategy`."""
        raise NotImplementedError

    def tensor_step(self, *, inner_steps: int | None, final: bool) -> TensorStep | None:
        """The step of one close (``inner_steps``, ``final``: as :meth:`outer_step` takes
        them) taken a tensor at a time, which a coordinator runs in place on its state; None:
        the strategy steps whole models only (:meth:`outer_step`, which then costs a copy of
        the model at every close)."""
        return None
