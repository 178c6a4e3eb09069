"""Named float32 tensors as payloads: encode a parameter set with a codec, decode and check it.

Both roles use these so their view of "the same parameters" is computed one way: the state hash
that sites and the coordinator compare after every round is :func:`state_hash`, and the ranks of
a site that holds its model in shards compute the same hash from their shards
(:func:`boundary_piece`, :func:`partial_digests`, :func:`combine`, :func:`model_hash`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor, FloatArray, NonFiniteError, PayloadCodec, TensorLike
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode

TensorSpec = Mapping[str, tuple[int, ...]]


# ---- the state hash ------------------------------------------------------------------------
#
# A tensor's flat float32 values (little-endian) are cut into blocks of HASH_BLOCK elements, the
# last one shorter. Each block has a digest; a tensor's digest binds its name, its shape and its
# block digests in order; the model's hash binds its tensors' digests in name order. Every level
# is BLAKE2b with its own personalisation, so a digest of one level is never taken for another.
# Who cuts the model how does not matter: a process holding the whole model and the ranks of a
# sharded site, each holding a flat range of each tensor, compute the same hash.
#
# A sharded site, per tensor (its ranks' ranges [s_r, e_r) tile [0, numel) in rank order; under
# FSDP2's dim-0 sharding s_r = first row x elements per row):
#   1. each rank whose s_r is not a multiple of HASH_BLOCK sends boundary_piece(...) (its values
#      up to the next block boundary, less than a block) to the rank holding that block's first
#      element: a boundary cuts at most one block, so at most one piece per rank and tensor
#      crosses (an all-gather of the pieces does as well);
#   2. each rank calls partial_digests(name, shape, s_r, its values, the pieces received): the
#      digests of the blocks that begin in its range, 32 bytes per 256 KiB of values;
#   3. one rank gathers the digests and calls combine(name, shape, [each rank's]) per tensor and
#      model_hash over the tensors' digests.

HASH_BLOCK = 1 << 16
"""Elements per hashed block (256 KiB of float32)."""
_F32LE = np.dtype("<f4")
_BLOCK_PERSON, _TENSOR_PERSON, _MODEL_PERSON = b"crossdc:block", b"crossdc:tensor", b"crossdc:model"
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class BoundaryPiece:
    """Values of one tensor's block that begins in another rank's range: ``values`` are the
    flat elements ``[start, start + len(values))``, all within one block."""

    name: str
    start: int
    values: FloatArray


def _flat(values: np.ndarray) -> npt.NDArray[np.float32]:
    """``values`` flattened as little-endian float32 (no copy when they already are)."""
    return np.ascontiguousarray(values, dtype=_F32LE).reshape(-1)


def _numel(name: str, shape: Sequence[int]) -> int:
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: negative dimension in {tuple(shape)}")
    return math.prod(int(d) for d in shape)


def _span(name: str, shape: Sequence[int], flat_start: int, count: int) -> tuple[int, int]:
    """(numel, end) of ``count`` values at ``flat_start``; ValueError when they lie outside."""
    numel = _numel(name, shape)
    if flat_start < 0 or flat_start + count > numel:
        raise ValueError(
            f"tensor {name!r}: values [{flat_start}, {flat_start + count}) lie outside its "
            f"{numel} elements"
        )
    return numel, flat_start + count


def _block_digest(values: npt.NDArray[np.float32]) -> bytes:
    return hashlib.blake2b(values.data, digest_size=32, person=_BLOCK_PERSON).digest()


def boundary_piece(
    name: str, full_shape: Sequence[int], flat_start: int, values: np.ndarray
) -> BoundaryPiece | None:
    """What a rank holding the flat range ``[flat_start, flat_start + values.size)`` of tensor
    ``name`` sends for the hash: its values of the block its range begins inside of (up to the
    block's end or its own), which the rank holding that block's first element completes
    (:func:`partial_digests`). None when its range begins a block (or is empty). A view of
    ``values``, less than one block."""
    flat = _flat(values)
    _span(name, full_shape, flat_start, flat.size)
    if not flat.size or flat_start % HASH_BLOCK == 0:
        return None
    stop = min(flat.size, HASH_BLOCK - flat_start % HASH_BLOCK)
    return BoundaryPiece(name, flat_start, flat[:stop])


def partial_digests(
    name: str,
    full_shape: Sequence[int],
    flat_start: int,
    values: np.ndarray,
    received: Iterable[BoundaryPiece] = (),
) -> dict[int, bytes]:
    """The digests of the blocks of tensor ``name`` that begin in the flat range ``values``
    hold (``[flat_start, flat_start + values.size)``), by block index.

    Every block lying wholly in the range is hashed from ``values``. The last one may run past
    the range's end ``e``: its rest, ``[e, block end)``, comes from the pieces ``received``
    (:func:`boundary_piece` of the ranks after), which must cover it exactly; pieces of other
    tensors or other places are ignored, so a rank may be handed every rank's pieces. ValueError
    names the tensor when the values lie outside it or the pieces do not complete the block."""
    flat = _flat(values)
    numel, end = _span(name, full_shape, flat_start, flat.size)
    first, stop = -(-flat_start // HASH_BLOCK), -(-end // HASH_BLOCK)
    out: dict[int, bytes] = {}
    for i in range(first, stop):
        lo, hi = i * HASH_BLOCK, min((i + 1) * HASH_BLOCK, numel)
        if hi <= end:
            out[i] = _block_digest(flat[lo - flat_start : hi - flat_start])
        else:
            out[i] = _block_digest(_completed(name, flat[lo - flat_start :], end, hi, received))
    return out


def _completed(
    name: str,
    head: npt.NDArray[np.float32],
    end: int,
    hi: int,
    received: Iterable[BoundaryPiece],
) -> npt.NDArray[np.float32]:
    """A block's values: ``head`` (ending at ``end``) and the pieces covering ``[end, hi)``."""
    parts = [head]
    at = end
    for piece in sorted(
        (p for p in received if p.name == name and end <= p.start < hi), key=lambda p: p.start
    ):
        flat = _flat(piece.values)
        if piece.start != at or piece.start + flat.size > hi:
            raise ValueError(
                f"tensor {name!r}: a piece of values [{piece.start}, {piece.start + flat.size}) "
                f"where the block ending at {hi} continues at {at}"
            )
        parts.append(flat)
        at += flat.size
    if at != hi:
        raise ValueError(
            f"tensor {name!r}: the block ending at {hi} needs values [{end}, {hi}) from the next "
            f"ranks; the pieces received end at {at}"
        )
    return np.concatenate(parts)


def combine(name: str, full_shape: Sequence[int], parts: Iterable[Mapping[int, bytes]]) -> bytes:
    """Tensor ``name``'s digest from its block digests, as ranks computed them
    (:func:`partial_digests`): every block exactly once. ValueError names the tensor and the
    blocks missing, repeated or beyond its end."""
    numel = _numel(name, full_shape)
    count = -(-numel // HASH_BLOCK)
    blocks: dict[int, bytes] = {}
    for part in parts:
        for i, digest in part.items():
            if not 0 <= i < count:
                raise ValueError(f"tensor {name!r}: block {i} beyond its {count} blocks")
            if i in blocks:
                raise ValueError(f"tensor {name!r}: block {i} digested twice")
            blocks[i] = digest
    if len(blocks) != count:
        missing = sorted(set(range(count)) - set(blocks))
        raise ValueError(f"tensor {name!r}: {len(missing)} blocks missing, from {missing[:3]}")
    h = hashlib.blake2b(digest_size=32, person=_TENSOR_PERSON)
    encoded = name.encode()
    h.update(_U64.pack(len(encoded)) + encoded + _U64.pack(len(full_shape)))
    h.update(b"".join(_U64.pack(int(d)) for d in full_shape))
    h.update(b"".join(blocks[i] for i in range(count)))
    return h.digest()


def tensor_digest(name: str, value: np.ndarray) -> bytes:
    """The digest of one whole tensor (what :func:`combine` gives from any split of it)."""
    shape = tuple(np.shape(value))
    return combine(name, shape, [partial_digests(name, shape, 0, value)])


def model_hash(digests: Mapping[str, bytes]) -> str:
    """The state hash of a model from its tensors' digests (:func:`combine`)."""
    h = hashlib.blake2b(digest_size=16, person=_MODEL_PERSON)
    h.update(_U64.pack(len(digests)))
    for name in sorted(digests):
        h.update(digests[name])
    return h.hexdigest()


def state_hash(params: Mapping[str, np.ndarray]) -> str:
    """The state hash of a model held whole: BLAKE2b over its tensors' digests in name order,
    each over the tensor's name, shape and the digests of its blocks of :data:`HASH_BLOCK`
    float32 values (see :func:`partial_digests` for a model held in shards)."""
    return model_hash({name: tensor_digest(name, value) for name, value in params.items()})


def spec_of(params: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(arr.shape) for name, arr in params.items()}


def encode_tensors(
    params: Mapping[str, np.ndarray], codec: PayloadCodec
) -> tuple[EncodedTensor, ...]:
    return tuple(
        codec.encode(name, np.asarray(arr, dtype=np.float32)) for name, arr in params.items()
    )


def encode_slice(name: str, rows: TensorLike, start: int, codec: PayloadCodec) -> EncodedTensor:
    """Rows ``[start, start + len(rows))`` of tensor ``name`` (a shard of it), encoded with
    ``codec`` and named as that slice (:attr:`EncodedTensor.rows`). A torch tensor is encoded
    where it lies (a shard on its device)."""
    arr = rows if hasattr(rows, "detach") else np.asarray(rows, dtype=np.float32)
    if arr.ndim < 1 or not arr.shape[0] or start < 0:
        raise ValueError(f"tensor {name!r}: a slice is one row or more at a row >= 0")
    return replace(codec.encode(name, arr), rows=(start, start + int(arr.shape[0])))


def decode_tensors(
    payload: Sequence[EncodedTensor],
    expected: TensorSpec | None = None,
    *,
    codecs: Collection[str] | None = None,
    slices: bool = False,
) -> dict[str, FloatArray]:
    """Decode a payload, checking names and shapes against ``expected``, the codecs against
    ``codecs`` (None: any), and finiteness.

    Without ``expected`` a tensor is as large as its shape says: a sparse codec's few bytes
    can claim billions of elements. A receiver that has no shapes to expect (the initial
    model) names the dense codecs it takes, whose decoded size is what arrived.

    ``slices``: a tensor may come as slices of its rows (a sharded site's update), which must
    cover it exactly once (:func:`check_slices`); each is decoded on its own and they are put
    together into the whole tensor. Otherwise (and always without ``expected``) a slice is
    refused.

    Raises :class:`WireError` (BAD_PAYLOAD, UNKNOWN_CODEC or NON_FINITE) naming the tensor.
    """
    if not slices or expected is None:
        sliced = next((enc for enc in payload if enc.rows is not None), None)
        if sliced is not None:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"tensor {sliced.name!r} comes as rows {sliced.rows}: whole tensors expected",
            )
    groups = check_slices(payload, expected)
    out: dict[str, FloatArray] = {}
    for name, pieces in groups.items():
        if pieces[0].rows is None:
            out[name] = _decode_one(pieces[0], codecs)
            continue
        assert expected is not None  # slices are refused without shapes to expect
        whole = np.empty(expected[name], dtype=np.float32)
        for enc in pieces:
            start, stop = enc.rows or (0, 0)
            decode_into(enc, whole[start:stop], codecs=codecs)
        out[name] = whole
    return out


def check_slices(
    payload: Sequence[EncodedTensor], expected: TensorSpec | None
) -> dict[str, list[EncodedTensor]]:
    """The payload's pieces by tensor name, checked without decoding anything: the names are
    ``expected``'s; a tensor comes whole, once, in the shape expected, or as slices of its
    rows that cover them exactly once (no gap, no overlap, none beyond its rows, no whole
    tensor besides). Raises :class:`WireError` (BAD_PAYLOAD) naming the tensor."""
    groups: dict[str, list[EncodedTensor]] = {}
    for enc in payload:
        groups.setdefault(enc.name, []).append(enc)
    if expected is not None and set(groups) != set(expected):
        missing = sorted(set(expected) - set(groups))[:3]
        extra = sorted(set(groups) - set(expected))[:3]
        raise WireError(
            ErrorCode.BAD_PAYLOAD, f"tensor names differ: missing {missing} extra {extra}"
        )
    for name, pieces in groups.items():
        whole = [enc for enc in pieces if enc.rows is None]
        if len(whole) > 1:
            raise WireError(ErrorCode.BAD_PAYLOAD, f"tensor {name!r} appears twice")
        if whole and len(pieces) > 1:
            raise WireError(ErrorCode.BAD_PAYLOAD, f"tensor {name!r} comes whole and in slices")
        if expected is None:
            continue
        shape = tuple(expected[name])
        if whole:
            if tuple(whole[0].shape) != shape:
                raise WireError(
                    ErrorCode.BAD_PAYLOAD,
                    f"tensor {name!r} has shape {whole[0].shape}, expected {shape}",
                )
            continue
        _check_rows(name, shape, pieces)
    return groups


def _check_rows(name: str, shape: tuple[int, ...], pieces: Sequence[EncodedTensor]) -> None:
    """Slices of tensor ``name`` (of ``shape``) cover its rows exactly once."""
    if not shape:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"tensor {name!r} has no rows to slice")
    at = 0
    for enc in sorted(pieces, key=lambda e: e.rows or (0, 0)):
        start, stop = enc.rows or (0, 0)
        want = (stop - start, *shape[1:])
        if stop > shape[0]:
            detail = f"rows {start}:{stop} beyond its {shape[0]} rows"
        elif tuple(enc.shape) != want:
            detail = f"rows {start}:{stop} have shape {tuple(enc.shape)}, expected {want}"
        elif start > at:
            detail = f"rows {at}:{start} missing"
        elif start < at:
            detail = f"rows {start}:{stop} overlap rows before {at}"
        else:
            at = stop
            continue
        raise WireError(ErrorCode.BAD_PAYLOAD, f"tensor {name!r}: {detail}")
    if at != shape[0]:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"tensor {name!r}: rows {at}:{shape[0]} missing")


def _codec_of(enc: EncodedTensor, codecs: Collection[str] | None) -> PayloadCodec:
    """The codec a piece names, when it is one of ``codecs`` (None: any); WireError naming it."""
    if codecs is not None and enc.codec not in codecs:
        raise WireError(
            ErrorCode.BAD_PAYLOAD, f"{enc.name!r} is {enc.codec!r}, expected {sorted(codecs)}"
        )
    try:
        return get_codec(enc.codec)
    except ValueError as exc:
        raise WireError(ErrorCode.UNKNOWN_CODEC, f"{enc.name!r}: {exc}") from None


@contextmanager
def _wire_errors(enc: EncodedTensor) -> Iterator[None]:
    """A codec's refusal of ``enc`` as the WireError a peer is told (NON_FINITE, BAD_PAYLOAD)."""
    try:
        yield
    except NonFiniteError as exc:
        raise WireError(ErrorCode.NON_FINITE, str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"{enc.name!r}: {exc}") from None


def _decode_one(enc: EncodedTensor, codecs: Collection[str] | None) -> FloatArray:
    """One piece decoded (its shape already checked), finite; WireError naming it."""
    codec = _codec_of(enc, codecs)
    with _wire_errors(enc):
        arr = codec.decode(enc)
    if arr.shape != tuple(enc.shape):
        raise WireError(ErrorCode.BAD_PAYLOAD, f"{enc.name!r} decoded to shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise WireError(ErrorCode.NON_FINITE, f"{enc.name!r} holds NaN or Inf")
    return arr


def decode_into(
    enc: EncodedTensor,
    out: np.ndarray,
    start: int = 0,
    *,
    codecs: Collection[str] | None = None,
) -> None:
    """Decode the flat elements ``[start, start + out.size)`` of one encoded tensor into
    ``out`` (a writable C-contiguous float32 array), bit for bit what decoding it whole gives
    there; the dense codecs read only the blocks covering the range, a bounded tile at a time.
    Raises :class:`WireError` naming the tensor: UNKNOWN_CODEC, NON_FINITE (a value in the
    range), or BAD_PAYLOAD (a codec not in ``codecs``, a malformed encoding, or a range outside
    the tensor)."""
    codec = _codec_of(enc, codecs)
    with _wire_errors(enc):
        codec.decode_into(enc, out, start)


def accumulate(
    enc: EncodedTensor,
    out: np.ndarray,
    weight: float,
    start: int = 0,
    *,
    codecs: Collection[str] | None = None,
    fresh: bool = False,
) -> None:
    """``out += float32(weight) * decoded[start:start + out.size]``, in float32 and in place,
    a bounded tile at a time (no array of the tensor's size); ``fresh``: ``out`` holds nothing
    yet and is written without being read, bit for bit as adding into zeros. It does not check
    that the values are finite: :func:`check_payload` (or the codec's ``sum_squares``) does,
    before a fold adds anything. WireError as :func:`decode_into`."""
    codec = _codec_of(enc, codecs)
    with _wire_errors(enc):
        codec.accumulate(enc, out, weight, start, fresh=fresh)


def sum_squares(enc: EncodedTensor, *, codecs: Collection[str] | None = None) -> float:
    """Σ x² over one encoded tensor's decoded values, from the encoded values (no float copy
    of the tensor); refuses what decoding refuses, with the same WireError."""
    codec = _codec_of(enc, codecs)
    with _wire_errors(enc):
        return codec.sum_squares(enc)


def check_payload(
    payload: Sequence[EncodedTensor],
    expected: TensorSpec,
    *,
    codecs: Collection[str] | None = None,
    slices: bool = False,
) -> tuple[dict[str, list[EncodedTensor]], float]:
    """What :func:`decode_tensors` checks of a payload, without decoding it: names and shapes
    against ``expected`` (``slices``: a tensor may come as slices of its rows, which must cover
    it exactly once, :func:`check_slices`), the codecs, every piece's buffers and that its
    values are finite. Returns its pieces by tensor name and its L2 norm over every piece (the
    whole update's, however it was sliced). Raises :class:`WireError` as decode_tensors does."""
    if not slices:
        sliced = next((enc for enc in payload if enc.rows is not None), None)
        if sliced is not None:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"tensor {sliced.name!r} comes as rows {sliced.rows}: whole tensors expected",
            )
    groups = check_slices(payload, expected)
    total = 0.0
    for pieces in groups.values():
        for enc in pieces:
            total += sum_squares(enc, codecs=codecs)
    return groups, math.sqrt(total)


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
