"""The simulated sites of ``crossdc bench scale``: streamed, so that they hold almost nothing
per parameter of the model.

The model is a list of flat float32 tensors of at most :data:`TENSOR_NUMEL` values
(:class:`Layout`). Everything a site sends or receives is made or taken one tensor at a time:

- θ0 is generated tensor by tensor (a seeded RNG per tensor) into a file, and the first site
  uploads it from a read-only mapping of that file (:class:`SentFiles`: the upload's float32
  buffers are the file's pages, never a copy in the process's own memory); the pages the
  transport has read are dropped from the process as it goes, and stay in the page cache. The
  file goes once the first result arrives: the coordinator holds θ0 then.
- An update is generated tensor by tensor as int4 codes, deterministic per site, round and
  tensor (:func:`update_tensor`): random codes and one fp16 scale per block of 64, each block
  holding a code of ±7, so the payload is exactly the int4 codec's encoding of the values it
  decodes to (a test checks it). It is made as codes rather than as float32 values encoded
  afterwards because that costs about 25 times less CPU (about 2 ms per tensor of 4M values
  against 45 ms for normal variates and 8 ms to encode them): a site makes its update once its
  round has started, so the time lands in the round's close time, and the CPU is shared with
  the coordinator the bench measures. The whole compressed update is a wire message, which
  the transport cuts into chunks lazily from its buffers while it is sent: it is written to a
  file a tensor at a time and sent from the file's mapping, like θ0 (:func:`write_update`).
- A result (:class:`~comm.wire.schema.Global`) is decoded, applied and hashed a block of
  :data:`STREAM_BLOCK` values at a time: θ is one file on disk, a block of it is read, the
  delta's values there decoded beside it (:func:`comm.wire.tensors.decode_into`) and added as a
  real site adds them (float32, ``θ + δ``), the block written back and digested
  (:func:`comm.wire.tensors.partial_digests`); a tensor's digest is combined from its blocks'
  and the state hash from the tensors' (:func:`comm.wire.tensors.model_hash`), and compared
  with the coordinator's.

With a coordinator of several shards a site's link is one channel per shard put together
(``site_agent.shard_links.ShardedLink``, as a real site's): θ0 and each update go out cut by the
shard owning each tensor, a result comes in once every shard's part of it arrived, and is taken
as above.

The file is read and written with ``pread``/``pwrite``, so θ lives in the page cache, not in
the process's resident memory. One θ serves every simulated site, and only where they provably
hold the same (:meth:`SharedTheta.admit`): a result must be a delta from the version the site
holds; the first site to bring a version has the shared θ apply it, and its base and payload
digest are recorded; every other site bringing that version must bring the same delta (the same
digest) from the same base, so that applying it to the same θ would give the same θ, and its
message is dropped at once (only the one being applied is kept). A site takes its results in
order, each once the shared θ has applied that version, checking the coordinator's hash against
the shared θ's (:meth:`SharedTheta.confirm`). Anything else (a delta from another base, another
delta for a version, a full download, a sparse broadcast) cannot be shown to be the shared θ
and stops the bench with an error rather than being guessed at.

The bounded buffers: θ0's tensor being generated (16 MiB at :data:`TENSOR_NUMEL`), a block of θ
and of the decoded delta (2 x 4 MiB), one update tensor's codes being made, the pages of the
files being sent that the transport read since the last release (every 20 ms), and the
transport's chunks in flight. What grows with the model: the compressed delta of each version
until the shared θ has applied it (one a round, reassembled by the first site's channel; the
other sites' copies are dropped on arrival).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor
from comm.transport.dealer import DealerChannel
from comm.wire.schema import (
    Eval,
    Global,
    Heartbeat,
    InitParams,
    Leave,
    Message,
    RoundStart,
    Shutdown,
    Update,
    Welcome,
)
from comm.wire.tensors import (
    HASH_BLOCK,
    check_slices,
    combine,
    decode_into,
    model_hash,
    partial_digests,
)
from site_agent.shard_links import ShardedLink

TENSOR_NUMEL = 1 << 22
"""The model is cut into tensors of at most this many values (4M, 16 MiB of float32)."""
STREAM_BLOCK = 1 << 20
"""Values of θ read, updated, written and digested at once when a result is applied (4 MiB of
float32, a multiple of the hash's blocks, ``comm.wire.tensors.HASH_BLOCK``)."""
FINGERPRINT = "bench-scale"
UPDATE_SCALE = 1e-3
"""An update's values are about this large (an int4 scale of UPDATE_SCALE / 7 x [0.5, 1.5))."""
INT4_BLOCK = 64
"""Values per fp16 scale in the int4 codec's default encoding."""
_SEED_THETA0, _SEED_UPDATE = 0, 1
_DONE = object()
assert STREAM_BLOCK % HASH_BLOCK == 0  # a block's digests are whole hash blocks


@dataclass(frozen=True)
class Layout:
    """The simulated model: flat tensors ``t000``, ``t001``, ... of at most TENSOR_NUMEL."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, numel: int) -> Layout:
        sizes = [TENSOR_NUMEL] * (numel // TENSOR_NUMEL) + [numel % TENSOR_NUMEL]
        return cls(tuple(n for n in sizes if n))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"t{i:03d}" for i in range(len(self.sizes)))

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)

    def tensors(self) -> Iterator[tuple[int, str, int, int]]:
        """(index, name, offset in values, numel) of each tensor, in order."""
        at = 0
        for i, (name, n) in enumerate(zip(self.names, self.sizes, strict=True)):
            yield i, name, at, n
            at += n


def theta0_tensor(index: int, numel: int) -> npt.NDArray[np.float32]:
    """θ0's tensor ``index``: standard normal values from an RNG seeded by the index."""
    rng = np.random.default_rng([_SEED_THETA0, index])
    return rng.standard_normal(numel, dtype=np.float32)


def update_tensor(site: int, round_id: int, index: int, name: str, numel: int) -> EncodedTensor:
    """Site ``site``'s update of tensor ``index`` in round ``round_id``, int4 (block 64),
    from an RNG seeded by the three: random odd codes in [-7, 7] (random bits with each
    nibble's lowest set), each block's first one ±7, and one fp16 scale per block. A block's
    absmax is then 7 scales, so the int4 codec encoding the decoded values gives these very
    bytes."""
    rng = np.random.default_rng([_SEED_UPDATE, site, round_id, index])
    nbytes = (numel + 1) // 2
    values = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    np.bitwise_or(values, 0x11, out=values)  # nibbles 1, 3, ..., 15: codes -7, -5, ..., 7
    firsts = values[:: INT4_BLOCK // 2]  # the byte holding each block's first value
    sevens = 1 + 14 * rng.integers(0, 2, size=firsts.size, dtype=np.uint8)  # nibble 1 or 15
    firsts[...] = (firsts & 0xF0) | sevens
    if numel % 2:
        values[-1] = (values[-1] & 0x0F) | 0x80  # an odd tail's unused high nibble holds 8
    blocks = -(-numel // INT4_BLOCK)
    scales = (UPDATE_SCALE / 7 * (0.5 + rng.random(blocks))).astype(np.float16)
    return EncodedTensor(
        name=name,
        shape=(numel,),
        codec="int4",
        meta={"block": INT4_BLOCK},
        buffers=(values, scales),
    )


def site_update(
    layout: Layout, site: int, round_id: int, tick: Callable[[], None] = lambda: None
) -> tuple[EncodedTensor, ...]:
    """Site ``site``'s whole update in round ``round_id``, generated a tensor at a time
    (``tick`` runs after each)."""
    out = []
    for i, name, _, n in layout.tensors():
        out.append(update_tensor(site, round_id, i, name, n))
        tick()
    return tuple(out)


def payload_digest(payload: Sequence[EncodedTensor]) -> bytes:
    """A digest of a payload as received: names, shapes, codecs, meta and every buffer's bytes.
    Two payloads with one digest decode alike."""
    h = hashlib.blake2b(digest_size=32)
    for enc in payload:
        h.update(repr((enc.name, tuple(enc.shape), enc.codec, enc.meta, enc.rows)).encode())
        for buf in enc.buffers:
            view = _raw(buf)
            h.update(len(view).to_bytes(8, "little"))
            h.update(view)
    return h.digest()


def _raw(values: Any) -> memoryview:
    """The bytes of an array (or a received buffer), without a copy where it is contiguous."""
    return np.ascontiguousarray(values).reshape(-1).view(np.uint8).data


def _digest(name: str, values: npt.NDArray[np.float32]) -> bytes:
    shape = (int(values.size),)
    return combine(name, shape, [partial_digests(name, shape, 0, values)])


class SentFiles:
    """Files the sites send from: each written once, then read through a read-only mapping, so
    that a message's buffers are the file's pages, not the process's memory. The pages the
    transport has read are dropped from the process as it goes (:meth:`release`): they stay in
    the page cache, and one read again comes back from it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._maps: dict[str, mmap.mmap] = {}
        self._released_at = 0.0

    def map(self, name: str) -> mmap.mmap:
        """File ``name`` (in :attr:`dir`, written and closed) mapped read-only."""
        if name not in self._maps:
            with open(self.dir / name, "rb") as f:
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[name]

    def release(self, every_s: float = 0.02) -> None:
        """Drop every mapping's pages from the process (at most every ``every_s``)."""
        now = time.monotonic()
        if now - self._released_at >= every_s:
            for m in self._maps.values():
                m.madvise(mmap.MADV_DONTNEED)
            self._released_at = now

    def drop(self, name: str) -> None:
        """Unmap file ``name`` and remove it; a mapping still viewed by a message the transport
        holds goes with the last view."""
        m = self._maps.pop(name, None)
        if m is not None:
            m.madvise(mmap.MADV_DONTNEED)
            with contextlib.suppress(BufferError):
                m.close()
        (self.dir / name).unlink(missing_ok=True)

    def close(self) -> None:
        for name in list(self._maps):
            self.drop(name)


def write_update(
    files: SentFiles,
    layout: Layout,
    site: int,
    round_id: int,
    tick: Callable[[], None] = lambda: None,
) -> tuple[EncodedTensor, ...]:
    """Site ``site``'s update in round ``round_id`` (:func:`update_tensor`, a tensor at a time)
    written to a file of ``files`` and returned as views of its mapping (``tick`` runs after
    each tensor). The site's update of its previous round goes: this one follows it on the
    same channel, so that one was sent whole."""
    name = f"update-s{site}-r{round_id}"
    files.drop(f"update-s{site}-r{round_id - 1}")
    places: list[tuple[str, int, list[tuple[int, np.dtype[Any], int]]]] = []
    at = 0
    with open(files.dir / name, "wb") as f:
        for i, tensor, _, n in layout.tensors():
            enc = update_tensor(site, round_id, i, tensor, n)
            bufs = []
            for buf in enc.buffers:
                pad = -at % 8  # each buffer aligned for its dtype
                f.write(bytes(pad))
                bufs.append((at + pad, buf.dtype, buf.size))
                f.write(_raw(buf))
                at += pad + buf.nbytes
            places.append((tensor, n, bufs))
            tick()
    mapped = files.map(name)
    return tuple(
        EncodedTensor(
            name=tensor,
            shape=(n,),
            codec="int4",
            meta={"block": INT4_BLOCK},
            buffers=tuple(np.frombuffer(mapped, dtype, count, off) for off, dtype, count in bufs),
        )
        for tensor, n, bufs in places
    )


class ThetaError(RuntimeError):
    """A result that the simulated sites cannot apply to the one θ they share, or whose hash
    is not the coordinator's."""


class SharedTheta:
    """θ of every simulated site: one float32 file (``theta.f32``) beside θ0's (``theta0.f32``),
    read and written a tensor at a time; per tensor its digest, and the model's hash."""

    def __init__(self, layout: Layout, directory: Path) -> None:
        self.layout = layout
        self.dir = directory
        self.version = 0
        self.hash = ""
        self.digests: dict[str, bytes] = {}
        self.hashes: dict[int, str] = {}
        """The state hash of each version the shared θ has been at."""
        self._deltas: dict[int, tuple[int, bytes]] = {}  # version: (base, payload digest)
        self._buf = np.empty(min(STREAM_BLOCK, layout.largest), dtype=np.float32)
        self._fd = -1
        self.files = SentFiles(directory)
        """The files sent from: θ0's, and the sites' updates."""

    # ---- θ0 -----------------------------------------------------------------------------------

    def write_theta0(self, tick: Callable[[], None] = lambda: None) -> str:
        """Generate θ0 into its file a tensor at a time, digest it, and start θ as a copy of it
        (copied by the kernel). Returns θ0's state hash."""
        self.dir.mkdir(parents=True, exist_ok=True)
        theta0 = self.dir / "theta0.f32"
        with open(theta0, "wb") as f:
            for i, name, _, n in self.layout.tensors():
                values = theta0_tensor(i, n)
                f.write(_raw(values))
                self.digests[name] = _digest(name, values)
                tick()
        shutil.copyfile(theta0, self.dir / "theta.f32")
        self._fd = os.open(self.dir / "theta.f32", os.O_RDWR)
        self.hash = self.hashes[0] = model_hash(self.digests)
        return self.hash

    def init_payload(self) -> tuple[EncodedTensor, ...]:
        """θ0 as float32 tensors (the fp32 codec's encoding), whose buffers are views of a
        read-only mapping of θ0's file."""
        mapped = self.files.map("theta0.f32")
        return tuple(
            EncodedTensor(
                name=name,
                shape=(n,),
                codec="fp32",
                buffers=(np.frombuffer(mapped, np.float32, n, 4 * at),),
            )
            for _, name, at, n in self.layout.tensors()
        )

    # ---- results ------------------------------------------------------------------------------

    def admit(self, msg: Global, held: int) -> Global | None:
        """Check result ``msg`` that a site holding version ``held`` received against the
        versions seen so far. The first to bring a version is returned, for :meth:`apply`, and
        its base and payload digest recorded; any later one must bring the same delta from the
        same base (then None: its payload need not be kept). ThetaError otherwise."""
        where = f"result v{msg.global_version} (round {msg.round_id})"
        if msg.is_full or msg.part_weights:
            raise ThetaError(f"{where}: a full model or a sparse broadcast, not a shared delta")
        if msg.base_version != held:
            raise ThetaError(f"{where}: a delta from v{msg.base_version}, the site holds v{held}")
        seen = self._deltas.get(msg.global_version)
        mine = (held, payload_digest(msg.payload))
        if seen is None:
            self._deltas[msg.global_version] = mine
            return msg
        if seen != mine:
            raise ThetaError(f"{where}: another delta than the one the shared θ takes")
        return None

    def apply(self, msg: Global) -> Iterator[None]:
        """Apply the result :meth:`admit` returned, a step per tensor (a generator: the caller
        runs the channels between the steps); the new version's hash is then in :attr:`hashes`."""
        if msg.base_version != self.version:
            raise ThetaError(
                f"result v{msg.global_version}: a delta from v{msg.base_version}, the shared θ "
                f"is at v{self.version}"
            )
        yield from self._apply(msg.payload)
        self.version = msg.global_version
        self.hashes[self.version] = self.hash

    def confirm(self, version: int, state_hash: str) -> str:
        """The state hash of ``version`` (applied), which must be ``state_hash``, the
        coordinator's; ThetaError otherwise."""
        mine = self.hashes.get(version)
        if mine is None:
            raise ThetaError(f"v{version} is not applied (the shared θ is at v{self.version})")
        if mine != state_hash:
            raise ThetaError(f"v{version}: state hash {mine}, the coordinator's {state_hash}")
        return mine

    def _apply(self, payload: Sequence[EncodedTensor]) -> Iterator[None]:
        """θ += δ a block of STREAM_BLOCK values at a time (what a site computes, in float32:
        the decoded delta added to θ), the tensors' digests renewed from their blocks'."""
        where = {name: (at, n) for _, name, at, n in self.layout.tensors()}
        named = {enc.name: (where[enc.name][1],) for enc in payload if enc.name in where}
        check_slices(payload, named)  # the tensors it names are the model's, whole, once
        delta = np.empty(min(STREAM_BLOCK, self.layout.largest), dtype=np.float32)
        for enc in payload:
            at, n = where[enc.name]
            parts = []
            for lo in range(0, n, STREAM_BLOCK):
                theta = self.read(enc.name, lo, min(n, lo + STREAM_BLOCK))
                step = delta[: theta.size]
                decode_into(enc, step, lo)
                np.add(theta, step, out=theta)
                _pwrite_all(self._fd, _raw(theta), 4 * (at + lo))
                parts.append(partial_digests(enc.name, (n,), lo, theta))
            self.digests[enc.name] = combine(enc.name, (n,), parts)
            yield
        self.hash = model_hash(self.digests)

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> npt.NDArray[np.float32]:
        """Values ``[lo, hi)`` (default: all) of tensor ``name`` of θ as it is now, in a buffer
        of one block (valid until the next read)."""
        at, n = next((at, n) for _, nm, at, n in self.layout.tensors() if nm == name)
        hi = n if hi is None else hi
        if not 0 <= lo <= hi <= n or hi - lo > self._buf.size:
            raise ValueError(f"θ file: values [{lo}, {hi}) of {name} ({n} values)")
        out = self._buf[: hi - lo]
        got = os.preadv(self._fd, [_raw(out)], 4 * (at + lo))
        if got != out.nbytes:
            raise OSError(f"θ file: read {got} of {out.nbytes} bytes of {name}")
        return out

    def close(self) -> None:
        """Close and remove θ's and θ0's files (a model's worth each, not worth keeping)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.files.close()
        for name in ("theta.f32", "theta0.f32"):
            (self.dir / name).unlink(missing_ok=True)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


# ---- the sites' side of the protocol ----------------------------------------------------------


@dataclass
class Site:
    """One simulated site: its link, the version and state hash it holds."""

    index: int
    site_id: str
    chan: DealerChannel | ShardedLink
    """Its link to the coordinator: one channel, or with a coordinator of several shards one
    channel per shard put together as a real site's (``site_agent.shard_links``: each shard sent
    its tensors of θ0 and of every update, a result taken once every shard's part came)."""
    channels: tuple[DealerChannel, ...] = ()
    """The channels of a link to several shards (empty: ``chan`` is the one channel)."""
    done: bool = False
    version: int = 0
    """The version it holds (its last result taken)."""
    hash: str = ""
    received: int = 0
    """The version of its last result received (taken or waiting)."""
    next_beat: float = 0.0

    @property
    def wires(self) -> tuple[DealerChannel, ...]:
        """Every channel of the site (one per coordinator process)."""
        if self.channels:
            return self.channels
        assert isinstance(self.chan, DealerChannel)
        return (self.chan,)

    def beat(self) -> None:
        """A heartbeat each interval, as a real site sends: the coordinator cuts a connection
        that stays silent past its heartbeat timeout (a site waiting for a long close would)."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.chan.send(
                Heartbeat(site_id=self.site_id, global_version=self.version, sent_at=now)
            )
            self.next_beat = now + self.wires[0].cfg.heartbeat_interval_s


@dataclass
class Sites:
    """The simulated sites of one case, the θ they share, and when each round opened and
    closed as they saw it."""

    theta: SharedTheta
    sites: list[Site] = field(default_factory=list)
    opened: dict[int, float] = field(default_factory=dict)
    closed: dict[int, float] = field(default_factory=dict)
    pending: deque[_Received] = field(default_factory=deque)
    """Results received and not yet taken, in the order they came."""
    _job: tuple[_Received, Iterator[None]] | None = None

    @property
    def layout(self) -> Layout:
        return self.theta.layout

    @property
    def idle(self) -> bool:
        """Every site got its Shutdown and took every result."""
        return all(s.done for s in self.sites) and not self.pending and self._job is None

    def tick(self) -> None:
        """Between two tensors of a long step: every site heartbeats, θ0's pages go back."""
        for site in self.sites:
            site.beat()
        self.theta.files.release()

    def answer(self, site: Site, msg: Message) -> None:
        """What a site sends back: InitParams when asked, an update per round, Eval when asked.
        A result is noted (when it came) and waits in :attr:`pending` for :meth:`step`, so that
        taking it, a pass over the model, holds up no other site's reading or sending."""
        if isinstance(msg, Welcome) and msg.need_init:
            payload = self.theta.init_payload()
            site.chan.send(
                InitParams(site_id=site.site_id, model_fingerprint=FINGERPRINT, payload=payload)
            )
        elif isinstance(msg, RoundStart):
            self.opened.setdefault(msg.round_id, time.monotonic())
            payload = write_update(
                self.theta.files, self.layout, site.index, msg.round_id, self.tick
            )
            site.chan.send(
                Update(
                    site_id=site.site_id,
                    round_id=msg.round_id,
                    global_version=msg.fragment_base_version,
                    fragment=msg.fragment,
                    weight=1.0,
                    train_loss=1.0,
                    compute_seconds=0.0,
                    step_seconds=0.0,
                    link_rtt_s=0.0,
                    link_goodput_bps=0.0,
                    payload=payload,
                )
            )
        elif isinstance(msg, Global):
            self.closed[msg.round_id] = time.monotonic()
            self.theta.files.drop("theta0.f32")  # the coordinator holds θ0: no site sends it again
            to_apply = self.theta.admit(msg, site.received)
            site.received = msg.global_version
            self.pending.append(
                _Received(site, msg.global_version, msg.state_hash, msg.evaluate, to_apply)
            )
        elif isinstance(msg, Shutdown):
            site.done = True
            # As a site agent does when it stops: every shard stops serving it at once.
            site.chan.send(Leave(site_id=site.site_id, reason=msg.reason))

    def step(self) -> bool:
        """One step of taking the results waiting: a tensor of the one being applied to the
        shared θ, or a site's check against the coordinator's hash (then it reports its
        validation loss where asked). False when none waits."""
        if self._job is None:
            if not self.pending:
                return False
            got = self.pending.popleft()
            if got.to_apply is None:
                self._taken(got)
                return True
            self._job = (got, self.theta.apply(got.to_apply))
        got, job = self._job
        if next(job, _DONE) is _DONE:
            self._job = None
            self._taken(got)
        return True

    def _taken(self, got: _Received) -> None:
        site = got.site
        site.hash = self.theta.confirm(got.version, got.state_hash)
        site.version = got.version
        if got.evaluate:
            site.chan.send(Eval(site_id=site.site_id, global_version=got.version, val_loss=1.0))


@dataclass(frozen=True)
class _Received:
    """A result a site received: the version and state hash it names, whether the site is to
    report its validation loss, and the message itself only where the shared θ is to apply it
    (the first site to bring that version)."""

    site: Site
    version: int
    state_hash: str
    evaluate: bool
    to_apply: Global | None


FRAMES_PER_PASS = 64
"""Frame lists one site reads per pass over the sites: a real site's I/O thread drains its
socket; one read per pass would let a site fall behind what its socket receives."""


def drain(sites: Sites, site: Site) -> bool:
    """Read what waits on one site's socket (up to FRAMES_PER_PASS); True if there was any."""
    busy = False
    for _ in range(FRAMES_PER_PASS):
        before = sum(w.stats.bytes_received for w in site.wires)
        msg = site.chan.recv(0.0)
        if msg is not None:
            sites.answer(site, msg)
            if not isinstance(msg, Heartbeat):
                site.next_beat = 0.0  # its acknowledgement rides on the next heartbeat
        elif sum(w.stats.bytes_received for w in site.wires) == before:
            return busy  # nothing came in
        busy = True
    return busy
