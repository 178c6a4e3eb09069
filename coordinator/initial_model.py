"""θ0 handed to the coordinator by its launcher, so that no site has to upload it.

Either built (:class:`InitialModel`: the parameters and the model's fingerprint) or described
(:class:`DescribedModel`: what builds it, e.g. ``[coordinator.initial_model]``'s seed and model
options, and how to build it from that). A described θ0 is built only when it is needed: at a
start that finds no state (θ0 becomes version 0), or when the start cannot tell from its record
that the state holds the model described. That record (``initial_model.json`` in the state
directory, :func:`remember`: written when θ0 is installed, and whenever :func:`check_holds`
checked in full and found the model the state holds) keeps the description's digest and the
fingerprint of the model it described; a restart with the same description and a state of that
fingerprint trusts it and builds nothing (a coordinator restarted by its supervisor listens again
without loading the model's code). A changed description is checked in full: θ0 built, its
fingerprint compared with the state's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from comm.durable import atomic_write
from coordinator.sharding import WholeModel

RECORD = "initial_model.json"


@dataclass(frozen=True)
class InitialModel:
    """θ0 built: its parameters (with several shards only this shard's part) and the model's
    fingerprint."""

    params: Mapping[str, np.ndarray]
    fingerprint: str
    whole: WholeModel | None = None
    """With several shards and ``params`` only this shard's part: the whole θ0's shapes and
    state hash (``coordinator.sharding.keep_part``); None where ``params`` is the whole."""

    @property
    def digest(self) -> str | None:
        """Built θ0 has no description to record: every start compares fingerprints."""
        return None

    def built(self) -> InitialModel:
        return self


class DescribedModel:
    """θ0 as its launcher describes it, built at most once and only when asked for
    (:meth:`built`)."""

    def __init__(self, description: Mapping[str, Any], build: Callable[[], InitialModel]) -> None:
        """``description``: JSON-able, everything θ0 is built from (two descriptions with the
        same digest build the same θ0); ``build``: builds it."""
        canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
        self.digest: str | None = hashlib.sha256(canonical.encode()).hexdigest()
        self._build = build
        self._built: InitialModel | None = None

    def built(self) -> InitialModel:
        if self._built is None:
            self._built = self._build()
        return self._built


def check_holds(
    initial: InitialModel | DescribedModel, fingerprint: str, state_dir: Path | None, where: str
) -> None:
    """ValueError unless ``initial`` describes the model of ``fingerprint`` that the state in
    ``where`` holds. The state directory's record answers when it holds ``initial``'s digest with
    that fingerprint; otherwise θ0 is built and its fingerprint compared (and on a match the
    record is written, so that the next start builds nothing)."""
    known = read_record(state_dir) if state_dir is not None else None
    if initial.digest is not None and known == (initial.digest, fingerprint):
        return
    built = initial.built().fingerprint
    if built != fingerprint:
        raise ValueError(
            f"coordinator.initial_model describes model {built}, "
            f"but {where} holds model {fingerprint}"
        )
    remember(initial, fingerprint, state_dir)


def remember(
    initial: InitialModel | DescribedModel, fingerprint: str, state_dir: Path | None
) -> None:
    """Keep ``initial``'s digest with the fingerprint of the model it built, in ``state_dir``
    (nothing to keep for a built θ0 or without a state directory)."""
    if initial.digest is None or state_dir is None:
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    body = {"description_digest": initial.digest, "fingerprint": fingerprint}
    atomic_write(state_dir / RECORD, json.dumps(body).encode())


def read_record(state_dir: Path) -> tuple[str, str] | None:
    """The digest and fingerprint :func:`remember` kept, or None: none kept, or a file that is not
    one (then the start checks in full, as without a record)."""
    try:
        doc = json.loads((state_dir / RECORD).read_bytes())
        digest, fingerprint = doc["description_digest"], doc["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(digest, str) or not isinstance(fingerprint, str):
        return None
    return digest, fingerprint
