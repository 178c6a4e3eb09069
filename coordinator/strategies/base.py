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
    if not updates:
        raise ValueError("weighted_mean of no updates")
    total = float(sum(w for w, _ in updates))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    names = list(updates[0][1])
    out: Arrays = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][1][name]), dtype=np.float32)
        for weight, tensors in updates:
            acc += np.float32(weight / total) * np.asarray(tensors[name], dtype=np.float32)
        out[name] = acc
    return out


def nesterov_step(
    params: Mapping[str, np.ndarray],
    grad: Mapping[str, np.ndarray],
    momentum_buf: Mapping[str, np.ndarray],
    *,
    lr: float,
    momentum: float,
) -> tuple[Arrays, Arrays]:
    """One SGD-Nesterov step: b ← μb + g; θ ← θ − lr (g + μb). Returns (θ', b')."""
    lr32, mu32 = np.float32(lr), np.float32(momentum)
    new_params: Arrays = {}
    new_buf: Arrays = {}
    for name, p in params.items():
        g = np.asarray(grad[name], dtype=np.float32)
        b = (mu32 * np.asarray(momentum_buf[name], dtype=np.float32) + g).astype(np.float32)
        new_buf[name] = b
        step = (lr32 * (g + mu32 * b)).astype(np.float32)
        new_params[name] = np.asarray(p, dtype=np.float32) - step
    return new_params, new_buf


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
