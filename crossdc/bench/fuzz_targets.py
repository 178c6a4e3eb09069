"""What ``crossdc bench fuzz`` feeds bytes to: every decoder that reads bytes from the network.

A :class:`Target` is one decoder entry point, the exceptions that are its documented refusal
(``WireError`` for frames, ``ValueError`` for a codec's decode, ``AuthError`` for certificates
and revocation lists) and valid seeds. :func:`judge` runs one input: a refusal or a success is
fine; any other exception, or a result that breaks the decoder's contract (a codec returning
anything but a fresh, finite float32 array of the tensor's shape), is a :class:`Finding`.

Inputs are bytes. Frame lists travel as a small container (:func:`pack_frames`: a count byte,
then each frame with a 16-bit length), so one input can hold a message's header and its data
frames, or several messages (the chunk reassembly target). Certificates are DER, wrapped in PEM
as the loaders read them.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import struct
import traceback
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgpack
import numpy as np

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.security.certs import (
    Certificate,
    make_ca_certificate,
    make_site_certificate,
    parse_ca_certificate,
)
from comm.security.common import AuthError
from comm.security.crl import Revocation, RevocationList, parse_revocations
from comm.security.registry import CertificateRegistry
from comm.security.zap import DOMAIN, ZAP_VERSION, decide
from comm.transport.credit import TransferConfig
from comm.transport.receiver import TransferReceiver
from comm.wire.chunking import split_frames
from comm.wire.frames import ReplayGuard, WireError, from_wire, from_wire_envelope, to_wire
from comm.wire.schema import (
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Chunk,
    ChunkAck,
    ErrorCode,
    Message,
    MessageType,
)
from comm.wire.tensors import decode_tensors, encode_tensors
from coordinator.intake import INITIAL_MODEL_CODECS

MAX_MESSAGE_BYTES = 1 << 20
"""The bound a receiving channel passes to ``from_wire`` (its ``max_message_bytes``)."""
CHUNK_BYTES = 512
"""Small, so that the seeds' messages span several chunks."""
CODEC_SPECS = (
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int3",
    "int2",
    "topk:0.1",
    "topk:0.1,values=fp16",
    "chunktopk:chunk=64,k=4",
    "chunktopk:chunk=64,k=4,bits=1",
    "fp32+zstd",
    "fp16+zstd",
    "bf16+zstd",
    "int8+zstd",
    "int4+zstd",
    "int3+zstd",
    "int2+zstd",
    "topk:0.1+zstd",
)
"""Every codec family (and its zstd stage), with the parameters its seeds are encoded with."""

# --------------------------------------------------------------------------------------------
# The input container


def pack_frames(frames: Sequence[bytes]) -> bytes:
    """Frames as one input: a count byte, then each frame as a 16-bit length and its bytes."""
    assert len(frames) < 256 and all(len(f) < 1 << 16 for f in frames)
    return bytes([len(frames)]) + b"".join(struct.pack("<H", len(f)) + f for f in frames)


def unpack_frames(data: bytes) -> list[bytes]:
    """The frames of an input (never raises: a count or length past the end stops the list)."""
    if not data:
        return []
    frames, pos = [], 1
    for _ in range(data[0]):
        if pos + 2 > len(data):
            break
        (n,) = struct.unpack_from("<H", data, pos)
        frames.append(data[pos + 2 : pos + 2 + n])
        pos += 2 + n
    return frames


# --------------------------------------------------------------------------------------------
# Targets


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    refusals: tuple[type[BaseException], ...]
    """The decoder's documented refusal; any other exception is a finding."""
    shape: str
    """How an input is laid out: "frames" (a container), "nested" (a container of
    containers), or "raw" (the bytes themselves)."""
    seeds: Callable[[], list[bytes]]


@dataclass(frozen=True)
class Finding:
    target: str
    kind: str
    """"exception" (not a refusal), "contract" (a wrong result) or "hang"."""
    error: str
    where: str
    """The innermost project frame (file:line) the exception came from."""
    message: str
    data: bytes

    @property
    def signature(self) -> tuple[str, str, str, str]:
        return (self.target, self.kind, self.error, self.where)

    def report(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "error": self.error,
            "where": self.where,
            "message": self.message[:300],
            "input_hex": self.data[:512].hex(),
            "input_bytes": len(self.data),
        }


class InputTimeout(BaseException):
    """Raised into a decoder that ran past the per-input time limit (a hang)."""


class ContractError(Exception):
    """A decoder returned instead of refusing, with a result that breaks its contract."""


def _where(exc: BaseException) -> str:
    """The innermost frame of the project (comm/, coordinator/, site_agent/, crossdc/)."""
    frames = traceback.extract_tb(exc.__traceback__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(root) and not path.endswith(("fuzz_targets.py", "fuzz_engines.py")):
            return f"{os.path.relpath(path, root)}:{frame.lineno}"
    last = frames[-1] if frames else None
    return f"{last.filename}:{last.lineno}" if last else "?"


def judge(target: Target, data: bytes) -> Finding | None:
    """Run one input; a :class:`Finding` unless the decoder refused it or decoded it right."""
    try:
        target.run(data)
    except target.refusals:
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except InputTimeout as exc:
        return Finding(target.name, "hang", "InputTimeout", _where(exc), str(exc), data)
    except ContractError as exc:
        return Finding(target.name, "contract", "ContractError", _where(exc), str(exc), data)
    except BaseException as exc:
        return Finding(target.name, "exception", type(exc).__name__, _where(exc), str(exc), data)
    return None


# ---- frames, headers, tensor payloads ---------------------------------------------------------


def _frames(data: bytes) -> None:
    """A frame list as a channel parses it, then its tensors as the roles decode them."""
    msg, _env = from_wire_envelope(unpack_frames(data), max_bytes=MAX_MESSAGE_BYTES)
    payload = getattr(msg, "payload", None)
    if payload is not None:
        decode_tensors(payload)


def _header(data: bytes) -> None:
    """A header frame alone (every message without data frames is one)."""
    from_wire([data], max_bytes=MAX_MESSAGE_BYTES)


def _update_header(index: object) -> bytes:
    fields = {
        "site_id": "eu",
        "round_id": 1,
        "global_version": 0,
        "fragment": 0,
        "weight": 1.0,
        "train_loss": 1.0,
        "compute_seconds": 1.0,
        "step_seconds": 0.1,
        "link_rtt_s": 0.0,
        "link_goodput_bps": 0.0,
    }
    head = {"v": PROTOCOL_VERSION, "t": int(MessageType.UPDATE), "s": "fz", "q": 1}
    return bytes(msgpack.packb({**head, "f": fields, "p": index}, use_bin_type=True))


def _payload(data: bytes) -> tuple[EncodedTensor, ...]:
    """An Update's payload from an input: frame 0 the msgpack payload index, then the buffers."""
    frames = unpack_frames(data)
    if not frames:
        raise WireError(ErrorCode.MALFORMED, "no payload index")
    try:
        index = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on garbage
        raise WireError(ErrorCode.MALFORMED, "the payload index is not msgpack") from None
    msg = from_wire([_update_header(index), *frames[1:]])
    return typing.cast(Any, msg).payload  # type: ignore[no-any-return]


MODEL_SHAPES = {"w": (8, 64), "b": (64,)}
"""The model a receiver holds in these targets (the seeds' tensors): the coordinator decodes an
update, and a site a result, only against the shapes it holds."""


def _tensors(data: bytes) -> None:
    """A payload as a receiver that holds the model decodes it (an update, a result)."""
    decode_tensors(_payload(data), MODEL_SHAPES)


def _initial(data: bytes) -> None:
    """A payload decoded without a model to check it against: θ0 (InitParams), which defines
    the model, as the coordinator takes it (``coordinator.intake``)."""
    decode_tensors(_payload(data), codecs=INITIAL_MODEL_CODECS)


def _check_decoded(enc: EncodedTensor, out: object) -> None:
    """What every codec's decode promises: a fresh, writable, C-contiguous, finite float32
    array of the encoded tensor's shape."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise ContractError(f"decode returned {type(out).__name__} {getattr(out, 'dtype', '')}")
    if out.shape != tuple(enc.shape):
        raise ContractError(f"decoded shape {out.shape}, encoded {tuple(enc.shape)}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ContractError("decoded array is not C-contiguous and writable")
    if not np.isfinite(out).all():
        raise ContractError("decode returned NaN or Inf instead of refusing")
    for buf in enc.buffers:
        if np.shares_memory(out, buf):
            raise ContractError("decoded array aliases a received buffer")


def _codec(spec: str) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        codec = get_codec(spec)
        for enc in _payload(data):
            if tuple(enc.shape) not in MODEL_SHAPES.values():
                # What decode_tensors refuses before any codec sees it.
                raise WireError(ErrorCode.BAD_PAYLOAD, f"shape {enc.shape} is not the model's")
            enc = dataclasses.replace(enc, codec=spec)
            _check_decoded(enc, codec.decode(enc))

    return run


# ---- chunk reassembly -------------------------------------------------------------------------

RECEIVER = TransferConfig(
    chunk_bytes=CHUNK_BYTES,
    initial_credit_bytes=2 * CHUNK_BYTES,
    min_window_bytes=2 * CHUNK_BYTES,
    max_window_bytes=8 * CHUNK_BYTES,
    max_transfer_bytes=1 << 20,
    max_pending=4,
    max_chunks=1024,
    stall_timeout_s=2.0,
    receive_max_transfers=2,
    receive_budget_bytes=6 * CHUNK_BYTES,
)
"""A receiver small enough that the seed transfers fill its budget and one of them waits."""


def _chunks(data: bytes) -> None:
    """Messages one after another into a receiver, as a channel takes them (a second apart):
    the replay check, chunks reassembled (a refused message does not stop the next), a
    completed message parsed, checked again and its tensors decoded; then an expiry sweep."""
    receiver = TransferReceiver(RECEIVER)
    replay = ReplayGuard(max_peers=2, max_ended_sessions=2)
    sender = b"fz/1"
    for t, raw in enumerate(unpack_frames(data)):
        now = float(t)
        try:
            msg, env = from_wire_envelope(unpack_frames(raw), max_bytes=MAX_MESSAGE_BYTES)
            if replay.check(sender, env.session, env.seq):
                receiver.drop_sender(sender)  # a new session: the old transfers are void
            if not isinstance(msg, Chunk):
                continue
            got = receiver.on_chunk(sender, msg, now)
            receiver.acks_due(now)
            if got.frames is None:
                continue
            inner, env = from_wire_envelope(got.frames)
            replay.check(sender, env.session, env.seq, inner=True)
            if isinstance(inner, Chunk | ChunkAck):
                raise WireError(ErrorCode.MALFORMED, "a chunk or ack inside a chunked transfer")
            payload = getattr(inner, "payload", None)
            if payload is not None:
                decode_tensors(payload)
        except WireError:
            continue
    receiver.expire(1e9)
    receiver.drop_sender(b"fz/1")


def _ack(data: bytes) -> None:
    """The transfer drivers' acknowledgement frame (``comm.transport.credit``)."""
    from comm.transport.credit import decode_ack

    decode_ack(data)


# ---- certificates, revocation lists, ZAP requests ---------------------------------------------


@dataclass(frozen=True)
class _Pki:
    """A CA, a site certificate under it and a revocation list, made once per process."""

    ca_der: bytes
    site_der: bytes
    crl_der: bytes
    site_public: bytes
    registry: CertificateRegistry


def _der(pem: bytes) -> bytes:
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return base64.b64decode(body)


def _pem(der: bytes, kind: str) -> bytes:
    body = base64.encodebytes(der).replace(b"\n", b"")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return b"\n".join(
        [f"-----BEGIN {kind}-----".encode(), *lines, f"-----END {kind}-----".encode()]
    )


@cache
def pki() -> _Pki:
    import zmq
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ca_key = Ed25519PrivateKey.generate()
    now = 1_700_000_000
    ca_pem = make_ca_certificate(ca_key, not_before=now, not_after=now + 86400, serial="01")
    public, _secret = zmq.curve_keypair()
    site = make_site_certificate(
        ca_key, site_id="eu", curve_public=public, not_before=now, not_after=now + 3600, serial="2a"
    )
    revs = RevocationList(
        version=3,
        issued_at=now,
        entries=(Revocation(serial="2b", revoked_at=now), Revocation(serial="ff", revoked_at=now)),
    )
    crl_pem = revs.to_pem(ca_key, next_update=now + 86400)
    registry = CertificateRegistry(ca_key.public_key(), [site], revs)
    return _Pki(_der(ca_pem), site.der, _der(crl_pem), public, registry)


NOW = 1_700_000_100.0
"""When certificates are checked: inside the seed certificates' validity."""


def _certificate(data: bytes) -> None:
    cert = Certificate.from_pem(_pem(data, "CERTIFICATE"))
    cert.verify(pki().registry.ca_public_key, NOW, site_id="eu", revoked={"2b"})


def _ca_certificate(data: bytes) -> None:
    parse_ca_certificate(_pem(data, "CERTIFICATE"))


def _crl(data: bytes) -> None:
    parse_revocations(_pem(data, "X509 CRL"), pki().registry.ca_public_key).serials  # noqa: B018


def _zap(data: bytes) -> None:
    """A ZAP request as libzmq hands it over; ``decide`` answers everything."""
    decide(unpack_frames(data), pki().registry, now=NOW)


# ---- seeds ------------------------------------------------------------------------------------

_RNG_SEED = 20240517


def _tensor(shape: tuple[int, ...] = (8, 64)) -> np.ndarray:
    rng = np.random.default_rng(_RNG_SEED)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::7] = 0.0
    return x


def _sample(cls: type[Any]) -> Message:
    """A valid message of class ``cls``, its fields filled by type."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if f.name == "payload":
            values[f.name] = encode_tensors({"w": _tensor((4, 16))}, get_codec("int8"))
        elif kind is bool:
            values[f.name] = True
        elif kind is int:
            values[f.name] = 3
        elif kind is float:
            values[f.name] = 0.25
        elif kind is str:
            values[f.name] = "eu"
        elif typing.get_origin(kind) is tuple:
            values[f.name] = (1, 2) if typing.get_args(kind)[0] is int else ("eu", "us")
        elif typing.get_origin(kind) is dict:
            values[f.name] = {"accuracy": 0.5} if cls.__name__ == "Eval" else {"attempt": 1}
        else:
            values[f.name] = b"signature-bytes"
    return typing.cast(Message, cls(**values))


def _wire(msg: Message, seq: int = 1) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in to_wire(msg, session="fz-session", seq=seq)]


def _message_seeds() -> list[bytes]:
    return [pack_frames(_wire(_sample(cls))) for cls in MESSAGE_CLASSES.values()]


def _header_seeds() -> list[bytes]:
    return [_wire(_sample(cls))[0] for cls in MESSAGE_CLASSES.values()]


def _index(spec: str) -> list[bytes]:
    """An Update payload's index and buffers, encoded with ``spec``."""
    frames = _wire(encode_update(spec))
    head = msgpack.unpackb(frames[0], raw=False)
    return [bytes(msgpack.packb(head["p"], use_bin_type=True)), *frames[1:]]


def encode_update(spec: str) -> Message:
    msg = _sample(MESSAGE_CLASSES[MessageType.UPDATE])
    payload = encode_tensors({"w": _tensor(), "b": _tensor((64,))}, get_codec(spec))
    return dataclasses.replace(typing.cast(Any, msg), payload=payload)  # type: ignore[no-any-return]


def _tensor_seeds() -> list[bytes]:
    return [pack_frames(_index(spec)) for spec in CODEC_SPECS]


def _chunk_seeds() -> list[bytes]:
    """Three transfers' chunks, interleaved (the third waits for the receive budget), a chunk
    sent twice, and a heartbeat between them; each chunk a message of its own, the sequence
    numbers rising as a channel numbers what it sends."""
    seq = iter(range(1, 1000))
    streams = []
    for n, spec in enumerate(("fp32", "int8", "fp16")):
        frames = _wire(encode_update(spec), seq=next(seq))
        chunks = split_frames(frames, CHUNK_BYTES, transfer_id=f"t{n}")
        streams.append([_wire(c) for c in chunks])
    ordered = [c for group in zip(*streams, strict=False) for c in group]
    ordered += [c for s in streams for c in s[min(map(len, streams)) :]]
    ordered.insert(2, ordered[1])
    ordered.insert(4, _wire(_sample(MESSAGE_CLASSES[MessageType.HEARTBEAT])))
    numbered = [pack_frames(_renumbered(frames, next(seq))) for frames in ordered]
    return [pack_frames(numbered), pack_frames(numbered[:5])]


def _renumbered(frames: list[bytes], seq: int) -> list[bytes]:
    """A message's frames with sequence number ``seq`` in its header."""
    head = msgpack.unpackb(frames[0], raw=False)
    return [bytes(msgpack.packb({**head, "q": seq}, use_bin_type=True)), *frames[1:]]


def _ack_seeds() -> list[bytes]:
    from comm.transport.credit import encode_ack

    return [encode_ack(ChunkAck(transfer_id="t0", next_index=2, credit_bytes=8192))]


def _zap_seeds() -> list[bytes]:
    from comm.security.common import curve_raw

    key = curve_raw(pki().site_public)
    base = [ZAP_VERSION, b"7", DOMAIN, b"10.0.0.1", b"", b"CURVE"]
    return [pack_frames([*base, key]), pack_frames([*base, bytes(32)]), pack_frames(base[:5])]


def _position_forms(spec: str) -> list[bytes]:
    """chunktopk's positions in the two forms its encoder did not pick for the seed: a raw
    bitmap and a zstd-compressed one (each tensor's, built from where the seed's values are)."""
    import zstandard

    msg = encode_update(spec)
    payload = []
    for enc in typing.cast(Any, msg).payload:
        n = enc.numel
        bitmap = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
        bitmap[np.flatnonzero(get_codec(spec).decode(enc).reshape(-1))] = 1
        payload.append((enc, np.packbits(bitmap)))
    out = []
    for form in ("bitmap", "zbitmap"):
        variant = []
        for enc, raw in payload:
            pos = raw if form == "bitmap" else zstandard.ZstdCompressor().compress(raw.tobytes())
            meta = {**enc.meta, "positions": form, "rice": 0}
            buffers = (np.frombuffer(bytes(pos), np.uint8), *enc.buffers[1:])
            variant.append(dataclasses.replace(enc, meta=meta, buffers=buffers))
        frames = _wire(dataclasses.replace(typing.cast(Any, msg), payload=tuple(variant)))
        head = msgpack.unpackb(frames[0], raw=False)
        out.append(pack_frames([bytes(msgpack.packb(head["p"], use_bin_type=True)), *frames[1:]]))
    return out


def _codec_target(spec: str) -> Target:
    def seeds() -> list[bytes]:
        extra = _position_forms(spec) if spec.startswith("chunktopk") else []
        return [pack_frames(_index(spec)), *extra]

    return Target(f"codec:{spec}", _codec(spec), (ValueError,), "frames", seeds)


def tokens(targets: Sequence[Target]) -> list[str]:
    """Every string inside the msgpack frames of the targets' seeds (codec names, position
    forms, field names): what a mutation puts in place of a string."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, str) and len(value) <= 64:
            found.add(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for target in targets:
        for seed in target.seeds():
            frames = unpack_frames(seed)
            for frame in [f for m in frames for f in unpack_frames(m)] + frames:
                try:
                    walk(msgpack.unpackb(frame, raw=False, strict_map_key=False))
                except Exception:  # not msgpack: nothing to take
                    continue
    return sorted(found)


def all_targets() -> list[Target]:
    """Every target, in a fixed order (an input's first byte picks one by its index)."""
    wire = (WireError,)
    return [
        Target("frames", _frames, wire, "frames", _message_seeds),
        Target("header", _header, wire, "raw", _header_seeds),
        Target("tensors", _tensors, wire, "frames", _tensor_seeds),
        Target("initial_model", _initial, wire, "frames", _tensor_seeds),
        Target("chunks", _chunks, (), "nested", _chunk_seeds),
        Target("ack", _ack, wire, "raw", _ack_seeds),
        *(_codec_target(spec) for spec in CODEC_SPECS),
        Target("certificate", _certificate, (AuthError,), "raw", lambda: [pki().site_der]),
        Target("ca_certificate", _ca_certificate, (AuthError,), "raw", lambda: [pki().ca_der]),
        Target("crl", _crl, (AuthError,), "raw", lambda: [pki().crl_der]),
        Target("zap", _zap, (), "frames", _zap_seeds),
    ]
