"""The global model as the coordinator holds it: its durable state, hash, fragment layout, the log
of broadcast deltas, the shape sites declared, and the signed Global messages that carry it.

:class:`GlobalModel` owns the :class:`~coordinator.state.GlobalState` and changes it only through
its verbs, each of which hands the new state to ``persist`` (the post office's writer) before
anything can reveal it: a round's id is stored before the round is announced, a round's result
before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.codecs.registry import get_codec
from comm.security.signing import sign_blob
from comm.wire.schema import Global
from comm.wire.tensors import encode_tensors, fragments, global_signed_bytes, state_hash
from coordinator.deltalog import DeltaLog
from coordinator.model_spec import ModelSpec
from coordinator.state import GlobalState

log = logging.getLogger("crossdc.coordinator")

Persist = Callable[[GlobalState, bool], None]
"""``persist(state, counter_only)``: queue a durable save of ``state``."""

Later = Callable[[Callable[[], None]], None]
"""``later(action)``: run ``action`` once every save queued so far is durable."""


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
    ) -> None:
        self._num_fragments = num_fragments
        self._deltas_dir = deltas_dir
        self._signing_key = signing_key
        self._persist = persist
        self._later = later
        self.state: GlobalState | None = None
        self.fragment_names: list[list[str]] = []
        self.deltas = DeltaLog(0)  # sized and started with the model (``_laid_out``)
        self.spec: ModelSpec | None = None
        """The model as a site with its fingerprint declared it: explains refusals."""
        self._hash_cache: tuple[int, str] | None = None

    # ---- the state's life ------------------------------------------------------------------

    def loaded(self, state: GlobalState) -> None:
        """The durable state a restarted coordinator found."""
        self.state = state
        self._laid_out()

    def install(self, params: Mapping[str, np.ndarray], fingerprint: str) -> GlobalState:
        """θ0: the global model at version 0, zero momentum and residual, saved durably."""
        arrays = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        zeros = {k: np.zeros_like(v) for k, v in arrays.items()}
        self.state = GlobalState(
            params=arrays,
            momentum=zeros,
            residual={k: v.copy() for k, v in zeros.items()},
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

    def _current(self) -> GlobalState:
        assert self.state is not None, "no global model yet"
        return self.state

    def _laid_out(self) -> None:
        """Fragment layout (a pure function of the tensor names) and the delta log."""
        st = self._current()
        self.fragment_names = fragments(list(st.params), self._num_fragments)
        # A chain of deltas is worth sending only while it is smaller than the model itself.
        self.deltas = DeltaLog(sum(4 * v.size for v in st.params.values()), self._deltas_dir)
        self.deltas.resume(st.global_version, self.hash())

    # ---- what it looks like ----------------------------------------------------------------

    @property
    def numel(self) -> int:
        return int(sum(v.size for v in self._current().params.values()))

    def hash(self, state: GlobalState | None = None) -> str:
        state = state or self._current()
        if self._hash_cache is None or self._hash_cache[0] != state.global_version:
            self._hash_cache = (state.global_version, state_hash(state.params))
        return self._hash_cache[1]

    def sign(self, version: int, base: int, fragment: int, digest: str) -> bytes:
        if self._signing_key is None:
            return b""
        data = global_signed_bytes(version, base, fragment, digest)
        return sign_blob(self._signing_key, data, context="global")

    def full_global(self, state: GlobalState, round_id: int, evaluate: bool = False) -> Global:
        """The whole of ``state``'s model (a durable one: the caller waited for its save)."""
        digest = self.hash(state)
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
            payload=encode_tensors(state.params, get_codec("fp32")),
        )
