"""The global model as the coordinator holds it: its durable state, hash, fragment layout, the log
of broadcast deltas, the shape sites declared, and the signed Global messages that carry it.

:class:`GlobalModel` owns the :class:`~coordinator.state.GlobalState` and changes it only through
its verbs, each of which hands the new state to ``persist`` (the post office's writer) before
anything can reveal it: a round's id is stored before the round is announced, a round's result
before it is sent.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.security.signing import sign_blob
from comm.wire.schema import Global
from comm.wire.tensors import (
    encode_tensors,
    fragments,
    global_signed_bytes,
    model_hash,
    tensor_digest,
)
from coordinator.deltalog import DeltaLog
from coordinator.model_spec import ModelSpec
from coordinator.state import GlobalState

log = logging.getLogger("crossdc.coordinator")

Persist = Callable[[GlobalState, bool], None]
"""``persist(state, counter_only)``: queue a durable save of ``state``."""

Later = Callable[[Callable[[], None]], None]
"""``later(action)``: run ``action`` once every save queued so far is durable."""

Drain = Callable[[], None]
"""``drain()``: wait until every save queued so far is durable and run what waited on them."""

Reload = Callable[[], GlobalState | None]
"""``reload()``: the durable state, read back from the store."""


class GlobalModel:
    """The federation's model; ``state`` is None until θ0 exists."""

    def __init__(
        self,
        *,
        num_fragments: int,
        deltas_dir: Path | None,
        signing_key: Ed25519PrivateKey | None,
        persist: Persist,
        later: Later,
        drain: Drain,
        reload: Reload,
    ) -> None:
        self._num_fragments = num_fragments
        self._deltas_dir = deltas_dir
        self._signing_key = signing_key
        self._persist = persist
        self._later = later
        self._drain = drain
        self._reload = reload
        self.state: GlobalState | None = None
        self.fragment_names: list[list[str]] = []
        self.deltas = DeltaLog(0)  # sized and started with the model (``_laid_out``)
        self.spec: ModelSpec | None = None
        """The model as a site with its fingerprint declared it: explains refusals."""
        self._hash_cache: tuple[int, str] | None = None
        self._digest_cache: tuple[int, dict[str, bytes]] | None = None
        self.whole_hash: tuple[int, str] | None = None
        """A shard of several: (version, the state hash of the whole model at it), as shard 0
        committed it; the sites know the version by that hash (``site_hash``)."""
        self._full: tuple[int, list[weakref.ref[EncodedTensor]]] | None = None
        """The whole model's fp32 encoding of a version, while any message still holds it."""

    # ---- the state's life ------------------------------------------------------------------

    def loaded(self, state: GlobalState) -> None:
        """The durable state a restarted coordinator found."""
        self.state = state
        self._laid_out()

    def install(
        self, params: Mapping[str, np.ndarray], fingerprint: str, *, owned: bool = False
    ) -> GlobalState:
        """θ0: the global model at version 0, zero momentum and residual, saved durably.
        ``owned``: ``params`` are writable float32 arrays nothing else uses (the tensors of
        the message that brought them), which become the state's as they are; otherwise the
        state gets a copy. The zeros are allocated untouched: they take memory as the closes
        write them."""
        arrays = {
            k: v if owned and _adoptable(v) else np.array(v, dtype=np.float32)
            for k, v in params.items()
        }
        self.state = GlobalState(
            params=arrays,
            momentum={k: np.zeros(v.shape, np.float32) for k, v in arrays.items()},
            residual={k: np.zeros(v.shape, np.float32) for k, v in arrays.items()},
            global_version=0,
            round_counter=0,
            model_fingerprint=fingerprint,
        )
        self._persist(self.state, False)
        self._laid_out()
        log.info(
            "[coordinator] initial model %s: %d tensors, %d parameters",
            fingerprint,
            len(arrays),
            sum(v.size for v in arrays.values()),
        )
        return self.state

    def issue_round(self, round_id: int) -> None:
        """Round ``round_id`` is about to open: its id is stored first (never reused)."""
        self.state = replace(self._current(), round_counter=round_id)
        self._persist(self.state, True)

    def record_eval(self, version: int, loss: float, metrics: Mapping[str, float]) -> bool:
        """A site's validation of ``version`` (the first one reported is kept); True if new."""
        st = self._current()
        if version in st.val_losses:
            return False
        val_metrics = dict(st.val_metrics)
        if metrics:
            val_metrics[version] = dict(metrics)
        self.state = replace(
            st, val_losses={**st.val_losses, version: loss}, val_metrics=val_metrics
        )
        self._persist(self.state, True)
        return True

    def advance(
        self, state: GlobalState, *, base: int, fragment: int, then: Callable[[str, bytes], None]
    ) -> None:
        """A round's result: the new state, saved durably before anyone is told. Once the save
        is durable, ``then(digest, signature)`` runs with the new state's hash, signed for the
        result of ``fragment`` on ``base``."""
        self.state = state
        self._persist(state, False)
        digest = self.hash(state)
        signature = self.sign(state.global_version, base, fragment, digest)
        self._later(lambda: then(digest, signature))

    @contextmanager
    def changing(self) -> Iterator[Callable[[], None]]:
        """Around a step that overwrites the state's arrays in place, which calls the
        ``prepare`` yielded once it has checked everything that could refuse it, right before
        the first array changes: ``prepare`` makes every save queued so far durable and runs
        every action that waited on one (a save or an announcement reading an array must not
        see it change). A step that fails after ``prepare`` left the state half changed: the
        durable state, which is the state before the step, is read back from the store and the
        error raised again."""
        changed = False

        def prepare() -> None:
            nonlocal changed
            self._drain()
            changed = True

        try:
            yield prepare
        except BaseException:
            if changed:
                self._restore()
            raise

    def _restore(self) -> None:
        """The durable state back, in place of one a failed step changed."""
        self.state = None  # the arrays changed are dropped before the store's are read
        self._hash_cache = None
        self._digest_cache = None
        self._full = None
        state = self._reload()
        if state is None:
            raise RuntimeError("no durable state to restore after a failed step")
        log.error(
            "[coordinator] a step failed; the durable state v%d is back", state.global_version
        )
        self.state = state

    def known_as(self, version: int, digest: str) -> None:
        """A shard of several learns the whole model's hash at ``version`` (shard 0's word):
        the sites know that version by it, and the delta log's chain ends at it."""
        changed = self.whole_hash != (version, digest)
        self.whole_hash = (version, digest)
        if changed and self.state is not None and self.state.global_version == version:
            self._laid_out()

    def rolled_back(self, state: GlobalState) -> None:
        """The store went back a version (``PostOffice.roll_back``): ``state`` is the model now
        (a coordinator of several shards whose saved round was never committed)."""
        self.state = state
        self._hash_cache = None
        self._digest_cache = None
        self._full = None
        self._laid_out()

    def _current(self) -> GlobalState:
        assert self.state is not None, "no global model yet"
        return self.state

    def _laid_out(self) -> None:
        """Fragment layout (a pure function of the tensor names) and the delta log."""
        st = self._current()
        self.fragment_names = fragments(list(st.params), self._num_fragments)
        # A chain of deltas is worth sending only while it is smaller than the model itself.
        self.deltas = DeltaLog(sum(4 * v.size for v in st.params.values()), self._deltas_dir)
        self.deltas.resume(st.global_version, self.site_hash())

    # ---- what it looks like ----------------------------------------------------------------

    @property
    def numel(self) -> int:
        return int(sum(v.size for v in self._current().params.values()))

    def hash(self, state: GlobalState | None = None) -> str:
        """The state hash of ``state`` (the current one by default):
        ``comm.wire.tensors.state_hash`` of its parameters."""
        state = state or self._current()
        if self._hash_cache is None or self._hash_cache[0] != state.global_version:
            self._hash_cache = (state.global_version, model_hash(self.digests(state)))
        return self._hash_cache[1]

    def site_hash(self, state: GlobalState | None = None) -> str:
        """The hash the sites know ``state``'s version by: its own (one coordinator process),
        or a shard's ``whole_hash`` of the whole model at that version."""
        state = state or self._current()
        if self.whole_hash is not None and self.whole_hash[0] == state.global_version:
            return self.whole_hash[1]
        return self.hash(state)

    def digests(self, state: GlobalState | None = None) -> dict[str, bytes]:
        """Each tensor's digest of ``state`` (``comm.wire.tensors.tensor_digest``), from which
        its hash is made: a shard of several reports them so that shard 0 can make the hash of
        the whole model (``comm.wire.partition.combined_hash``)."""
        state = state or self._current()
        if self._digest_cache is None or self._digest_cache[0] != state.global_version:
            digests = {name: tensor_digest(name, v) for name, v in state.params.items()}
            self._digest_cache = (state.global_version, digests)
        return dict(self._digest_cache[1])

    def sign(self, version: int, base: int, fragment: int, digest: str) -> bytes:
        if self._signing_key is None:
            return b""
        data = global_signed_bytes(version, base, fragment, digest)
        return sign_blob(self._signing_key, data, context="global")

    def full_global(self, state: GlobalState, round_id: int, evaluate: bool = False) -> Global:
        """The whole of ``state``'s model (a durable one: the caller waited for its save)."""
        digest = self.site_hash(state)
        return Global(
            round_id=round_id,
            base_version=-1,
            global_version=state.global_version,
            fragment=-1,
            merged=(),
            is_full=True,
            state_hash=digest,
            signature=self.sign(state.global_version, -1, -1, digest),
            evaluate=evaluate,
            payload=self._full_payload(state),
        )

    def _full_payload(self, state: GlobalState) -> tuple[EncodedTensor, ...]:
        """``state``'s params in fp32: encoded once per version, shared by every message that
        carries it (sites behind at a close, catch-ups) while any of them is held, so that at
        most one copy of the model waits for their acknowledgements."""
        if self._full is not None and self._full[0] == state.global_version:
            kept = [ref() for ref in self._full[1]]
            if all(enc is not None for enc in kept):
                return tuple(enc for enc in kept if enc is not None)
        payload = encode_tensors(state.params, get_codec("fp32"))
        self._full = (state.global_version, [weakref.ref(enc) for enc in payload])
        return payload


def _adoptable(value: np.ndarray) -> bool:
    """Whether ``value`` can be a state's array as it is: writable native float32."""
    return (
        isinstance(value, np.ndarray)
        and value.dtype == np.dtype(np.float32)
        and value.dtype.isnative
        and value.flags.writeable
        and value.flags.c_contiguous
    )
