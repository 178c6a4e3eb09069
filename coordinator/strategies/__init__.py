"""The outer strategies, by name: one module each, registered where it is defined.

A strategy is a class deriving from :class:`~coordinator.strategies.base.OuterStrategy`,
decorated with :func:`register`, in a module of this package (found by listing the package, so
adding one is adding its file). It declares what it is compatible with (``broadcasts``, and
what it ``needs`` to see of a round's updates, :class:`~coordinator.strategies.base.Revealed`)
and builds itself from
:class:`~coordinator.strategies.base.OuterSettings`. Everything that needs a strategy's name or
what it allows asks here: the coordinator's config validation and service, the demo's and the
benches' arguments and simulations.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TypeVar

from coordinator.strategies.base import (
    OuterSettings,
    OuterStrategy,
    Revealed,
    runs_sites_sparse_step,
)

__all__ = [
    "BROADCASTS",
    "CONFIG",
    "OuterSettings",
    "OuterStrategy",
    "Revealed",
    "Spelling",
    "build",
    "get",
    "help_text",
    "names",
    "problem",
    "register",
    "supporting",
    "unregister",
]

BROADCASTS = ("dense", "sparse")
"""Values of ``coordinator.broadcast``."""

_S = TypeVar("_S", bound=type[OuterStrategy])
_registry: dict[str, type[OuterStrategy]] = {}
_discovered = False


def register(cls: _S) -> _S:
    """Class decorator: make ``cls`` known by ``cls.name``. A second class of the same name is
    refused (a name selects one class, whatever imported first)."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__} declares no name")
    known = _registry.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"outer strategy {name!r} is registered twice: {known} and {cls}")
    for broadcast in cls.broadcasts:
        if broadcast not in BROADCASTS:
            raise ValueError(f"{name}: unknown broadcast {broadcast!r} (known: {BROADCASTS})")
    if "sparse" in cls.broadcasts and not runs_sites_sparse_step(cls):
        if not callable(getattr(cls, "ordered_step", None)):
            raise ValueError(f"{name} declares the sparse broadcast but has no ordered_step")
        raise ValueError(
            f"{name} declares the sparse broadcast with an ordered_step of its own: every site "
            "applies a sparse broadcast with comm.codecs.broadcast.sparse_step, so its state "
            "hash would differ from the coordinator's; derive from "
            "coordinator.strategies.base.SparseBroadcastStep and keep its ordered_step"
        )
    _registry[name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget the strategy ``name`` (a plug-in unloaded, a test's toy strategy)."""
    _registry.pop(name, None)


def _discover() -> None:
    """Import every module of this package once, so each registers its strategies."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def names() -> tuple[str, ...]:
    """The registered strategies' names, sorted."""
    _discover()
    return tuple(sorted(_registry))


def get(name: str) -> type[OuterStrategy]:
    """The class registered as ``name``; ``ValueError`` listing the known names otherwise."""
    _discover()
    cls = _registry.get(name)
    if cls is None:
        raise ValueError(f"unknown outer strategy {name!r}; known: {', '.join(names())}")
    return cls


def build(name: str, settings: OuterSettings) -> OuterStrategy:
    """The strategy ``name`` as ``settings`` configure it."""
    return get(name).from_settings(settings)


def supporting(
    *, broadcast: str | None = None, reveals: Revealed = Revealed.EACH_UPDATE
) -> list[str]:
    """Names of the strategies that can send by ``broadcast`` (None: any) and see enough of a
    round whose aggregation ``reveals`` this much."""
    return [
        n
        for n in names()
        if (broadcast is None or broadcast in _registry[n].broadcasts)
        and reveals.covers(_registry[n].needs)
    ]


def help_text() -> str:
    """``name: summary; ...`` for a command's help."""
    return "; ".join(f"{n}: {_registry[n].summary}" for n in names())


@dataclass(frozen=True)
class Spelling:
    """How a consumer's messages name its settings: the config's ``coordinator.broadcast =
    'sparse'`` or a command line's ``--broadcast sparse``."""

    strategy: str = "coordinator.outer_strategy"
    broadcast: str = "coordinator.broadcast"
    sum_only: str = "the aggregation"
    """The setting under which rounds reveal only the sum of their updates
    (:attr:`Revealed.SUM`), named when a strategy needs more."""
    sum_only_words: str = ""
    """The same in words, for "turn ... off" (empty: ``sum_only``)."""
    command_line: bool = False

    def setting(self, key: str, value: str) -> str:
        return f"{key} {value}" if self.command_line else f"{key} = {value!r}"


CONFIG = Spelling()
"""The coordinator's TOML keys for the strategy and the broadcast (the config adds the key under
which rounds reveal only sums)."""


def problem(
    name: str,
    *,
    broadcast: str = "dense",
    reveals: Revealed = Revealed.EACH_UPDATE,
    spelling: Spelling = CONFIG,
) -> str | None:
    """What is wrong with running strategy ``name`` with ``broadcast`` on rounds whose
    aggregation ``reveals`` this much of their updates, in ``spelling``'s words; None: nothing.
    The one place these are checked."""
    _discover()
    cls = _registry.get(name)
    if cls is None:
        return f"{spelling.strategy} must be one of {', '.join(names())}, got {name!r}"
    if broadcast not in BROADCASTS:
        choices = " or ".join(repr(b) for b in BROADCASTS)
        return f"{spelling.broadcast} must be {choices}, got {broadcast!r}"
    if not reveals.covers(cls.needs):
        alternatives = " or ".join(repr(n) for n in supporting(reveals=reveals))
        return (
            f"{spelling.setting(spelling.strategy, name)} cannot run with {spelling.sum_only}: "
            f"it needs {cls.needs.value} ({cls.why_each_update}), and {spelling.sum_only} "
            f"reveals {reveals.value}; use {alternatives} or turn "
            f"{spelling.sum_only_words or spelling.sum_only} off"
        )
    if broadcast not in cls.broadcasts:
        able = " or ".join(
            spelling.setting(spelling.strategy, n) for n in supporting(broadcast=broadcast)
        )
        return (
            f"{spelling.setting(spelling.broadcast, broadcast)} needs {able} (got {name!r}): "
            f"{cls.why_not_other_broadcasts}"
        )
    return None
