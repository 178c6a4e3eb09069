"""Site memory benchmark: what a site's processes hold, one process against FSDP2 ranks.

The same model (``params`` float32 parameters in square Linear layers) is trained by a site of
one process and by a site of ``ranks`` FSDP2 ranks (gloo, CPU), each with Adam, one optimizer
step, then one sync and a second one (the first creates the error-feedback residuals; the second
is the steady state), through the site's own code: the one-process site's ``Replica`` and
``Compressed`` payload (its global model, Δ and residuals as host numpy), the sharded site's
``ShardedReplica`` over every rank's ``RankSync`` (θ, residuals and Δ per rank, for its rows).
The sharded model is built on the meta device and each rank makes only its rows' initial
values; the one process builds it whole; both hold the same values.
This process plays the coordinator: it receives each update's encoded tensors, decodes them
(whole), and answers with the delta result encoded with the same codec, signed by nothing, with
the state hash of the model it holds.

Printed (``--json``), per site process: ``peak_rss_bytes`` (the process's peak resident set,
``VmHWM``), ``base_rss_bytes`` (after the first optimizer step, before any sync), and
``sync_growth_bytes`` (the most the resident set grew during each sync over its value as the
sync began: the high-water mark, reset as the sync begins, less that value).
``leader_rss_ratio`` is the sharded site's rank 0 peak over the one-process site's;
``sync_growth_over_model`` the most any sharded rank grew at each sync over the model's float32
size (the first sync makes the error-feedback residuals, which stay; the second is the steady
state), and ``max_sync_growth_over_model`` the largest of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 2048


def _layers(params: int) -> int:
    return max(1, round(params / (WIDTH * WIDTH + WIDTH)))


def _model(params: int, *, meta: bool = False) -> Any:
    """The bench's model: ``params`` parameters or about, in square Linear layers, on the meta
    device (no storage) or holding its initial values (:func:`_initial`)."""
    import torch
    from torch import nn

    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(_layers(params))])
    if not meta:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_initial(name, 0, p.shape[0]))
    return model


def _initial(name: str, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of parameter ``name``'s initial values, made row by row from a
    seed of the name and the row: a rank makes its rows without the whole tensor."""
    import torch

    layer, kind = name.split(".")
    width = WIDTH if kind == "weight" else 1
    rows = torch.empty(stop - start, width)
    g = torch.Generator()
    for i, row in enumerate(range(start, stop)):
        g.manual_seed(int(layer) * 1_000_003 + row * 2 + (kind == "bias"))
        rows[i] = torch.randn(width, generator=g) * 0.02
    return rows if kind == "weight" else rows.reshape(-1)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_peak_before_reset = 0
"""This process's high-water mark before it was last reset (:func:`_reset_peak`)."""


def _reset_peak() -> bool:
    """Start this process's high-water mark (``VmHWM``) again from its resident set now
    (``/proc/self/clear_refs``), remembering the one before for the process's peak
    (``peak_rss_bytes``); False where the kernel does not let it."""
    global _peak_before_reset
    _peak_before_reset = max(_peak_before_reset, _peak_rss())
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


class _Sampler:
    """The most the resident set grew over its value at ``start``: the high-water mark since
    then (reset at ``start``: every page counted, however briefly it was held), or where the
    kernel cannot reset it, the resident set sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Sampler:
        self._exact = _reset_peak()
        self.base = self.peak = _rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, _rss(), _peak_rss() if self._exact else 0)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _send(conn: Any, encs: Any, extra: Any = None) -> None:
    """Encoded tensors over a pipe as the agent's transport sends them: each buffer's bytes as
    they are (a pickle of them would copy them), the headers first."""
    from dataclasses import replace

    heads = [
        (
            replace(e, buffers=()),
            [(np.asarray(b).dtype.str, np.asarray(b).shape) for b in e.buffers],
        )
        for e in encs
    ]
    conn.send((heads, extra))
    for e in encs:
        for b in e.buffers:
            conn.send_bytes(np.ascontiguousarray(b).reshape(-1).view(np.uint8).data)


def _recv(conn: Any) -> tuple[tuple[Any, ...], Any]:
    """What :func:`_send` sent: each buffer received into an array of its size."""
    from dataclasses import replace

    heads, extra = conn.recv()
    out = []
    for head, layouts in heads:
        bufs = []
        for dtype, shape in layouts:
            buf = np.empty(shape, dtype=dtype)
            if buf.nbytes:
                conn.recv_bytes_into(buf.reshape(-1).view(np.uint8).data)
            bufs.append(buf)
        out.append(replace(head, buffers=tuple(bufs)))
    return tuple(out), extra


def _train_step(model: Any, optimizer: Any, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, WIDTH, generator=g)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _plan(round_id: int, codec: str) -> Any:
    from comm.wire.schema import RoundStart

    return RoundStart(
        round_id=round_id,
        global_version=round_id - 1,
        fragment_base_version=round_id - 1,
        fragment=0,
        num_fragments=1,
        num_inner_steps=1,
        overlap=False,
        codec=codec,
        deadline_s=600.0,
        participants=("site",),
        evaluate=False,
        reason="bench",
    )


def _result(round_id: int, payload: Any, state_hash: str) -> Any:
    from comm.wire.schema import Global

    return Global(
        round_id=round_id,
        base_version=round_id - 1,
        global_version=round_id,
        fragment=0,
        merged=("site",),
        is_full=False,
        state_hash=state_hash,
        signature=b"",
        evaluate=False,
        payload=tuple(payload),
    )


@dataclass
class _Coordinator:
    """The bench's coordinator: θ of the model, and a result for each update (its delta with
    the site's codec, as a mean of one site with an outer learning rate of 1)."""

    theta: dict[str, np.ndarray]
    codec: str

    def answer(self, payload: Any) -> tuple[tuple[Any, ...], str]:
        from comm.codecs.registry import get_codec
        from comm.wire.tensors import decode_tensors, encode_tensors, spec_of, state_hash

        update = decode_tensors(payload, spec_of(self.theta), slices=True)
        delta = {k: -v for k, v in update.items()}
        encoded = encode_tensors(delta, get_codec(self.codec))
        applied = decode_tensors(encoded, spec_of(self.theta))
        self.theta = {k: self.theta[k] + applied[k] for k in self.theta}
        return tuple(encoded), state_hash(self.theta)


def _site_one(params: int, codec: str, conn: Any, state_dir: str) -> None:
    """A site of one process: the library's trainer, the agent's Replica and Compressed."""
    import torch

    from comm.codecs.feedback import ErrorFeedback
    from site_agent.library import LoopTrainer
    from site_agent.metrics import SiteMetrics
    from site_agent.payload import Compressed
    from site_agent.replica import Replica
    from site_agent.rounds import SiteRounds
    from site_agent.trainer import TrainStats

    torch.set_num_threads(1)
    model = _model(params)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    trainer = LoopTrainer(model, optimizer, evaluate=None, weight_per_step=1.0)
    feedback, metrics = ErrorFeedback(), SiteMetrics("one")
    replica = Replica(
        site_id="one",
        seed=0,
        trainer=trainer,
        rounds=SiteRounds(),
        feedback=feedback,
        checkpoint_path=Path(state_dir) / "checkpoint.pt",
        metrics=metrics,
    )
    replica.adopt(0)
    form = Compressed(site_id="one", feedback=feedback, metrics=metrics)
    stats = TrainStats(steps=1, tokens=1, loss_mean=0.0, loss_last=0.0, compute_seconds=0.0)
    _train_step(model, optimizer, 0)
    base = _rss()
    growth = []
    for round_id in (1, 2):
        with _Sampler() as s:
            rs = _plan(round_id, codec)
            taken = replica.take_pseudo_gradient(rs, stats)
            assert taken is not None
            payload = form.make(rs, taken[0], stats, 1)
            assert payload is not None
            replica.sent(0, taken[1], 0)
            del taken
            _send(conn, payload.tensors)
            del payload
            result, digest = _recv(conn)
            outcome = replica.apply_global(_result(round_id, result, digest), at_step=0)
            assert outcome.value == "applied", outcome
            del result
        growth.append(s.growth)
        _train_step(model, optimizer, 0)
    conn.send(_figures(base, growth))


def _site_rank(rank: int, world: int, params: int, codec: str, conn: Any, state_dir: str) -> None:
    """One rank of a site of ``world`` FSDP2 ranks: RankSync on every rank, ShardedReplica on
    rank 0, the other ranks making the calls rank 0 names."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from site_agent.metrics import SiteMetrics
    from site_agent.rounds import SiteRounds
    from site_agent.shardreplica import ShardedReplica
    from site_agent.shards import row_range
    from site_agent.shardsync import LeaderSync, RankSync
    from site_agent.trainer import TrainStats

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{state_dir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
    )
    # Built on the meta device and sharded before it has storage; each rank then makes only
    # its rows (as a large model is built under FSDP2).
    model = _model(params, meta=True)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            rows = row_range(name, p)
            if rows.stop > rows.start:
                p.to_local().copy_(_initial(name, rows.start, rows.stop))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ranks = RankSync(model, optimizer=optimizer)
    _train_step(model, optimizer, rank)
    base = _rss()
    growth = []

    def announce(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        dist.broadcast_object_list([(method, args, kwargs)], src=0)

    if rank == 0:
        replica = ShardedReplica(
            site_id="fsdp",
            sync=LeaderSync(ranks, announce),
            rounds=SiteRounds(),
            state_path=Path(state_dir),
            metrics=SiteMetrics("fsdp"),
        )
        replica.load_checkpoint()  # none: the hash of θ0
        replica.adopt(0)
        stats = TrainStats(steps=1, tokens=1, loss_mean=0.0, loss_last=0.0, compute_seconds=0.0)
    for round_id in (1, 2):
        with _Sampler() as s:
            if rank == 0:
                rs = _plan(round_id, codec)
                payload = replica.take_update(rs, stats, tokens=1, at_step=0)
                assert payload is not None
                _send(conn, payload.tensors)
                del payload
                result, digest = _recv(conn)
                outcome = replica.apply_global(_result(round_id, result, digest), at_step=0)
                assert outcome.value == "applied", outcome
                del result
                announce("", (), {})  # the sync is over
            else:
                while True:
                    box: list[Any] = [None]
                    dist.broadcast_object_list(box, src=0)
                    method, args, kwargs = box[0]
                    if not method:
                        break
                    getattr(ranks, method)(*args, **kwargs)
        growth.append(s.growth)
        _train_step(model, optimizer, rank)
    conn.send(_figures(base, growth))
    dist.destroy_process_group()


def _peak_rss() -> int:
    """This process's peak resident set: ``VmHWM``, the high-water mark of its own memory.
    Not ``ru_maxrss``: Linux carries that across ``exec``, so a process started by ``spawn``
    reports at least its parent's resident set at the start (here, the bench's coordinator
    holding the model)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _figures(base: int, growth: list[int]) -> dict[str, Any]:
    return {
        "peak_rss_bytes": max(_peak_before_reset, _peak_rss()),
        "base_rss_bytes": base,
        "sync_growth_bytes": growth,
    }


def _serve(coordinator: _Coordinator, conn: Any, procs: list[Any]) -> list[dict[str, Any]]:
    """Answer the leader's two updates, then collect every process's figures."""
    for _ in range(2):
        payload, _ = _recv(conn[0])
        result, digest = coordinator.answer(payload)
        _send(conn[0], result, digest)
        del payload, result
    figures = [c.recv() for c in conn]
    for p in procs:
        p.join(timeout=120)
    return figures


def run(params: int, codec: str, world: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    theta = {n: p.detach().numpy().copy() for n, p in _model(params).named_parameters()}
    numel = sum(v.size for v in theta.values())
    out: dict[str, Any] = {"params": numel, "codec": codec, "ranks": world}
    with tempfile.TemporaryDirectory(prefix="crossdc-site-memory-") as tmp:
        one_dir = Path(tmp) / "one"
        one_dir.mkdir()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_site_one, args=(params, codec, child, str(one_dir)))
        proc.start()
        out["one_process"] = _serve(_Coordinator(dict(theta), codec), [parent], [proc])[0]
        fsdp_dir = Path(tmp) / "fsdp"
        fsdp_dir.mkdir()
        pipes = [ctx.Pipe() for _ in range(world)]
        procs = [
            ctx.Process(
                target=_site_rank, args=(r, world, params, codec, pipes[r][1], str(fsdp_dir))
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out["fsdp_ranks"] = _serve(_Coordinator(dict(theta), codec), [p[0] for p in pipes], procs)
    model_bytes = 4 * numel
    one, leader = out["one_process"], out["fsdp_ranks"][0]
    out["model_bytes"] = model_bytes
    out["leader_rss_ratio"] = leader["peak_rss_bytes"] / one["peak_rss_bytes"]
    out["sync_growth_over_model"] = [
        max(r["sync_growth_bytes"][i] for r in out["fsdp_ranks"]) / model_bytes
        for i in range(len(out["fsdp_ranks"][0]["sync_growth_bytes"]))
    ]
    out["max_sync_growth_over_model"] = max(out["sync_growth_over_model"])
    out["one_process_sync_growth_over_model"] = max(
        g / model_bytes for g in one["sync_growth_bytes"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="crossdc bench site_memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--params", type=int, default=200_000_000, help="model parameters (about)")
    p.add_argument("--codec", default="int8", help="the updates' and results' codec")
    p.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks of the sharded site")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.params < WIDTH * WIDTH or args.ranks < 1:
        print(f"crossdc bench site_memory: --params must be >= {WIDTH * WIDTH}, --ranks >= 1")
        return 2
    t0 = time.monotonic()
    out = run(args.params, args.codec, args.ranks)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    gib = 1 << 30
    one, fsdp = out["one_process"], out["fsdp_ranks"]
    print(f"model: {out['params']:,} parameters ({out['model_bytes'] / gib:.2f} GiB float32)")
    print(f"one process: peak RSS {one['peak_rss_bytes'] / gib:.2f} GiB")
    for r, f in enumerate(fsdp):
        growth = ", ".join(f"{g / gib:.2f}" for g in f["sync_growth_bytes"])
        print(
            f"FSDP rank {r}: peak RSS {f['peak_rss_bytes'] / gib:.2f} GiB; at syncs +{growth} GiB"
        )
    print(f"leader_rss_ratio {out['leader_rss_ratio']:.3f}")
    per_sync = " / ".join(f"{g:.3f}" for g in out["sync_growth_over_model"])
    print(f"sync_growth_over_model {per_sync} (the first sync / the second)")
    print(f"max_sync_growth_over_model {out['max_sync_growth_over_model']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
