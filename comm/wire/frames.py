"""The frame codec: messages of ``comm.wire.schema`` to ZeroMQ frames and back, never pickle.

Frame 0 is a msgpack header ``{"v": version, "t": type, "s": session, "q": sequence,
"f": fields, "p": payload index}``; (session, sequence) lets a receiver reject replays. Two
optional keys carry acknowledged delivery (``comm.transport.reliable``): ``"r": [number, floor]``
on a message that must arrive, ``"a": [session, contiguous, [numbers above the gap]]`` on any
message, acknowledging what the receiver holds of that session's stream.
Every ``bytes`` field follows as its own frame, then the encoded tensors' buffers
(``comm.wire.payload``): each of 64 KiB or more as a frame of its own, so large tensors travel
without a copy (numpy arrays expose their memory to ZeroMQ directly), the smaller ones together
in one frame; a large payload index travels compressed. ``from_wire``
validates everything against the message's dataclass before building it and raises
:class:`WireError` with an :class:`~comm.wire.schema.ErrorCode` on any deviation; it never trusts a
size or a count it has not checked against the frames it actually holds.
"""

from __future__ import annotations

import dataclasses
import typing
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from comm.codecs.base import EncodedTensor
from comm.wire.bounded import UnpackLimits, unpack_bounded
from comm.wire.errors import WireError as WireError  # raised here, imported from here
from comm.wire.payload import MAX_TENSORS, decode_payload, encode_payload
from comm.wire.schema import MESSAGE_CLASSES, MESSAGE_TYPES, PROTOCOL_VERSION, ErrorCode, Message

# Anything exposing the buffer protocol: bytes, memoryview, numpy arrays, zmq frame buffers.
Frame = Any

_MAX_HEADER_BYTES = 1 << 20
HEADER_LIMITS = UnpackLimits(
    max_objects=1 << 18,
    max_array_len=MAX_TENSORS,
    max_map_len=MAX_TENSORS,
    max_str_len=_MAX_HEADER_BYTES,
    max_bin_len=_MAX_HEADER_BYTES,
)
"""What a header may hold (``comm.wire.bounded``). The largest legitimate one is a ``Join`` of a
model of many tensors: its ``state_spec`` lists each as about 6 objects, so 2^18 objects are a
model of over 40,000 tensors, more than the 1 MiB header holds by their names. No list or map in
a header is longer than a model's tensor count; a string or a (compressed index) binary costs what
it weighs."""


def _check_value(kind: Any, value: Any, where: str) -> Any:
    """Check ``value`` (as msgpack decoded it) against a field annotation; return it converted."""
    origin = typing.get_origin(kind)
    if kind is bool:
        if not isinstance(value, bool):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be a bool")
        return value
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be an int")
        return value
    if kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be a string")
        return value
    if origin is tuple:
        (item_kind, _ellipsis) = typing.get_args(kind)
        if not isinstance(value, list):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be a list")
        return tuple(_check_value(item_kind, v, f"{where}[]") for v in value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise WireError(ErrorCode.MALFORMED, f"{where} must be a map with string keys")
        return value
    raise AssertionError(f"no wire rule for field type {kind!r} at {where}")


class _MessageCodec:
    """``to_wire``/``from_wire`` for one message class, derived from its dataclass fields."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.value_fields: dict[str, Any] = {}
        self.bytes_fields: list[str] = []
        self.has_payload = False
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if f.name == "payload":
                self.has_payload = True
            elif kind == bytes | memoryview or kind is bytes:
                self.bytes_fields.append(f.name)
            else:
                self.value_fields[f.name] = kind

    def to_wire(
        self, msg: Message, session: str, seq: int, extra: dict[str, Any] | None = None
    ) -> list[Frame]:
        fields = {name: getattr(msg, name) for name in self.value_fields}
        frames: list[Frame] = [getattr(msg, name) for name in self.bytes_fields]
        index: list[Any] | bytes = []
        if self.has_payload:
            payload: tuple[EncodedTensor, ...] = typing.cast(Any, msg).payload
            index, payload_frames = encode_payload(payload)
            frames.extend(payload_frames)
        head = {
            "v": PROTOCOL_VERSION,
            "t": int(MESSAGE_TYPES[self.cls]),
            "s": session,
            "q": seq,
            "f": fields,
            "p": index,
        }
        header = msgpack.packb({**head, **extra} if extra else head, use_bin_type=True)
        return [header, *frames]

    def from_wire(self, fields: Any, index: Any, frames: Sequence[Frame]) -> Message:
        if not isinstance(fields, dict) or set(fields) != set(self.value_fields):
            # Keys are compared as text: a hostile header may mix str and bytes keys.
            got = sorted(map(repr, fields)) if isinstance(fields, dict) else type(fields).__name__
            raise WireError(
                ErrorCode.MALFORMED,
                f"{self.cls.__name__} fields {got} != expected {sorted(self.value_fields)}",
            )
        values = {
            name: _check_value(kind, fields[name], f"{self.cls.__name__}.{name}")
            for name, kind in self.value_fields.items()
        }
        if len(frames) < len(self.bytes_fields):
            raise WireError(ErrorCode.MALFORMED, f"{self.cls.__name__} is missing data frames")
        for name, frame in zip(self.bytes_fields, frames, strict=False):
            values[name] = memoryview(frame).cast("B")
        rest = frames[len(self.bytes_fields) :]
        if self.has_payload:
            values["payload"] = decode_payload(index, rest)
        elif index or rest:
            raise WireError(ErrorCode.MALFORMED, f"{self.cls.__name__} carries no tensors")
        return self.cls(**values)  # type: ignore[no-any-return]


_CODECS: dict[int, _MessageCodec] = {
    int(t): _MessageCodec(cls) for t, cls in MESSAGE_CLASSES.items()
}


def _check_registry() -> None:
    """Import-time check: every ``MessageType`` has a class and a codec, and back."""
    from comm.wire.schema import MessageType

    missing = [t.name for t in MessageType if int(t) not in _CODECS]
    if missing:
        raise RuntimeError(f"message types without a wire codec: {missing}")


_check_registry()


@dataclass(frozen=True)
class Envelope:
    """Who sent a message in which order: the sender's session and its sequence number, and
    what it says about acknowledged delivery."""

    session: str
    seq: int
    delivery: tuple[int, int] | None = None
    """(number in the sender's stream, the stream's floor) of a message that must arrive."""
    ack: tuple[str, int, tuple[int, ...]] | None = None
    """(session acknowledged, highest number held with none missing, numbers held above it)."""


_MAX_SESSION = 64
_HEADER_KEYS = frozenset({"v", "t", "s", "q", "f", "p"})
_MAX_SACK = 256


def to_wire(
    msg: Message,
    *,
    session: str = "",
    seq: int = 0,
    delivery: tuple[int, int] | None = None,
    ack: tuple[str, int, tuple[int, ...]] | None = None,
) -> list[Frame]:
    """Frames for ``msg``: a header and then its data frames, tensor buffers not copied."""
    extra: dict[str, Any] = {}
    if delivery is not None:
        extra["r"] = list(delivery)
    if ack is not None:
        extra["a"] = [ack[0], ack[1], list(ack[2])]
    return _CODECS[int(MESSAGE_TYPES[type(msg)])].to_wire(msg, session, seq, extra)


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise WireError(ErrorCode.MALFORMED, f"header {what} must be an int >= 0")
    return value


def _delivery(value: Any) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise WireError(ErrorCode.MALFORMED, "header delivery must be [number, floor]")
    rseq, floor = _count(value[0], "delivery number"), _count(value[1], "delivery floor")
    if not floor < rseq:
        raise WireError(ErrorCode.MALFORMED, f"delivery floor {floor} >= number {rseq}")
    return rseq, floor


def _ack(value: Any) -> tuple[str, int, tuple[int, ...]]:
    if not isinstance(value, list) or len(value) != 3:
        raise WireError(ErrorCode.MALFORMED, "header ack must be [session, contiguous, above]")
    session, contig, above = value
    if not isinstance(session, str) or len(session) > _MAX_SESSION:
        raise WireError(ErrorCode.MALFORMED, "header ack session must be a short string")
    if not isinstance(above, list) or len(above) > _MAX_SACK:
        raise WireError(ErrorCode.MALFORMED, f"header ack must list at most {_MAX_SACK} numbers")
    return session, _count(contig, "ack"), tuple(_count(r, "ack number") for r in above)


def frames_nbytes(frames: Sequence[Frame]) -> int:
    """Total bytes of a frame list (what travels, before ZMTP framing)."""
    return sum(int(memoryview(f).nbytes) for f in frames)


def from_wire(frames: Sequence[Frame], *, max_bytes: int | None = None) -> Message:
    """Parse frames into a message; :class:`WireError` names what is wrong."""
    return from_wire_envelope(frames, max_bytes=max_bytes)[0]


def from_wire_envelope(
    frames: Sequence[Frame], *, max_bytes: int | None = None
) -> tuple[Message, Envelope]:
    """Parse frames into a message and its envelope; :class:`WireError` names what is wrong."""
    if not frames:
        raise WireError(ErrorCode.MALFORMED, "no frames")
    if max_bytes is not None:
        size = frames_nbytes(frames)
        if size > max_bytes:
            raise WireError(ErrorCode.OVERSIZE, f"{size} bytes > bound {max_bytes}")
    head = memoryview(frames[0]).cast("B")
    if head.nbytes > _MAX_HEADER_BYTES:
        raise WireError(ErrorCode.OVERSIZE, f"header of {head.nbytes} bytes")
    header = unpack_bounded(head, HEADER_LIMITS, "header is not msgpack within its bounds")
    if not isinstance(header, dict) or "v" not in header:
        raise WireError(ErrorCode.MALFORMED, "header is not a map with a version")
    if header["v"] != PROTOCOL_VERSION:
        raise WireError(
            ErrorCode.WRONG_VERSION,
            f"protocol version {header['v']!r}, expected {PROTOCOL_VERSION}",
        )
    if not _HEADER_KEYS <= set(header) <= _HEADER_KEYS | {"r", "a"}:
        raise WireError(ErrorCode.MALFORMED, f"header keys {sorted(map(str, header))}")
    session, seq = header["s"], header["q"]
    if not isinstance(session, str) or len(session) > _MAX_SESSION:
        raise WireError(ErrorCode.MALFORMED, "header session must be a short string")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise WireError(ErrorCode.MALFORMED, "header sequence must be an int >= 0")
    codec = _CODECS.get(header["t"]) if isinstance(header["t"], int) else None
    if codec is None:
        raise WireError(ErrorCode.MALFORMED, f"unknown message type {header['t']!r}")
    delivery = _delivery(header["r"]) if "r" in header else None
    ack = _ack(header["a"]) if "a" in header else None
    msg = codec.from_wire(header["f"], header["p"], frames[1:])
    return msg, Envelope(session, seq, delivery, ack)


class ReplayGuard:
    """Per sender: the current session and its last sequence number, and the sessions that
    sender ended, so a replayed message (an old sequence, or a message of an ended session) is
    refused with ``ErrorCode.REPLAY``.

    Bounded for long runs with reconnects and restarts: at most ``max_ended_sessions`` ended
    sessions per sender (the oldest forgotten first; a sender that restarted that many times since
    a message was captured could have that message accepted again once), at most ``max_peers``
    senders (the one heard from least recently forgotten first), and :meth:`forget` drops a
    sender at once (it left: the peer it was is gone).
    """

    def __init__(self, *, max_peers: int = 4096, max_ended_sessions: int = 64) -> None:
        if max_peers < 1 or max_ended_sessions < 1:
            raise ValueError("ReplayGuard bounds must be >= 1")
        self.max_peers = max_peers
        self.max_ended_sessions = max_ended_sessions
        self._current: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self._ended: dict[bytes, OrderedDict[str, None]] = {}

    @property
    def peers(self) -> int:
        """Senders with replay state."""
        return len(self._current)

    def ended_sessions(self, sender: bytes | None = None) -> int:
        """Ended sessions remembered for ``sender`` (or for everyone)."""
        if sender is not None:
            return len(self._ended.get(sender, ()))
        return sum(len(v) for v in self._ended.values())

    def current(self, sender: bytes) -> tuple[str, int] | None:
        """The sender's current session and its last sequence number (None: not known)."""
        return self._current.get(sender)

    def check(self, sender: bytes, session: str, seq: int, *, inner: bool = False) -> bool:
        """Accept (session, seq) from ``sender`` or raise :class:`WireError` (REPLAY). True when
        it starts a new session of a sender that had another one (the sender restarted).
        ``inner``: a reassembled chunked message, whose chunks were checked one by one and which
        the endpoint of its last chunk (the current session) put on the wire."""
        current = self._current.get(sender)
        if inner:
            if current is None or current[0] != session:
                raise WireError(ErrorCode.REPLAY, f"chunked message of session {session}")
            return False
        if current is not None and current[0] == session:
            if seq <= current[1]:
                raise WireError(
                    ErrorCode.REPLAY, f"session {session} sequence {seq} <= {current[1]}"
                )
            self._set(sender, session, seq)
            return False
        ended = self._ended.get(sender)
        if ended is not None and session in ended:
            raise WireError(ErrorCode.REPLAY, f"session {session} of this peer has ended")
        if current is not None:
            ended = self._ended.setdefault(sender, OrderedDict())
            ended[current[0]] = None
            while len(ended) > self.max_ended_sessions:
                ended.popitem(last=False)
        self._set(sender, session, seq)
        return current is not None

    def _set(self, sender: bytes, session: str, seq: int) -> None:
        self._current[sender] = (session, seq)
        self._current.move_to_end(sender)
        while len(self._current) > self.max_peers:
            oldest, _ = self._current.popitem(last=False)
            self._ended.pop(oldest, None)

    def forget(self, sender: bytes) -> None:
        """Drop everything about ``sender`` (it left for good)."""
        self._current.pop(sender, None)
        self._ended.pop(sender, None)
