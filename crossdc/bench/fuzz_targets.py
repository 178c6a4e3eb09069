"""What ``crossdc bench fuzz`` feeds bytes to: every decoder that reads bytes from the network.

A :class:`Target` is one decoder entry point, the exceptions that are its documented refusal
(``WireError`` for frames, ``ValueError`` for a codec's decode, ``AuthError`` for certificates
and revocation lists), how its inputs are laid out and its valid seeds
(``crossdc.bench.fuzz_seeds``). :func:`judge` runs one input: a refusal or a success is fine;
any other exception, or a result that breaks the decoder's contract (a codec returning anything
but a fresh, finite float32 array of the tensor's shape), is a :class:`Finding`. Each target
reads its input as the receiver does: a channel's size bound, the replay check and the receive
budget before reassembly, the model's shapes before a tensor is decoded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import traceback
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.security.certs import Certificate, parse_ca_bundle, parse_ca_certificate
from comm.security.common import AuthError
from comm.security.crl import parse_revocation_bundle, parse_revocations
from comm.security.zap import decide
from comm.transport.credit import TransferConfig
from comm.transport.receiver import TransferReceiver
from comm.wire.frames import ReplayGuard, WireError, from_wire, from_wire_envelope
from comm.wire.schema import PROTOCOL_VERSION, Chunk, ChunkAck, ErrorCode, MessageType
from comm.wire.tensors import decode_tensors
from coordinator.intake import INITIAL_MODEL_CODECS
from crossdc.bench.fuzz_seeds import (
    CHUNK_BYTES,
    CODEC_SPECS,
    MODEL_SHAPES,
    NOW,
    ack_seeds,
    chunk_seeds,
    codec_seeds,
    header_seeds,
    message_seeds,
    pem_of,
    pki,
    tensor_seeds,
    unpack_frames,
    zap_seeds,
)

MAX_MESSAGE_BYTES = 1 << 20
"""The bound a receiving channel passes to ``from_wire`` (its ``max_message_bytes``)."""

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


@contextlib.contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`InputTimeout` in this (main) thread once it used ``seconds`` of CPU.
    ``ITIMER_VIRTUAL``: SIGALRM stays free for libFuzzer and pytest-timeout."""

    def expired(_signum: int, _frame: object) -> None:
        raise InputTimeout(f"ran past the per-input limit of {seconds:g} s of CPU")

    previous = signal.signal(signal.SIGVTALRM, expired)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def warm_up(targets: list[Target], limit_s: float = 20.0) -> None:
    """Run every seed once: what a first decode imports (torch, for most codecs) is paid here,
    not counted against the per-input limit of the first input that needs it. A seed is given
    ``limit_s`` of CPU (a seed that hangs is found again when it is fuzzed)."""
    for target in targets:
        for data in target.seeds():
            with cpu_limit(limit_s):
                judge(target, data)


def judge(target: Target, data: bytes) -> Finding | None:
    """Run one input; a :class:`Finding` unless the decoder refused it or decoded it right."""
    try:
        target.run(data)
    except target.refusals:
        return None
    except InputTimeout as exc:
        return Finding(target.name, "hang", "InputTimeout", _where(exc), str(exc), data)
    except ContractError as exc:
        return Finding(target.name, "contract", "ContractError", _where(exc), str(exc), data)
    except Exception as exc:  # MemoryError and RecursionError included; not the runner's own
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


def _certificate(data: bytes) -> None:
    cert = Certificate.from_pem(pem_of(data, "CERTIFICATE"))
    cert.verify(pki().ca_public_key, NOW, site_id="eu", revoked={"2b"})


def _ca_certificate(data: bytes) -> None:
    parse_ca_certificate(pem_of(data, "CERTIFICATE"))


def _ca_bundle(data: bytes) -> None:
    """``ca.pem`` as a rollover writes it: PEM blocks of CA certificates, read as text."""
    parse_ca_bundle(data)


def _crl_bundle(data: bytes) -> None:
    """``crl.pem`` of a rollover: one PEM CRL per CA, split and matched to its signer."""
    parse_revocation_bundle(data, [pki().ca_public_key])


def _bundle_seeds(der: bytes, kind: str) -> list[bytes]:
    one = pem_of(der, kind) + b"\n"
    return [one, one + one]


def _crl(data: bytes) -> None:
    parse_revocations(pem_of(data, "X509 CRL"), pki().ca_public_key).serials  # noqa: B018


def _zap(data: bytes) -> None:
    """A ZAP request as libzmq hands it over; ``decide`` answers everything."""
    decide(unpack_frames(data), pki().registry, now=NOW)


def _codec_target(spec: str) -> Target:
    return Target(f"codec:{spec}", _codec(spec), (ValueError,), "frames", lambda: codec_seeds(spec))


def all_targets() -> list[Target]:
    """Every target, in a fixed order (an input's first byte picks one by its index)."""
    wire = (WireError,)
    return [
        Target("frames", _frames, wire, "frames", message_seeds),
        Target("header", _header, wire, "raw", header_seeds),
        Target("tensors", _tensors, wire, "frames", tensor_seeds),
        Target("initial_model", _initial, wire, "frames", tensor_seeds),
        Target("chunks", _chunks, (), "nested", chunk_seeds),
        Target("ack", _ack, wire, "raw", ack_seeds),
        *(_codec_target(spec) for spec in CODEC_SPECS),
        Target("certificate", _certificate, (AuthError,), "raw", lambda: [pki().site_der]),
        Target("ca_certificate", _ca_certificate, (AuthError,), "raw", lambda: [pki().ca_der]),
        Target("crl", _crl, (AuthError,), "raw", lambda: [pki().crl_der]),
        Target(
            "ca_bundle",
            _ca_bundle,
            (AuthError,),
            "raw",
            lambda: _bundle_seeds(pki().ca_der, "CERTIFICATE"),
        ),
        Target(
            "crl_bundle",
            _crl_bundle,
            (AuthError,),
            "raw",
            lambda: _bundle_seeds(pki().crl_der, "X509 CRL"),
        ),
        Target("zap", _zap, (), "frames", zap_seeds),
    ]
