"""Which shard of a sharded coordinator this process is, and what that shard's config is.

With ``[coordinator] shards = S`` the federation's coordinator is S processes, each owning a part
of the model's tensors (:func:`comm.wire.partition.partition`). They are started by what the
operator already runs, never by crossdc: ``torchrun`` (the rank is the shard), a Kubernetes
StatefulSet (the pod's ordinal is the shard) or systemd template units
(``crossdc-coordinator@N``, ``--shard %i``). :func:`resolve` reads the process's shard from
those, and :func:`shard_config` turns the federation's one ``[coordinator]`` table into that
shard's: its own state directory, ZeroMQ endpoint and HTTP port. With S = 1 the config is
returned unchanged.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from comm.wire.partition import partition
from comm.wire.tensors import model_hash, tensor_digest
from coordinator.config import CoordinatorConfig

V = TypeVar("V")

ORDINAL = "ordinal"
"""``--shard ordinal``: the trailing ``-N`` of the host name (a StatefulSet pod's ordinal)."""

ENV_SHARD = "CROSSDC_SHARD"
"""The environment's way to say ``--shard`` (an integer or ``ordinal``)."""

_ORDINAL_RE = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class ShardIdentity:
    """Shard ``index`` of ``count``, and where that was read from (for the log)."""

    index: int
    count: int
    source: str

    @property
    def leader(self) -> bool:
        """Shard 0 carries the control plane: membership, the round plan, status."""
        return self.index == 0


def _ordinal(hostname: str) -> int:
    match = _ORDINAL_RE.search(hostname)
    if match is None:
        raise ValueError(
            f"--shard ordinal: the host name {hostname!r} does not end in -N (a StatefulSet pod "
            "is named <statefulset>-<ordinal>)"
        )
    return int(match.group(1))


def _integer(value: str, what: str, hostname: Callable[[], str]) -> tuple[int, str]:
    if value.strip() == ORDINAL:
        return _ordinal(hostname()), f"{what} ordinal"
    try:
        return int(value), what
    except ValueError:
        raise ValueError(f"{what} must be a shard number or {ORDINAL!r}, got {value!r}") from None


def resolve(
    shards: int,
    flag: str | None = None,
    env: Mapping[str, str] | None = None,
    hostname: Callable[[], str] = socket.gethostname,
) -> ShardIdentity:
    """This process's shard of ``shards``: from ``flag`` (``--shard N`` or ``--shard
    ordinal``), else ``CROSSDC_SHARD`` in ``env``, else torchrun's ``RANK`` and
    ``WORLD_SIZE`` (which must equal ``shards``). With one shard and none of those, shard 0.
    ValueError says what is missing or does not fit, in words an operator acts on."""
    env = {} if env is None else env
    world = env.get("WORLD_SIZE")
    if flag is not None:
        index, source = _integer(flag, "--shard", hostname)
    elif env.get(ENV_SHARD):
        index, source = _integer(env[ENV_SHARD], ENV_SHARD, hostname)
    elif world is not None and "RANK" in env:
        index, source = _integer(env["RANK"], "RANK", hostname)
        try:
            size = int(world)
        except ValueError:
            raise ValueError(f"WORLD_SIZE must be an integer, got {world!r}") from None
        if size != shards:
            raise ValueError(
                f"torchrun started {size} processes (WORLD_SIZE) but coordinator.shards = "
                f"{shards}: start one process per shard (--nnodes x --nproc-per-node = shards)"
            )
        source = "torchrun RANK"
    elif shards == 1:
        return ShardIdentity(0, 1, "single")
    else:
        raise ValueError(
            f"coordinator.shards = {shards}: say which shard this process is (--shard N, "
            f"--shard {ORDINAL} in a StatefulSet, {ENV_SHARD}=N, or start it with torchrun)"
        )
    if not 0 <= index < shards:
        raise ValueError(
            f"{source} = {index} is not a shard of coordinator.shards = {shards} "
            f"(0 to {shards - 1})"
        )
    return ShardIdentity(index, shards, source)


def _offset_endpoint(endpoint: str, index: int) -> str:
    """``endpoint`` for shard ``index`` of several on one host: a TCP port plus ``index`` (port
    0 stays 0, a free port each), an ``ipc://`` or ``inproc://`` name with ``-shard<index>``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"coordinator.bind {endpoint!r} has no port")
        return f"tcp://{host}:{int(port) + index if int(port) else 0}"
    return f"{endpoint}-shard{index}"


def bind_port(endpoint: str) -> int | None:
    """The TCP port of ``endpoint``; None for ``ipc://`` and ``inproc://``."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def control_endpoint(cfg: CoordinatorConfig, env: Mapping[str, str]) -> str:
    """Where shards 1 to S-1 reach shard 0: ``shard_control`` when set, else the port of
    ``shard_control_bind`` at torchrun's ``MASTER_ADDR`` (the rendezvous host, where shard 0
    runs with ``--node-rank 0``), else on this host."""
    if cfg.shard_control:
        return cfg.shard_control
    port = cfg.shard_control_bind.rpartition(":")[2]
    host = env.get("MASTER_ADDR") or "127.0.0.1"
    return f"tcp://{host}:{port}"


def shard_config(cfg: CoordinatorConfig, identity: ShardIdentity) -> CoordinatorConfig:
    """The config shard ``identity`` runs with. One shard: ``cfg`` itself. Several: its state in
    ``state_dir/shard-<i>``, and with ``shard_ports = "offset"`` (several shards on one host)
    its endpoint's port and its HTTP port plus ``i``; with ``"same"`` (one shard per host or
    pod) the ports as configured."""
    if identity.count != cfg.shards:
        raise ValueError(
            f"shard {identity.index} of {identity.count}, but coordinator.shards = {cfg.shards}"
        )
    if cfg.shards == 1:
        return cfg
    i = identity.index
    changes: dict[str, object] = {
        "state_dir": f"{cfg.state_dir.rstrip('/')}/shard-{i}" if cfg.state_dir else "",
    }
    if cfg.shard_ports == "offset":
        changes["bind"] = _offset_endpoint(cfg.bind, i)
        changes["metrics_port"] = cfg.metrics_port + i if cfg.metrics_port else 0
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def own_part(
    model: Mapping[str, V], shapes: Mapping[str, tuple[int, ...]], identity: ShardIdentity
) -> dict[str, V]:
    """The entries of ``model`` (by tensor name: parameters, θ0, a spec) that shard
    ``identity`` owns in the cut of the whole model's ``shapes``; the whole of ``model`` with
    one shard. Every shard cuts alike (see :func:`keep_part` for θ0 given a tensor at a time)."""
    if identity.count == 1:
        return dict(model)
    names = set(partition(shapes, identity.count)[identity.index])
    return {name: value for name, value in model.items() if name in names}


@dataclass(frozen=True)
class WholeModel:
    """What a shard holding only its part of a model knows of the whole: every tensor's shape
    (the cut is made from them) and the whole model's state hash."""

    shapes: Mapping[str, tuple[int, ...]]
    state_hash: str


def keep_part(
    tensors: Iterable[tuple[str, np.ndarray]],
    shapes: Mapping[str, tuple[int, ...]],
    identity: ShardIdentity,
) -> tuple[dict[str, np.ndarray], WholeModel]:
    """Shard ``identity``'s part of a model given one tensor at a time (θ0 as
    ``initial_tensors`` draws it), and the whole model's state hash: each tensor is digested as
    it passes and kept only if the shard owns it in the cut of ``shapes``, so the shard never
    holds the rest. The whole model's hash equals :func:`comm.wire.tensors.state_hash` of it
    held in one piece (the hash the sites hold the version by). ValueError when the tensors given are not
    ``shapes``."""
    names = set(partition(shapes, identity.count)[identity.index])
    own: dict[str, np.ndarray] = {}
    digests: dict[str, bytes] = {}
    for name, value in tensors:
        if name not in shapes or tuple(value.shape) != tuple(shapes[name]) or name in digests:
            raise ValueError(f"tensor {name!r} {tuple(value.shape)} is not in the model's spec")
        digests[name] = tensor_digest(name, value)
        if name in names:
            own[name] = value
        del value
    if set(digests) != set(shapes):
        missing = sorted(set(shapes) - set(digests))
        raise ValueError(f"the model's tensors end before {missing[0]!r}")
    return own, WholeModel(dict(shapes), model_hash(digests))
