"""The inputs of ``crossdc bench fuzz``: the container its inputs use, valid seeds for every
target, and the strings a mutation may put in place of a string.

Frame lists travel as a small container (:func:`pack_frames`: a count byte, then each frame with
a 16-bit length), so one input holds a message's header and its data frames, or several
messages (the chunk reassembly target). Seeds are valid: every message type with every field
filled, an update's payload in every codec (chunktopk's positions in each of their forms), three
chunked transfers interleaved so that one waits for the receive budget, a site and a CA
certificate and a revocation list made by a CA of their own (:func:`pki`), ZAP requests.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgpack
import numpy as np

from comm.codecs.registry import get_codec
from comm.security.certs import make_ca_certificate, make_site_certificate, parse_ca_certificate
from comm.security.crl import Revocation, RevocationList
from comm.security.registry import CertificateRegistry
from comm.security.zap import DOMAIN, ZAP_VERSION
from comm.wire.chunking import split_frames
from comm.wire.frames import to_wire
from comm.wire.schema import MESSAGE_CLASSES, ChunkAck, Message, MessageType
from comm.wire.tensors import encode_tensors

if typing.TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
MODEL_SHAPES = {"w": (8, 64), "b": (64,)}
"""The model a receiver holds in these targets (the seeds' tensors): the coordinator decodes an
update, and a site a result, only against the shapes it holds."""

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


# ---- a CA of its own ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """A CA, a site certificate under it and a revocation list, made once per process."""

    ca_der: bytes
    site_der: bytes
    crl_der: bytes
    site_public: bytes
    ca_public_key: Ed25519PublicKey
    registry: CertificateRegistry


def der_of(pem: bytes) -> bytes:
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return base64.b64decode(body)


def pem_of(der: bytes, kind: str) -> bytes:
    body = base64.encodebytes(der).replace(b"\n", b"")
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return b"\n".join(
        [f"-----BEGIN {kind}-----".encode(), *lines, f"-----END {kind}-----".encode()]
    )


@cache
def pki() -> Pki:
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
    ca = parse_ca_certificate(ca_pem)
    registry = CertificateRegistry([ca], [site], {ca.fingerprint: revs})
    return Pki(der_of(ca_pem), site.der, der_of(crl_pem), public, ca.public_key, registry)


NOW = 1_700_000_100.0
"""When certificates are checked: inside the seed certificates' validity."""


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


def message_seeds() -> list[bytes]:
    return [pack_frames(_wire(_sample(cls))) for cls in MESSAGE_CLASSES.values()]


def header_seeds() -> list[bytes]:
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


def tensor_seeds() -> list[bytes]:
    return [pack_frames(_index(spec)) for spec in CODEC_SPECS]


def chunk_seeds() -> list[bytes]:
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


def ack_seeds() -> list[bytes]:
    from comm.transport.credit import encode_ack

    return [encode_ack(ChunkAck(transfer_id="t0", next_index=2, credit_bytes=8192))]


def zap_seeds() -> list[bytes]:
    from comm.security.common import curve_raw

    key = curve_raw(pki().site_public)
    base = [ZAP_VERSION, b"7", DOMAIN, b"10.0.0.1", b"", b"CURVE"]
    return [pack_frames([*base, key]), pack_frames([*base, bytes(32)]), pack_frames(base[:5])]


def position_forms(spec: str) -> list[bytes]:
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


def tokens(seed_lists: Iterable[list[bytes]]) -> list[str]:
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

    for seeds in seed_lists:
        for seed in seeds:
            frames = unpack_frames(seed)
            for frame in [f for m in frames for f in unpack_frames(m)] + frames:
                try:
                    walk(msgpack.unpackb(frame, raw=False, strict_map_key=False))
                except Exception:  # not msgpack: nothing to take
                    continue
    return sorted(found)


def codec_seeds(spec: str) -> list[bytes]:
    """An update's payload in ``spec`` (and chunktopk's other position forms)."""
    extra = position_forms(spec) if spec.startswith("chunktopk") else []
    return [pack_frames(_index(spec)), *extra]
