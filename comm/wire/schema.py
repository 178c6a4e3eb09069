"""The wire schema: every message crossdc sends between a site and the coordinator, and between
the shards of a sharded coordinator.

This module owns the message types, ``PROTOCOL_VERSION`` and the error codes. Each message is a
frozen dataclass registered under one :class:`MessageType`; ``comm.wire`` turns them into frames
and back. Fields are plain values (int, float, str, bool, lists and dicts of them) except a
``payload`` field, which carries encoded tensors as zero-copy frames. Nothing else builds frames.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from comm.codecs.base import EncodedTensor

PROTOCOL_VERSION = 7
"""3: ``Eval`` carries the job's metrics (``metrics``) in place of ``num_tokens``. 4: the header
may carry acknowledged delivery (``"r"``, ``"a"``; see ``comm.wire.frames``). 5: ``Global`` may
be a sparse broadcast (``part_weights``, ``outer_lr``). 6: ``RoundStart.secagg`` relays each
peer's certificate in place of its bare CURVE key; ``BAD_KEY``. 7: the state hash is blockwise, so
ranks holding shards of the model compute it (``comm.wire.tensors.state_hash``); a payload entry
may be a slice of a tensor's rows (``"r"``, see ``comm.wire.payload``), which ``Update`` uses."""


class MessageType(enum.IntEnum):
    """One value per message on the wire; the number is what the header carries."""

    JOIN = 1
    WELCOME = 2
    HEARTBEAT = 3
    LEAVE = 4
    INIT_PARAMS = 5
    ROUND_START = 6
    UPDATE = 7
    GLOBAL = 8
    EVAL = 9
    ERROR = 10
    SHUTDOWN = 11
    SYNC_REQUEST = 12
    CHUNK = 13
    STEP_GRAD = 14
    STEP_MEAN = 15
    ROUND_CANCEL = 16
    CHUNK_ACK = 17
    SHARD_HELLO = 18
    SHARD_STATE = 19
    SHARD_OPEN = 20
    SHARD_FOLDED = 21
    SHARD_FREEZE = 22
    SHARD_FROZEN = 23
    SHARD_CLOSE = 24
    SHARD_PREPARED = 25
    SHARD_COMMIT = 26
    SHARD_ABORT = 27
    SHARD_OPENED = 28
    SHARD_INITIAL = 29
    SHARD_INITIAL_DONE = 30


class ErrorCode(enum.IntEnum):
    """Why a message was rejected; ``ERROR_MEANINGS`` holds the one-line meaning of each."""

    MALFORMED = 1
    WRONG_VERSION = 2
    OVERSIZE = 3
    NOT_JOINED = 4
    MODEL_MISMATCH = 5
    STALE_ROUND = 6
    DUPLICATE = 7
    NON_FINITE = 8
    BAD_PAYLOAD = 9
    BAD_DIGEST = 10
    UNEXPECTED = 11
    UNKNOWN_CODEC = 12
    UNAUTHENTICATED = 13
    REPLAY = 14
    BAD_SIGNATURE = 15
    BAD_KEY = 16
    OUT_OF_RANGE = 17


ERROR_MEANINGS: dict[ErrorCode, str] = {
    ErrorCode.MALFORMED: "frames could not be decoded into a message",
    ErrorCode.WRONG_VERSION: "the header's protocol version is not ours",
    ErrorCode.OVERSIZE: "the message exceeds the configured size bound",
    ErrorCode.NOT_JOINED: "the sender has not joined (or the coordinator restarted): join again",
    ErrorCode.MODEL_MISMATCH: "the site's model does not match the federation's",
    ErrorCode.STALE_ROUND: "the message names a round that is not open",
    ErrorCode.DUPLICATE: "an update for this round was already accepted from this site",
    ErrorCode.NON_FINITE: "a tensor holds NaN or Inf",
    ErrorCode.BAD_PAYLOAD: "tensor names, shapes or sizes do not match the global model",
    ErrorCode.BAD_DIGEST: "a chunk's digest does not match its bytes",
    ErrorCode.UNEXPECTED: "the message is valid but not expected in this state",
    ErrorCode.UNKNOWN_CODEC: "the payload names a codec this build does not know",
    ErrorCode.UNAUTHENTICATED: "the sender's certificate does not allow this message",
    ErrorCode.REPLAY: "the (session, sequence) of this message was already seen",
    ErrorCode.BAD_SIGNATURE: "a signature does not verify",
    ErrorCode.BAD_KEY: "a public key the sender announced cannot be used",
    ErrorCode.OUT_OF_RANGE: "a figure the site reported (weight, step time, link) is out of range",
}


@dataclass(frozen=True, kw_only=True)
class Join:
    """A site asks to take part; it states what it holds so the coordinator can sync it."""

    site_id: str
    model_fingerprint: str
    global_version: int
    state_hash: str
    capabilities: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Welcome:
    """The coordinator admits a site. ``need_init``: send your parameters as θ_0."""

    site_id: str
    session_id: str
    global_version: int
    heartbeat_interval_s: float
    need_init: bool


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """Application-level liveness. The coordinator echoes each one back unchanged, so the site
    measures the round trip from ``sent_at`` (the site's own monotonic clock)."""

    site_id: str
    global_version: int
    sent_at: float


@dataclass(frozen=True, kw_only=True)
class Leave:
    """A site leaves on purpose."""

    site_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class InitParams:
    """θ_0 from the first site to join, when the coordinator holds no parameters yet."""

    site_id: str
    model_fingerprint: str
    payload: tuple[EncodedTensor, ...]


@dataclass(frozen=True, kw_only=True)
class RoundStart:
    """The coordinator's plan of one round for one site.

    Train ``num_inner_steps`` more inner steps (per site: one that landed early in the last round
    gets more, see ``coordinator.scheduler``), then send the pseudo-gradient of fragment
    ``fragment`` (of ``num_fragments``, see ``comm.wire.tensors.fragments``) encoded with ``codec``,
    relative to a global model that includes version ``fragment_base_version``. With
    ``overlap`` the site keeps training while the update and the result are in flight; without
    it the site waits for this round's result before training on.
    """

    round_id: int
    global_version: int
    fragment_base_version: int
    fragment: int
    num_fragments: int
    num_inner_steps: int
    overlap: bool
    codec: str
    deadline_s: float
    participants: tuple[str, ...]
    evaluate: bool
    reason: str
    """Why the scheduler chose this plan (for logs)."""
    secagg: dict[str, Any] = field(default_factory=dict)
    """Secure aggregation of this round, empty when off: ``attempt`` and ``peers`` (site id ->
    [session public key hex, the site's certificate as PEM or "" without certificates]; built
    and read by ``comm.security.secagg.plan_message`` / ``plan_from_message``). Each site
    verifies every peer's certificate against its own kit before masking. A re-run repeats the
    round id with a higher attempt and only the survivors; the site re-masks the update it
    already made."""

    @property
    def attempt(self) -> Any:
        """Which attempt of the round this plan is: 0 the first; a higher one repeats a round the
        site has trained already (a secure aggregation re-run), and the site sends again the
        update it made, without training."""
        return self.secagg.get("attempt", 0)


@dataclass(frozen=True, kw_only=True)
class RoundCancel:
    """Rounds that will never complete (aborted); sites drop their plans for them."""

    round_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class Update:
    """A site's encoded pseudo-gradient for one round, weighted by the tokens it trained on."""

    site_id: str
    round_id: int
    global_version: int
    fragment: int
    weight: float
    train_loss: float
    """The mean loss of the inner steps; NaN when the site has none to report (a training loop
    that never records one): left out of the round's mean, where an infinite one is refused."""
    compute_seconds: float
    step_seconds: float
    """Mean wall seconds per inner step (the scheduler's compute estimate)."""
    link_rtt_s: float
    """The site's measured round trip to the coordinator (0 when unknown)."""
    link_goodput_bps: float
    """The site's measured goodput from the coordinator, bits/s (0 when unknown)."""
    payload: tuple[EncodedTensor, ...]
    """The encoded tensors: each whole, or (a site holding its model in shards) as slices of
    its rows (``EncodedTensor.rows``), which together cover the tensor exactly once
    (``comm.wire.tensors.check_slices``)."""


@dataclass(frozen=True, kw_only=True)
class Global:
    """The new global model: a delta from ``base_version`` (``is_full`` false) or all of it.

    ``state_hash`` is the hash of the parameters after applying; a site that disagrees
    asks for a full download with :class:`SyncRequest`.
    """

    round_id: int
    base_version: int
    global_version: int
    fragment: int
    """Which fragment changed (-1: the whole model, as in a full download)."""
    merged: tuple[str, ...]
    """Sites whose updates this round merged (late ones included)."""
    is_full: bool
    state_hash: str
    signature: bytes
    """The coordinator's Ed25519 signature over (versions, fragment, state hash); empty in
    insecure mode. A site verifies it before loading the model."""
    evaluate: bool
    """The receiving site should report the validation loss of the new model."""
    payload: tuple[EncodedTensor, ...]
    """The delta, the whole model, or (``part_weights`` not empty) the sites' updates."""
    part_weights: tuple[float, ...] = ()
    """Empty: ``payload`` is the delta (or the model). Otherwise a sparse broadcast: ``payload``
    holds one encoded update per weight, each the same tensors in the same order, and the site
    computes θ − ``outer_lr`` · Σ w_i u_i / Σ w_i as the coordinator did
    (``comm.codecs.broadcast.sparse_step``)."""
    outer_lr: float = 0.0
    """The sparse broadcast's outer learning rate (0 for a delta)."""


@dataclass(frozen=True, kw_only=True)
class Eval:
    """A site's validation loss of the global model at ``global_version``, and the job's other
    validation metrics by name (``{"accuracy": 0.93}``, say; empty when it has none)."""

    site_id: str
    global_version: int
    val_loss: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Error:
    """A rejection, sent back to the sender when it can be addressed."""

    code: int
    detail: str


@dataclass(frozen=True, kw_only=True)
class Shutdown:
    """The federation is finished (or the coordinator stops): sites save and exit."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class SyncRequest:
    """A site asks for the full current global model."""

    site_id: str
    global_version: int


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One piece of a large message, cut to bound frame size (``comm.wire.chunking``)."""

    transfer_id: str
    index: int
    num_chunks: int
    offset: int
    total_bytes: int
    digest: str
    data: bytes | memoryview


@dataclass(frozen=True, kw_only=True)
class ChunkAck:
    """The receiver's acknowledgement and credit for one chunked transfer (``comm.transport``).

    ``next_index``: every chunk below it has arrived, that one has not (``num_chunks`` once the
    transfer is complete). ``credit_bytes``: the sender may have sent the bytes from the start of
    chunk ``next_index`` up to ``credit_bytes`` further (0 once complete).
    """

    transfer_id: str
    next_index: int
    credit_bytes: int


@dataclass(frozen=True, kw_only=True)
class StepGrad:
    """Synchronous data-parallel baseline: one site's gradient of one inner step."""

    site_id: str
    step: int
    weight: float
    loss: float
    payload: tuple[EncodedTensor, ...]


@dataclass(frozen=True, kw_only=True)
class StepMean:
    """Synchronous data-parallel baseline: the weighted mean gradient of one step, for all."""

    step: int
    num_sites: int
    payload: tuple[EncodedTensor, ...]


# ---- between the shards of a sharded coordinator ---------------------------------------------
#
# With ``[coordinator] shards = S``, shard 0 leads the rounds of every shard over a channel of
# its own, which only the coordinator's own key may connect to (``coordinator.shard_plane`` holds
# the protocol: open, parts folded, freeze, close, prepared, commit, abort). Sites never see these.


@dataclass(frozen=True, kw_only=True)
class ShardHello:
    """A shard to shard 0, at its start and then as its liveness: who it is and what it holds.
    ``partition`` is ``comm.wire.partition.partition_digest`` of the cut it runs with."""

    shard: int
    shards: int
    partition: str
    global_version: int
    round_counter: int
    sent_at: float


@dataclass(frozen=True, kw_only=True)
class ShardState:
    """Shard 0's answer to each hello: its last committed version and round counter (a shard
    holding the next version rolls back to this one), ``sent_at`` echoed, ``state_hash``, the
    whole model's hash at that version (the hash the sites know it by), and ``session``, shard
    0's process (a new one after a restart: the rounds the old one had in flight are gone)."""

    global_version: int
    round_counter: int
    sent_at: float
    state_hash: str = ""
    session: str = ""


@dataclass(frozen=True, kw_only=True)
class ShardOpen:
    """Shard 0 opened a round: every shard opens the same over its own tensors, with shard 0's
    plan (``plan``: the scheduler's round plan as plain values: inner steps, codecs up and
    down), and says so (:class:`ShardOpened`) before any site is sent the round."""

    round_id: int
    base_version: int
    fragment: int
    participants: tuple[str, ...]
    quorum: int
    deadline_s: float
    plan: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ShardOpened:
    """A shard opened a round shard 0 opened: it takes the sites' parts of it."""

    shard: int
    round_id: int


@dataclass(frozen=True, kw_only=True)
class ShardFolded:
    """A shard took (``accepted``) or refused a site's part of a round (``detail``: why);
    ``squared_norm``: the sum of the squares of the part's values (a part taken), from which
    shard 0 bounds the site's whole update."""

    shard: int
    round_id: int
    site_id: str
    accepted: bool
    detail: str
    squared_norm: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ShardFreeze:
    """Shard 0 closes a round: take no more parts of it, and say whose parts you folded."""

    round_id: int


@dataclass(frozen=True, kw_only=True)
class ShardFrozen:
    """A shard took no more parts of a round; it folded the parts of ``folded``."""

    shard: int
    round_id: int
    folded: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ShardClose:
    """Every shard closes the round over exactly ``merged``: outer step, then save.
    ``inner_steps`` (behind the model the round makes) and ``final`` (the run's last round)
    decide the step the same way on every shard."""

    round_id: int
    merged: tuple[str, ...]
    inner_steps: int
    final: bool


@dataclass(frozen=True, kw_only=True)
class ShardPrepared:
    """A shard saved ``global_version`` of its tensors; ``digests``: each tensor's digest (hex,
    ``comm.wire.tensors.tensor_digest``), for the combined state hash."""

    shard: int
    round_id: int
    global_version: int
    digests: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ShardCommit:
    """Shard 0 committed ``global_version``: every shard announces its result. ``state_hash``
    is the model's over every shard, ``shard_hashes`` each shard's own."""

    round_id: int
    global_version: int
    state_hash: str
    shard_hashes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ShardAbort:
    """Rounds aborted on every shard; a shard that saved a version of them goes back to the last
    committed one."""

    round_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class ShardInitial:
    """A shard holds its part of θ0 as site ``site_id`` uploaded it (not yet its state):
    ``shapes`` and ``digests`` (hex, ``comm.wire.tensors.tensor_digest``) of each tensor it got,
    from which shard 0 checks the parts against the model's cut and makes θ0's whole hash."""

    shard: int
    site_id: str
    shapes: dict[str, Any]
    digests: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ShardInitialDone:
    """Shard 0's word on the θ0 parts site ``site_id`` uploaded: with ``state_hash`` (the whole
    θ0's) every shard keeps its part as version 0, and ``shapes`` (the whole model's) give the
    cut; with ``state_hash`` empty every shard drops what it holds of that upload (``reason``:
    why) and takes the next one."""

    site_id: str
    state_hash: str
    shapes: dict[str, Any]
    reason: str


Message = (
    Join
    | Welcome
    | Heartbeat
    | Leave
    | InitParams
    | RoundStart
    | Update
    | Global
    | Eval
    | Error
    | Shutdown
    | SyncRequest
    | Chunk
    | StepGrad
    | StepMean
    | RoundCancel
    | ChunkAck
    | ShardHello
    | ShardState
    | ShardOpen
    | ShardOpened
    | ShardFolded
    | ShardFreeze
    | ShardFrozen
    | ShardClose
    | ShardPrepared
    | ShardCommit
    | ShardAbort
    | ShardInitial
    | ShardInitialDone
)

MESSAGE_CLASSES: dict[MessageType, type[Any]] = {
    MessageType.JOIN: Join,
    MessageType.WELCOME: Welcome,
    MessageType.HEARTBEAT: Heartbeat,
    MessageType.LEAVE: Leave,
    MessageType.INIT_PARAMS: InitParams,
    MessageType.ROUND_START: RoundStart,
    MessageType.UPDATE: Update,
    MessageType.GLOBAL: Global,
    MessageType.EVAL: Eval,
    MessageType.ERROR: Error,
    MessageType.SHUTDOWN: Shutdown,
    MessageType.SYNC_REQUEST: SyncRequest,
    MessageType.CHUNK: Chunk,
    MessageType.STEP_GRAD: StepGrad,
    MessageType.STEP_MEAN: StepMean,
    MessageType.ROUND_CANCEL: RoundCancel,
    MessageType.CHUNK_ACK: ChunkAck,
    MessageType.SHARD_HELLO: ShardHello,
    MessageType.SHARD_STATE: ShardState,
    MessageType.SHARD_OPEN: ShardOpen,
    MessageType.SHARD_FOLDED: ShardFolded,
    MessageType.SHARD_FREEZE: ShardFreeze,
    MessageType.SHARD_FROZEN: ShardFrozen,
    MessageType.SHARD_CLOSE: ShardClose,
    MessageType.SHARD_PREPARED: ShardPrepared,
    MessageType.SHARD_COMMIT: ShardCommit,
    MessageType.SHARD_ABORT: ShardAbort,
    MessageType.SHARD_OPENED: ShardOpened,
    MessageType.SHARD_INITIAL: ShardInitial,
    MessageType.SHARD_INITIAL_DONE: ShardInitialDone,
}

MESSAGE_TYPES: dict[type[Any], MessageType] = {cls: t for t, cls in MESSAGE_CLASSES.items()}
