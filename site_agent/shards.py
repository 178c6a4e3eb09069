"""One rank's part of a site whose model is held in row shards (FSDP2's ``fully_shard``).

Under ``fully_shard`` every parameter is a DTensor placed ``Shard(0)`` on a 1-D mesh: rank r
holds rows ``[start, stop)`` of dim 0 (torch.chunk's split, so the last ranks may hold fewer
rows, or none). :class:`RankShards` is what one rank keeps for the federation, for its rows
only and on the shard's device: θ (the global model as last synced) and the error-feedback
residual, both float32. No rank builds a tensor it does not own.

- :meth:`RankShards.shard_update` computes the rank's pseudo-gradient Δ = θ − θ_local, adds its
  residual, encodes it as a row slice (``comm.wire.tensors.encode_slice``) and keeps what the
  encoding lost: the rank's ``comm.codecs.feedback.ErrorFeedback`` holds its rows' residuals
  on the shard's device.
  :func:`gather_slices` gathers every rank's encoded slices to one rank over the site's process
  group: the encoded bytes are all that cross. The coordinator puts the slices together
  (``decode_tensors(..., slices=True)``) and folds them as it folds whole tensors.
- :func:`shard_hash` is ``state_hash`` of the whole θ, computed from the shards: each rank hashes
  the blocks that begin in its rows, the blocks cut by a shard boundary completed from the next
  ranks' boundary pieces (less than a hash block each); the digests are gathered and combined on
  one rank.
- :meth:`RankShards.load_global` / :meth:`RankShards.apply_delta` take a decoded result of whole
  tensors and keep only the rank's rows of it; :meth:`RankShards.replace_theta` takes rows
  already cut (``site_agent.shardsync`` decodes only each rank's range of a result's encoded
  tensors, and puts the rows back when the result's hash is not the coordinator's).

- :meth:`RankShards.state_dict` gives θ and the residuals as DTensors placed as the parameters
  are, for ``torch.distributed.checkpoint``: each rank writes its rows, and a site of another
  layout loads them by resharding (:meth:`RankShards.load_state_dict`).

A parameter that is not a DTensor, or is replicated, is held whole by every rank: rank 0 sends
and hashes it, the others skip it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from comm.codecs.base import EncodedTensor, FloatArray, PayloadCodec, TensorLike
from comm.codecs.feedback import ErrorFeedback
from comm.wire.tensors import (
    HASH_BLOCK,
    BoundaryPiece,
    combine,
    encode_slice,
    model_hash,
    partial_digests,
)
from site_agent.rankbytes import gather_encoded
from site_agent.rankfailure import Failed, failed, raise_first


@dataclass(frozen=True)
class RowRange:
    """The rows ``[start, stop)`` of dim 0 of tensor ``name`` (of ``shape``, the whole
    tensor's) that a rank holds; ``whole``: every rank holds the whole tensor (not sharded), and
    only rank 0 sends and hashes it."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    whole: bool = False

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def flat_start(self) -> int:
        """The flat index of the range's first element in the whole tensor."""
        return self.start * self.row_numel


def row_range(name: str, param: torch.Tensor) -> RowRange:
    """The rows of ``param`` this rank holds: a DTensor's ``Shard(0)`` on a 1-D mesh (its local
    shard and global row offset, as torch computes them), or the whole tensor when it is not a
    DTensor or is replicated. ValueError names the tensor for any other placement."""
    shape = tuple(int(d) for d in param.shape)
    if not isinstance(param, DTensor):
        return RowRange(name, shape, 0, shape[0] if shape else 1, whole=True)
    placements = tuple(param.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return RowRange(name, shape, 0, shape[0] if shape else 1, whole=True)
    if param.device_mesh.ndim != 1 or placements != (Shard(0),) or not shape:
        raise ValueError(
            f"tensor {name!r}: placements {placements} on a {param.device_mesh.ndim}-D mesh; "
            "row shards need Shard(0) on a 1-D mesh (FSDP2's fully_shard)"
        )
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, placements
    )
    start = min(int(offset[0]), shape[0])
    return RowRange(name, shape, start, start + int(local_shape[0]))


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``param`` (a DTensor's local shard), detached."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.detach()


class RankShards:
    """What one rank of a sharded site keeps for the federation: for each parameter, its rows
    of θ and of the error-feedback residual, float32 on the shard's device.

    ``rank`` is the rank in the site's process group; a tensor held whole is owned by rank 0
    (``owns_whole`` says otherwise: on a pipelined site each stage's first replica owns the
    stage's whole tensors). ``shapes``: every federated tensor of the whole model, in
    ``state_dict`` order, where this rank holds only some of them (a pipeline stage's); by
    default the tensors it holds are the model's. Not thread-safe: one caller per instance.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        *,
        rank: int,
        decay: float = 1.0,
        owns_whole: bool | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """θ is the parameters as they are now (the global model the site last synced)."""
        self.feedback = ErrorFeedback(decay=decay)  # its residuals: this rank's rows, on device
        self.rank = rank
        self.decay = decay
        self._owns_whole = rank == 0 if owns_whole is None else owns_whole
        self.ranges: dict[str, RowRange] = {}
        self._theta: dict[str, torch.Tensor] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        for name, param in named_params:
            rows = row_range(name, param)
            self.ranges[name] = rows
            if isinstance(param, DTensor) and not rows.whole:
                self._meshes[name] = param.device_mesh
            self._theta[name] = local_part(param).to(torch.float32, copy=True)
        self.shapes: dict[str, tuple[int, ...]] = (
            {name: rows.shape for name, rows in self.ranges.items()}
            if shapes is None
            else {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        )
        """The whole model's federated tensors and their whole shapes (the hash is over them)."""
        for name, rows in self.ranges.items():
            if self.shapes.get(name) != rows.shape:
                raise ValueError(
                    f"tensor {name!r}: shape {rows.shape}, the model's is {self.shapes.get(name)}"
                )

    @classmethod
    def of_module(
        cls, module: torch.nn.Module, *, group: dist.ProcessGroup | None = None, decay: float = 1.0
    ) -> RankShards:
        """A rank's shards of ``module``'s parameters (``named_parameters``) as they are now."""
        return cls(module.named_parameters(), rank=dist.get_rank(group), decay=decay)

    def owns(self, name: str) -> bool:
        """Whether this rank sends and hashes rows of ``name`` (none when its shard is empty,
        or when it does not hold the tensor at all)."""
        rows = self.ranges.get(name)
        return rows is not None and rows.stop > rows.start and (not rows.whole or self._owns_whole)

    def theta(self, name: str) -> torch.Tensor:
        """This rank's rows of θ for ``name`` (the tensor kept: do not change it)."""
        return self._theta[name]

    def residual(self, name: str) -> torch.Tensor | None:
        """A copy of this rank's rows of the residual carried for ``name``, or None."""
        r = self.feedback.residual(name)
        assert r is None or isinstance(r, torch.Tensor)
        return r

    def residual_sq_norm(self) -> float:
        """The squared L2 norm of this rank's residual rows (summed over the ranks, the square
        of ``ErrorFeedback.residual_norm()`` of the whole model: the error still owed)."""
        return self.feedback.residual_sq_norm()

    # ---- the update ------------------------------------------------------------------------

    def shard_update(
        self,
        params: Mapping[str, torch.Tensor],
        codec: PayloadCodec,
        names: Iterable[str] | None = None,
    ) -> list[EncodedTensor]:
        """This rank's slices of the pseudo-gradient θ − ``params`` (the current local
        parameters, DTensors or their local shards) over ``names`` (default: all), each with the
        residual added and encoded with ``codec``; the residuals keep what the encodings lost.
        When one cannot be encoded (NonFiniteError, ValueError), every residual owes what it
        owed before and the error propagates. (:meth:`encode_update`, then
        :meth:`settle_update`.)"""
        out = self.encode_update(params, codec, names)
        self.settle_update(params, codec, out)
        return out

    def encode_update(
        self,
        params: Mapping[str, torch.Tensor],
        codec: PayloadCodec,
        names: Iterable[str] | None = None,
    ) -> list[EncodedTensor]:
        """What :meth:`shard_update` sends, every residual left as it is (NonFiniteError or
        ValueError when one cannot be encoded): a site sends its ranks' slices all together or
        none, so each rank encodes first and settles its residuals only once every rank has
        encoded (:meth:`settle_update`)."""
        out: list[EncodedTensor] = []
        for name in self.ranges if names is None else names:
            if not self.owns(name):
                continue
            rows = self.ranges[name]
            encode = None if rows.whole else _slice_encoder(rows.start, codec)
            delta = self._delta(name, params[name])
            out.append(self.feedback.encode_owed(name, delta, codec, encode=encode))
            del delta
        return out

    def settle_update(
        self, params: Mapping[str, torch.Tensor], codec: PayloadCodec, sent: Iterable[EncodedTensor]
    ) -> None:
        """The residuals keep what the encodings ``sent`` (:meth:`encode_update` of the same
        ``params``) lost, each written into its own memory (``ErrorFeedback.settle``)."""
        for enc in sent:
            self.feedback.settle(enc.name, self._delta(enc.name, params[enc.name]), enc, codec)

    def _delta(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Δ = θ − the local rows of ``param``, float32 on the shard's device."""
        return self._theta[name] - local_part(param).to(torch.float32)

    # ---- a result --------------------------------------------------------------------------

    def rows_of(self, name: str, whole: np.ndarray) -> torch.Tensor:
        """This rank's rows of the whole tensor ``whole`` (decoded from a result), float32 on
        the shard's device."""
        rows = self.ranges[name]
        if tuple(np.shape(whole)) != rows.shape:
            raise ValueError(f"tensor {name!r}: shape {np.shape(whole)}, expected {rows.shape}")
        part = whole if rows.whole else whole[rows.start : rows.stop]
        host = torch.from_numpy(np.ascontiguousarray(part, dtype=np.float32))
        return host.to(self._theta[name].device)

    def load_global(self, new: Mapping[str, np.ndarray]) -> None:
        """θ ← the rows of ``new`` (whole tensors of a full result) for every tensor it names."""
        for name, whole in new.items():
            self._theta[name] = self.rows_of(name, whole)

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        """θ ← θ + the rows of ``delta`` (whole tensors of a delta result), as a site holding
        the whole model adds it (float32, elementwise: the same values)."""
        for name, whole in delta.items():
            self._theta[name] = self._theta[name] + self.rows_of(name, whole)

    def replace_theta(self, new: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """θ's rows ← ``new``'s (this rank's rows, as :meth:`rows_of` gives them) for every
        tensor it names; returns the rows replaced (to put back: ``replace_theta`` of them)."""
        old: dict[str, torch.Tensor] = {}
        for name, rows in new.items():
            if tuple(rows.shape) != tuple(self._theta[name].shape):
                raise ValueError(
                    f"tensor {name!r}: rows {tuple(rows.shape)}, expected "
                    f"{tuple(self._theta[name].shape)}"
                )
            old[name] = self._theta[name]
        self._theta.update(new)
        return old

    def encode_theta(self, name: str, codec: PayloadCodec) -> EncodedTensor:
        """This rank's rows of θ for ``name`` encoded with ``codec`` (as a slice, or whole for
        a tensor held whole)."""
        rows = self.ranges[name]
        theta = self._theta[name]
        return (
            codec.encode(name, theta)
            if rows.whole
            else encode_slice(name, theta, rows.start, codec)
        )

    def load_into(self, params: Mapping[str, torch.Tensor]) -> None:
        """The local parameters ``params`` ← θ, each rank writing its own shard."""
        with torch.no_grad():
            for name, param in params.items():
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(self._theta[name])

    def reset_residuals(self) -> None:
        """Drop every residual (a full download replaced the model)."""
        self.feedback.reset()

    # ---- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """θ and the residuals as ``torch.distributed.checkpoint`` saves and loads them:
        ``theta/<name>`` and ``residual/<name>``, each a DTensor placed as its parameter is
        (each rank writes its rows; a site of another layout loads them by resharding), a tensor
        held whole as itself. A residual not carried yet is zeros. To load: ``dcp.load`` into
        this dict (it is filled in place), then :meth:`load_state_dict`."""
        out: dict[str, torch.Tensor] = {}
        for name in self.ranges:
            theta = self._theta[name]
            residual = self.feedback.residual_held(name)  # no copy: the checkpoint reads it
            if residual is None:
                residual = torch.zeros_like(theta)
            out[f"theta/{name}"] = self._placed(name, theta)
            out[f"residual/{name}"] = self._placed(name, residual)
        return out

    def _placed(self, name: str, local: torch.Tensor) -> torch.Tensor:
        mesh = self._meshes.get(name)
        if mesh is None:
            return local
        shape = self.ranges[name].shape
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """θ and the residuals from ``state`` (:meth:`state_dict`'s keys, as ``dcp.load``
        filled them): each rank takes its rows. ValueError names a tensor missing or of
        another shape, before anything changes."""
        theta: dict[str, torch.Tensor] = {}
        residuals: dict[str, torch.Tensor] = {}
        for name, rows in self.ranges.items():
            for kind, into in (("theta", theta), ("residual", residuals)):
                value = state.get(f"{kind}/{name}")
                if value is None or tuple(value.shape) != rows.shape:
                    got = None if value is None else tuple(value.shape)
                    raise ValueError(f"{kind} of tensor {name!r}: {got}, expected {rows.shape}")
                local = local_part(value).to(device=self._theta[name].device, dtype=torch.float32)
                into[name] = local.clone()
        self._theta = theta
        self.feedback.load_state_dict(residuals)


def _slice_encoder(start: int, codec: PayloadCodec) -> Callable[[str, TensorLike], EncodedTensor]:
    """``codec``'s encoding of a shard as the slice of its tensor's rows from ``start``."""
    return lambda name, rows: encode_slice(name, rows, start, codec)


def gather_slices(
    slices: list[EncodedTensor], *, group: dist.ProcessGroup | None = None, dst: int = 0
) -> list[EncodedTensor] | None:
    """Every rank's encoded slices, on rank ``dst`` of ``group`` in rank order (None on the
    others): the encoded bytes are all that cross (``site_agent.rankbytes``)."""
    return gather_encoded(slices, group=group, dst=dst)


ValuesAt = Callable[[int, int], FloatArray]
"""A tensor's flat float32 values ``[start, start + count)`` as a rank holds them (or would
hold them after a result): an array valid until the next call."""

_HASH_TILE = 16 * HASH_BLOCK
"""Values hashed at a time (4 MiB of float32): a whole number of hash blocks."""


@dataclass(frozen=True)
class RangeDigests:
    """One rank's part of a tensor's hash (``comm.wire.tensors``' state hash of a model held
    in shards): the digests of the blocks lying wholly in its range, its ``piece`` of the block
    its range begins inside of (for the rank before), and its ``tail``, the start and values of
    the block its range ends inside of (completed by the next ranks' pieces)."""

    name: str
    shape: tuple[int, ...]
    digests: dict[int, bytes]
    piece: BoundaryPiece | None
    tail: tuple[int, FloatArray] | None


def digest_range(
    name: str, shape: tuple[int, ...], flat_start: int, count: int, values_at: ValuesAt
) -> RangeDigests:
    """The hash's part of tensor ``name`` (whole ``shape``) whose flat range ``[flat_start,
    flat_start + count)`` a rank holds, reading its values a few hash blocks at a time with
    ``values_at``: no copy of the range is made (the piece and the tail are less than a block
    each)."""
    numel, end = math.prod(shape), flat_start + count
    aligned = min(end, -(-flat_start // HASH_BLOCK) * HASH_BLOCK)
    piece = None
    if count and aligned > flat_start:
        piece = BoundaryPiece(name, flat_start, values_at(flat_start, aligned - flat_start).copy())
    last = end if end == numel else max(aligned, end // HASH_BLOCK * HASH_BLOCK)
    digests: dict[int, bytes] = {}
    for at in range(aligned, last, _HASH_TILE):
        n = min(_HASH_TILE, last - at)
        digests.update(partial_digests(name, shape, at, values_at(at, n)))
    tail = (last, values_at(last, end - last).copy()) if last < end else None
    return RangeDigests(name, shape, digests, piece, tail)


def theta_digests(shards: RankShards, name: str) -> RangeDigests:
    """The hash's part of this rank's rows of θ for ``name``."""
    rows = shards.ranges[name]
    flat = _host(shards.theta(name)).reshape(-1)
    lo = rows.flat_start
    return digest_range(name, rows.shape, lo, flat.size, lambda at, n: flat[at - lo : at - lo + n])


def shard_hash(
    shards: RankShards,
    *,
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
    parts: Mapping[str, RangeDigests] | None = None,
) -> str | None:
    """``state_hash`` of the whole θ that ``shards`` of every rank of ``group`` hold, on rank
    ``dst`` (None on the others), without gathering it: boundary pieces (less than a hash block
    per rank and tensor) are exchanged, each rank's block digests gathered to ``dst``.
    ``parts``: the hash's parts of some tensors' rows as they would be (a result's candidate
    rows, :func:`digest_range`), in place of θ's. A rank that fails in its part still makes
    every collective, carrying the failure, and every rank raises the same ``RankFailure``
    (``site_agent.rankfailure``): ``dst`` says at the end whether it got the hash."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own: Failed | None = None
    cause: BaseException | None = None
    mine: list[RangeDigests] = []
    pieces: list[BoundaryPiece] = []
    try:
        parts = parts or {}
        mine = [
            parts[name] if name in parts else theta_digests(shards, name)
            for name in sorted(shards.ranges)
            if shards.owns(name)
        ]
        pieces = [p.piece for p in mine if p.piece is not None]
    except Exception as exc:
        own, cause = failed(exc, rank, "hashing its rows of θ"), exc
    everyone: list[Any] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, pieces if own is None else own, group=group)
    raise_first((p if isinstance(p, Failed) else None for p in everyone), own, cause)
    received = [p for part in everyone for p in part]
    digests: dict[str, dict[int, bytes]] = {}
    try:
        for part in mine:
            digests[part.name] = dict(part.digests)
            if part.tail is not None:
                start, values = part.tail
                theirs = [p for p in received if p.name == part.name]
                digests[part.name].update(
                    partial_digests(part.name, part.shape, start, values, theirs)
                )
    except Exception as exc:
        own, cause = failed(exc, rank, "hashing the edges of its rows of θ"), exc
    gathered: list[Any] | None = [{} for _ in range(world)] if rank == dst else None
    dist.gather_object(digests if own is None else own, gathered, group=group, group_dst=dst)
    word: str | Failed | None = None  # dst's: the hash, or the first failure
    if gathered is not None:
        word = next((g for g in gathered if isinstance(g, Failed)), None)
        try:
            if word is None:
                word = model_hash(
                    {
                        name: combine(name, shape, [part.get(name, {}) for part in gathered])
                        for name, shape in shards.shapes.items()
                    }
                )
        except Exception as exc:
            word = own = failed(exc, rank, "combining the site's state hash")
            cause = exc
    box: list[Any] = [word]
    dist.broadcast_object_list(box, group=group, group_src=dst)
    if isinstance(box[0], Failed):
        raise_first([box[0]], own, cause)
    return word if isinstance(word, str) else None


def _host(t: torch.Tensor) -> FloatArray:
    """A shard's values on the host, float32 (no copy for a CPU float32 tensor)."""
    return np.asarray(t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy())
