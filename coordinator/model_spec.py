"""What a federation's model looks like to the coordinator, and how a joining site's differs.

The coordinator never imports a job: it knows the model as the names, shapes and dtypes a site
declared at its join (``capabilities["state_spec"]``, with the job's factory as
``capabilities["job"]``), or, after a restart, as the names and shapes of the tensors it holds.
:func:`first_difference` turns a fingerprint mismatch into a sentence naming what differs, and
:func:`averaged_difference` the tensors two sites would average differently (the first join
declares the federation's list, ``averaged``; a later one declaring another is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str | None
    """None where unknown (the coordinator's own arrays are float32 whatever the site's are)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as named tensors in order, and the job that builds it (when known)."""

    tensors: tuple[TensorSpec, ...]
    job: str | None = None
    averaged: frozenset[str] = frozenset()
    """Tensors that are statistics (floating-point buffers): averaged, never extrapolated."""


def spec_from_capabilities(capabilities: Mapping[str, Any]) -> ModelSpec | None:
    """The spec a site declared at its join; None when it declared none or a malformed one
    (the spec is only ever used to explain a refusal, so a bad one costs only the detail)."""
    raw = capabilities.get("state_spec")
    job = capabilities.get("job")
    if not isinstance(raw, list):
        return None
    tensors = []
    for item in raw:
        if not (isinstance(item, list | tuple) and len(item) == 3):
            return None
        name, shape, dtype = item
        if not (
            isinstance(name, str)
            and isinstance(shape, list | tuple)
            and all(isinstance(d, int) for d in shape)
            and isinstance(dtype, str)
        ):
            return None
        tensors.append(TensorSpec(name, tuple(shape), dtype))
    raw_averaged = capabilities.get("averaged", [])
    averaged = frozenset(
        n for n in (raw_averaged if isinstance(raw_averaged, list) else []) if isinstance(n, str)
    )
    return ModelSpec(tuple(tensors), job if isinstance(job, str) else None, averaged)


def spec_from_params(params: Mapping[str, np.ndarray]) -> ModelSpec:
    return ModelSpec(tuple(TensorSpec(n, tuple(a.shape), None) for n, a in params.items()))


def averaged_difference(site: ModelSpec, federation: ModelSpec) -> str | None:
    """None when ``site`` averages the same tensors as ``federation``, else a clause naming the
    first that differs. Both sides must agree: the outer step averages these (a site applies a
    sparse broadcast with its own list), so one site's list may not decide for the others."""
    if site.averaged == federation.averaged:
        return None
    extra, missing = (
        sorted(site.averaged - federation.averaged),
        sorted(federation.averaged - site.averaged),
    )
    if extra:
        return f"the site averages {extra[0]!r}, which the federation steps as a weight"
    return f"the federation averages {missing[0]!r}, which the site steps as a weight"


def first_difference(site: ModelSpec, federation: ModelSpec) -> str:
    """The first way ``site`` differs from ``federation``, as a clause of an error message."""
    mine = {t.name: t for t in site.tensors}
    theirs = {t.name: t for t in federation.tensors}
    for t in federation.tensors:
        other = mine.get(t.name)
        if other is None:
            return f"the site's model has no {t.name!r} (shape {t.shape} in the federation)"
        if other.shape != t.shape:
            return f"{t.name!r} has shape {other.shape} at the site, {t.shape} in the federation"
        if t.dtype is not None and other.dtype != t.dtype:
            return f"{t.name!r} is {other.dtype} at the site, {t.dtype} in the federation"
    for t in site.tensors:
        if t.name not in theirs:
            return f"the site's model has {t.name!r} (shape {t.shape}), the federation's does not"
    if site.job != federation.job and site.job is not None and federation.job is not None:
        return f"the site's job is {site.job!r}, the federation's {federation.job!r}"
    return (
        "names, shapes and dtypes agree: the job's factory or architecture (settings such as "
        "attention heads) differ"
    )
