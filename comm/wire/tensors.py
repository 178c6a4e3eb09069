"""Named float32 tensors as payloads: encode a parameter set with a codec, decode and check it.

Both roles use these so their view of "the same parameters" is computed one way: the state hash
that sites and the coordinator compare after every round is :func:`state_hash`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from comm.codecs.base import EncodedTensor, FloatArray, NonFiniteError, PayloadCodec
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode

TensorSpec = Mapping[str, tuple[int, ...]]


def state_hash(params: Mapping[str, np.ndarray]) -> str:
    """BLAKE2b over names, shapes and float32 bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(params):
        arr = np.ascontiguousarray(params[name], dtype=np.float32)
        h.update(name.encode())
        h.update(repr(tuple(arr.shape)).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def spec_of(params: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(arr.shape) for name, arr in params.items()}


def encode_tensors(
    params: Mapping[str, np.ndarray], codec: PayloadCodec
) -> tuple[EncodedTensor, ...]:
    return tuple(
        codec.encode(name, np.asarray(arr, dtype=np.float32)) for name, arr in params.items()
    )


def decode_tensors(
    payload: Sequence[EncodedTensor],
    expected: TensorSpec | None = None,
    *,
    codecs: Collection[str] | None = None,
) -> dict[str, FloatArray]:
    """Decode a payload, checking names and shapes against ``expected``, the codecs against
    ``codecs`` (None: any), and finiteness.

    Without ``expected`` a tensor is as large as its shape says: a sparse codec's few bytes
    can claim billions of elements. A receiver that has no shapes to expect (the initial
    model) names the dense codecs it takes, whose decoded size is what arrived.

    Raises :class:`WireError` (BAD_PAYLOAD, UNKNOWN_CODEC or NON_FINITE) naming the tensor.
    """
    names = [enc.name for enc in payload]
    if len(set(names)) != len(names):
        raise WireError(ErrorCode.BAD_PAYLOAD, "a tensor name appears twice")
    if expected is not None and set(names) != set(expected):
        missing = sorted(set(expected) - set(names))[:3]
        extra = sorted(set(names) - set(expected))[:3]
        raise WireError(
            ErrorCode.BAD_PAYLOAD, f"tensor names differ: missing {missing} extra {extra}"
        )
    out: dict[str, FloatArray] = {}
    for enc in payload:
        if codecs is not None and enc.codec not in codecs:
            raise WireError(
                ErrorCode.BAD_PAYLOAD, f"{enc.name!r} is {enc.codec!r}, expected {sorted(codecs)}"
            )
        if expected is not None and tuple(enc.shape) != tuple(expected[enc.name]):
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"{enc.name!r} has shape {enc.shape}, expected {expected[enc.name]}",
            )
        try:
            codec = get_codec(enc.codec)
        except ValueError as exc:
            raise WireError(ErrorCode.UNKNOWN_CODEC, f"{enc.name!r}: {exc}") from None
        try:
            arr = codec.decode(enc)
        except NonFiniteError as exc:
            raise WireError(ErrorCode.NON_FINITE, str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise WireError(ErrorCode.BAD_PAYLOAD, f"{enc.name!r}: {exc}") from None
        if arr.shape != tuple(enc.shape):
            raise WireError(ErrorCode.BAD_PAYLOAD, f"{enc.name!r} decoded to shape {arr.shape}")
        if not np.isfinite(arr).all():
            raise WireError(ErrorCode.NON_FINITE, f"{enc.name!r} holds NaN or Inf")
        out[enc.name] = arr
    return out


def split_parts(
    payload: Sequence[EncodedTensor], weights: Sequence[float]
) -> list[tuple[float, tuple[EncodedTensor, ...]]]:
    """A sparse broadcast's payload cut into its updates: one per weight, each the same tensor
    names in the same order. Raises :class:`WireError` (BAD_PAYLOAD) naming what is wrong."""
    if not weights:
        raise WireError(ErrorCode.BAD_PAYLOAD, "a sparse broadcast of no updates")
    if not all(np.isfinite(w) and w > 0 for w in weights):
        raise WireError(ErrorCode.BAD_PAYLOAD, f"update weights {list(weights)} must be > 0")
    if not payload or len(payload) % len(weights):
        raise WireError(
            ErrorCode.BAD_PAYLOAD,
            f"{len(payload)} tensors do not split into {len(weights)} equal updates",
        )
    per = len(payload) // len(weights)
    parts = [tuple(payload[i * per : (i + 1) * per]) for i in range(len(weights))]
    names = [enc.name for enc in parts[0]]
    for i, part in enumerate(parts[1:], 1):
        if [enc.name for enc in part] != names:
            raise WireError(ErrorCode.BAD_PAYLOAD, f"update {i} names other tensors than update 0")
    return list(zip((float(w) for w in weights), parts, strict=True))


def decode_parts(
    payload: Sequence[EncodedTensor], weights: Sequence[float], expected: TensorSpec
) -> list[tuple[float, dict[str, FloatArray]]]:
    """A sparse broadcast's updates decoded, each checked as :func:`decode_tensors` checks a
    payload against the shapes ``expected`` of the tensors it names."""
    parts = split_parts(payload, weights)
    names = [enc.name for enc in parts[0][1]]
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"unknown tensors {unknown[:3]}")
    spec = {n: expected[n] for n in names}
    return [(w, decode_tensors(part, spec)) for w, part in parts]


def _layer_key(name: str) -> str:
    """``layers.3.attn.w`` -> ``layers.3``; names without a numbered prefix are their own key."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def fragments(names: Sequence[str], num_fragments: int) -> list[list[str]]:
    """Split tensor names into ``num_fragments`` groups, strided over layers.

    Tensors of one layer (same numbered prefix) stay together; layer *i* (in order of first
    appearance) goes to fragment ``i % num_fragments``, so every fragment spans the depth of the
    model (Streaming DiLoCo). A fragment may be empty when there are fewer layers than fragments.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    keys: dict[str, int] = {}
    out: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in names:
        index = keys.setdefault(_layer_key(name), len(keys))
        out[index % num_fragments].append(name)
    return out


def global_signed_bytes(
    global_version: int, base_version: int, fragment: int, digest: str
) -> bytes:
    """What the coordinator signs for a Global message: the versions, the fragment and the
    state hash (which covers every parameter value after applying)."""
    return f"global:{global_version}:{base_version}:{fragment}:{digest}".encode()
