"""Spawned CPU processes that run a function together in a gloo group, for the pipeline tests.

``LocalProcessGroup`` stands in for torchrun on one machine: each rank joins a fresh gloo group
through a file store in a private directory (no ports to pick), and the processes are kept
between runs so torch is imported once.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class LocalProcessGroup:
    """``num_processes`` spawned CPU processes that run functions together in a gloo group.

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on ranks ``0 .. world_size - 1``,
    each inside a fresh gloo process group (a file store in a private directory: no ports to
    pick), and returns every rank's result. The processes live until ``close``, so torch is
    imported once. A failed or timed-out run marks the group broken; the next ``run`` replaces
    the processes. ``fn`` and its arguments must be picklable (module-level functions).
    """

    def __init__(self, num_processes: int, *, timeout_s: float = 120.0) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store_dir: str | None = None
        self._runs = 0
        self._broken = False

    def start(self) -> LocalProcessGroup:
        ctx = mp.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="crossdc-group-")
        self._results = ctx.Queue()
        for rank in range(self.num_processes):
            tasks = ctx.Queue()
            proc = ctx.Process(target=_group_worker, args=(rank, tasks, self._results), daemon=True)
            proc.start()
            self._tasks.append(tasks)
            self._procs.append(proc)
        self._broken = False
        return self

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int | None = None) -> list[Any]:
        world = self.num_processes if world_size is None else world_size
        if not 1 <= world <= self.num_processes:
            raise ValueError(f"world_size must be in 1..{self.num_processes}, got {world}")
        if self._broken:
            self.close()
            self.start()
        assert self._store_dir is not None, "start() first"
        store = os.path.join(self._store_dir, f"store-{self._runs}")
        self._runs += 1
        for rank in range(world):
            self._tasks[rank].put((fn, args, store, world, self.timeout_s))
        results: list[Any] = [None] * world
        pending = set(range(world))
        deadline = time.monotonic() + self.timeout_s
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(pending)} did not finish within {self.timeout_s} s"
                    )
                try:
                    rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r in pending if not self._procs[r].is_alive()]
                    if dead:
                        codes = [self._procs[r].exitcode for r in dead]
                        raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
                pending.discard(rank)
        except BaseException:
            self._broken = True
            raise
        return results

    def close(self) -> None:
        """Stop every process (terminating any that is stuck) and remove the store directory."""
        if not self._broken:
            for tasks in self._tasks:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if self._broken else 10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.close()
                q.join_thread()
        self._procs, self._tasks, self._results = [], [], None
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self) -> LocalProcessGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _group_worker(rank: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            # Every result is flushed to the parent; then leave without the interpreter's
            # teardown, which with torch loaded takes a second or more of CPU per process.
            results.close()
            results.join_thread()
            os._exit(0)
        fn, args, store, world_size, timeout_s = task
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            try:
                value = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
