"""One pipeline stage's training step: a schedule's op list run over torch.distributed.

This module owns what a single rank does inside one inner step of a pipelined site:

- ``PipelineLayout``: which rank is which (stage, replica). Rank ``replica * num_stages + stage``,
  so the ranks of one replica's pipeline are contiguous and rank 0 is stage 0 of replica 0.
- ``StageModule``: a contiguous slice of a layer chain (``ByteGPT.layers``) that keeps the
  full-model parameter names (``layers.3.qkv.weight``), so a stage's ``state_dict`` is a slice of
  the single-process one.
- ``StageExecutor``: runs this stage's list of ``Op`` (from ``schedule``) in order. F(i) receives
  the activation from the previous stage (stage 0 takes the micro-batch tokens), runs the forward,
  keeps what B(i) needs and sends its output on; the last stage turns logits into
  ``lm_loss / num_microbatches``. B(i) receives the output gradient (the last stage starts from its
  loss), runs the backward and sends the input gradient back. Gradients accumulate over the
  micro-batches; then the stage's gradients are averaged over the data-parallel replicas (one
  all-reduce per stage group), clipped by the global norm over the whole pipeline (squared norms
  all-reduced over the replica's stages) and AdamW steps exactly as in ``LocalTrainer``.

Deadlock freedom. Receives block; sends never do. Each op's outgoing tensor is posted together with
the next op's receive in one ``batch_isend_irecv``: on NCCL, where the sends and receives between
two ranks are serialised on one stream, a stage sending an activation downstream while its neighbour
sends a gradient upstream would otherwise wait on each other (the 1F1B steady state does exactly
that); grouped, the two pairs match. Given that, a stage waits only for what the simulator's model
says it waits for, and a schedule the simulator runs to the end runs here too. On gloo (CPU), where
every send and receive is its own work and sends never wait on receives, the executor goes further:
once an op's input has arrived it posts the next op's receive before computing, and it posts each
output's send as soon as it is computed, so a transfer runs during the neighbour's compute instead
of after it (with few cores, the copy would otherwise show up as idle time at every hand-off).

Every op records when it began waiting for its input, when its compute started and when it ended
(``time.perf_counter``, comparable across processes of one host), so a step's measured bubble and
per-stage times can be set against ``simulate``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from site_agent.model import lm_loss
from site_agent.pipeline.schedule import Op, Schedule, validate_schedule
from site_agent.pipeline.simulate import simulate
from site_agent.trainer import InnerOptimConfig, learning_rate

# Same constant as torch.nn.utils.clip_grad_norm_, so clipping matches the single-process trainer.
_CLIP_EPS = 1e-6


P2P_MODES = ("auto", "grouped", "preposted")
"""Ways stages exchange tensors; see ``StageExecutor`` and the module docstring."""


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """``num_stages`` x ``num_replicas`` ranks: rank = ``replica * num_stages + stage``."""

    num_stages: int
    """Pipeline stages per replica."""
    num_replicas: int
    """Data-parallel copies of the whole pipeline."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank(self, *, stage: int, replica: int) -> int:
        assert 0 <= stage < self.num_stages and 0 <= replica < self.num_replicas
        return replica * self.num_stages + stage

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: one data-parallel group."""
        return [self.rank(stage=stage, replica=r) for r in range(self.num_replicas)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, stage order."""
        return [self.rank(stage=s, replica=replica) for s in range(self.num_stages)]


class StageModule(nn.Module):
    """Layers ``indices`` of a chain, applied in order, named as in the full model.

    The layers live in a ``ModuleDict`` called ``layers`` keyed by their index in the full chain,
    so parameter names are ``layers.<index>.<...>``: exactly the names ``ByteGPT.state_dict()``
    uses for them.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        indices = sorted(layers)
        if not indices:
            raise ValueError("a stage needs at least one layer")
        if indices != list(range(indices[0], indices[-1] + 1)):
            raise ValueError(f"stage layers must be contiguous, got {indices}")
        self.layer_indices = tuple(indices)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.layer_indices:
            x = self.layers[str(i)](x)
        return x


def slice_stage(chain: Sequence[nn.Module], layer_indices: Sequence[int]) -> StageModule:
    """The stage made of ``chain[i]`` for ``i`` in ``layer_indices`` (the modules are shared)."""
    return StageModule({i: chain[i] for i in layer_indices})


def adamw_param_names(module: nn.Module) -> list[str]:
    """Parameter names in the optimizer's index order: weight-decayed (ndim >= 2) first, then the
    rest, each in module order. ``LocalTrainer`` and ``build_adamw`` group parameters this way."""
    named = list(module.named_parameters())
    return [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]


def build_adamw(module: nn.Module, cfg: InnerOptimConfig) -> torch.optim.AdamW:
    """AdamW with the same two parameter groups and hyper-parameters as ``LocalTrainer``."""
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=learning_rate(cfg, 0),
        betas=(cfg.beta1, cfg.beta2),
    )


@dataclass(frozen=True)
class OpRecord:
    """When one op ran; ``time.perf_counter`` seconds of the rank that ran it."""

    op: Op
    wait_start_s: float
    """The op began waiting for its input (grouped: its receive was posted now; preposted: it had
    been posted when the previous op started)."""
    start_s: float
    """Its input had arrived and its compute started."""
    end_s: float
    """Its compute ended (grouped: its send is posted with the next op's receive; preposted: it was
    posted just before this)."""

    @property
    def compute_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepTrace:
    """One rank's ops in one training step."""

    stage: int
    replica: int
    step: int
    """Inner step index (0-based, over the trainer's life)."""
    start_s: float
    """The step began on this rank (before its first op)."""
    ops: tuple[OpRecord, ...]
    ops_end_s: float
    """Every send of the step had completed."""
    end_s: float
    """Gradient all-reduce, clipping and the optimizer step were done."""

    @property
    def busy_s(self) -> float:
        return math.fsum(r.compute_s for r in self.ops)

    def mean_compute_s(self, kind: str) -> float:
        """Mean compute seconds of this step's ``"F"`` or ``"B"`` ops."""
        times = [r.compute_s for r in self.ops if r.op.kind == kind]
        return math.fsum(times) / len(times) if times else 0.0


def check_schedule(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Raise ``ValueError`` unless ``schedule`` is valid per stage and runs to the end as a whole.

    Neighbouring stages must also run each kind of op in the same micro-batch order: messages
    between two ranks are matched in the order they were posted, and every tensor has the same
    shape, so a different order would pair one micro-batch's activation (or gradient) with
    another's without any error.
    """
    validate_schedule(schedule, num_stages, num_microbatches)
    # Unit op times: only the dependency structure matters for deadlock.
    simulate(schedule, 1.0, 1.0, 0.0)
    for s in range(num_stages - 1):
        for kind in ("F", "B"):
            here = [op.microbatch for op in schedule[s] if op.kind == kind]
            there = [op.microbatch for op in schedule[s + 1] if op.kind == kind]
            if here != there:
                raise ValueError(
                    f"stages {s} and {s + 1} run {kind} ops in different micro-batch orders "
                    f"({here} vs {there}); messages between them would be paired wrongly"
                )


class StageExecutor:
    """This rank's share of a pipelined step: its stage's ops, gradient sync and optimizer step.

    ``prev_rank``/``next_rank`` are the neighbouring stages of the same replica (``None`` at the
    ends). ``dp_group`` holds this stage in every replica (``None`` when there is one replica);
    ``pp_group`` holds every stage of this replica (``None`` when there is one stage).
    """

    def __init__(
        self,
        *,
        module: StageModule,
        stage: int,
        replica: int,
        layout: PipelineLayout,
        schedule: Schedule,
        num_microbatches: int,
        optim_cfg: InnerOptimConfig,
        device: torch.device,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        activation_dtype: torch.dtype = torch.float32,
        sync_timing: bool = False,
        p2p: str = "auto",
    ) -> None:
        check_schedule(schedule, layout.num_stages, num_microbatches)
        if p2p not in P2P_MODES:
            raise ValueError(f"p2p must be one of {', '.join(P2P_MODES)}, got {p2p!r}")
        self.p2p = p2p
        self.module = module
        self.stage = stage
        self.replica = replica
        self.layout = layout
        self.ops: tuple[Op, ...] = tuple(schedule[stage])
        self.num_microbatches = num_microbatches
        self.optim_cfg = optim_cfg
        self.device = device
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.activation_dtype = activation_dtype
        self.sync_timing = sync_timing and device.type == "cuda"
        self.is_first = stage == 0
        self.is_last = stage == layout.num_stages - 1
        self.prev_rank = None if self.is_first else layout.rank(stage=stage - 1, replica=replica)
        self.next_rank = None if self.is_last else layout.rank(stage=stage + 1, replica=replica)
        self.optimizer = build_adamw(module, optim_cfg)
        self.last_trace: StepTrace | None = None

    # -- one training step -------------------------------------------------------------------

    def train_step(
        self,
        *,
        step: int,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        activation_shape: tuple[int, ...],
    ) -> torch.Tensor | None:
        """Run the step's ops, sync gradients and take one AdamW step at ``learning_rate(step)``.

        Stage 0 passes the micro-batches' token ids as ``inputs``, the last stage their
        ``targets`` (``num_microbatches`` each, already on the device); other stages pass
        ``None``. ``activation_shape`` is the shape of every tensor sent between stages. Returns,
        on the last stage, this replica's loss for the step (mean over its micro-batches,
        detached); ``None`` elsewhere.
        """
        m = self.num_microbatches
        assert (inputs is not None) == self.is_first, "stage 0, and only it, takes inputs"
        assert (targets is not None) == self.is_last, "the last stage, and only it, takes targets"
        assert inputs is None or len(inputs) == m
        assert targets is None or len(targets) == m
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        step_start = time.perf_counter()
        # microbatch -> (stage input, stage output or scaled loss), held from F(i) until B(i)
        stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        records: list[OpRecord] = []
        peers = [self._peer(op) for op in self.ops]
        mailbox: _Mailbox
        p2p = self.p2p
        if p2p == "auto":
            p2p = "preposted" if dist.get_backend() == "gloo" else "grouped"
        if p2p == "preposted":
            mailbox = _PrepostedMailbox(peers, activation_shape, self.activation_dtype, self.device)
        else:
            mailbox = _GroupedMailbox(peers, activation_shape, self.activation_dtype, self.device)
        for k, op in enumerate(self.ops):
            wait_start = time.perf_counter()
            received = mailbox.receive(k)
            start = self._now()
            mailbox.prepost(k + 1)
            i = op.microbatch
            if op.kind == "F":
                if self.is_first:
                    assert inputs is not None
                    x = inputs[i]
                else:
                    assert received is not None
                    x = received.requires_grad_(True)
                out = self.module(x)
                if self.is_last:
                    assert targets is not None
                    loss = lm_loss(out, targets[i]) / m
                    loss_sum += loss.detach()
                    stored[i] = (x, loss)
                else:
                    stored[i] = (x, out)
                    assert self.next_rank is not None
                    mailbox.send(out.detach(), self.next_rank)
            else:
                x, out = stored.pop(i)
                if self.is_last:
                    torch.autograd.backward(out)
                else:
                    assert received is not None
                    torch.autograd.backward(out, grad_tensors=received)
                if not self.is_first:
                    assert x.grad is not None and self.prev_rank is not None
                    mailbox.send(x.grad, self.prev_rank)
            end = self._now()
            records.append(OpRecord(op=op, wait_start_s=wait_start, start_s=start, end_s=end))
        mailbox.flush()
        assert not stored, "every F has had its B"
        ops_end = time.perf_counter()

        self._sync_gradients()
        self._clip_gradients()
        lr = learning_rate(self.optim_cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.last_trace = StepTrace(
            stage=self.stage,
            replica=self.replica,
            step=step,
            start_s=step_start,
            ops=tuple(records),
            ops_end_s=ops_end,
            end_s=self._now(),
        )
        return loss_sum if self.is_last else None

    def _peer(self, op: Op) -> int | None:
        """The rank op's input comes from: the previous stage for F, the next for B; None at the
        ends (stage 0's F takes tokens, the last stage's B starts from its loss)."""
        return self.prev_rank if op.kind == "F" else self.next_rank

    def _now(self) -> float:
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def _sync_gradients(self) -> None:
        """Mean of this stage's gradients over the replicas: one flat all-reduce."""
        if self.dp_group is None:
            return
        grads = self._grads()
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        flat.div_(self.layout.num_replicas)
        for g, synced in zip(grads, _split_like(flat, grads), strict=True):
            g.copy_(synced)

    def _clip_gradients(self) -> None:
        """Scale gradients so the norm over the whole model is at most ``grad_clip``.

        The replicas hold equal gradients after the sync, so the norm over one replica's stages
        is the model's norm: per-stage squared norms are summed over ``pp_group``.
        """
        max_norm = self.optim_cfg.grad_clip
        if max_norm <= 0:
            return
        grads = self._grads()
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
        squared = norms.pow(2).sum()
        if self.pp_group is not None:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = squared.sqrt()
        coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
        for g in grads:
            g.mul_(coef)

    # -- forward only (evaluation) -----------------------------------------------------------

    @torch.no_grad()
    def forward_only(
        self,
        *,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        activation_shapes: Sequence[tuple[int, ...]],
    ) -> torch.Tensor | None:
        """Forward every batch through the pipeline in eval mode; no state changes.

        Stage 0 passes the batches' token ids, the last stage their targets. Returns, on the last
        stage, the sum over batches of each batch's mean loss (float64); ``None`` elsewhere.
        """
        was_training = self.module.training
        self.module.eval()
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for k, shape in enumerate(activation_shapes):
                if self.is_first:
                    assert inputs is not None
                    x = inputs[k]
                else:
                    x = torch.empty(shape, dtype=self.activation_dtype, device=self.device)
                    dist.recv(x, src=self.prev_rank)
                out = self.module(x)
                if self.is_last:
                    assert targets is not None
                    total += lm_loss(out, targets[k]).double()
                else:
                    work = dist.isend(out, dst=self.next_rank)
                    assert work is not None
                    pending.append((work, out))
            for work, _ in pending:
                work.wait()
        finally:
            self.module.train(was_training)
        return total if self.is_last else None


class _Mailbox:
    """The point-to-point traffic of one step: op k's input (``receive(k)``) and each op's output
    (``send``); ``flush`` waits until every send has left."""

    def __init__(
        self,
        peers: Sequence[int | None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._peers = list(peers)
        self._shape = shape
        self._dtype = dtype
        self._device = device
        # Posted sends and the tensors they read: kept alive until the step's end.
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self._shape, dtype=self._dtype, device=self._device)

    def receive(self, k: int) -> torch.Tensor | None:
        raise NotImplementedError

    def prepost(self, k: int) -> None:
        """Op k's input may be received from now on (called once op k - 1's has arrived)."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()


class _GroupedMailbox(_Mailbox):
    """At most one outgoing tensor, posted with the next receive in one ``batch_isend_irecv``
    (see the module docstring): what NCCL needs to avoid serialised-stream deadlocks."""

    _next: tuple[torch.Tensor, int] | None = None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        assert self._next is None, "one op produces at most one outgoing tensor"
        self._next = (tensor, dst)

    def receive(self, k: int) -> torch.Tensor | None:
        peer = self._peers[k]
        if peer is None:
            self._post(None)
            return None
        buf = self._buffer()
        self._post((buf, peer))
        return buf

    def _post(self, recv: tuple[torch.Tensor, int] | None) -> None:
        p2p: list[dist.P2POp] = []
        send_tensor = None
        if self._next is not None:
            send_tensor, dst = self._next
            p2p.append(dist.P2POp(dist.isend, send_tensor, dst))
            self._next = None
        if recv is not None:
            p2p.append(dist.P2POp(dist.irecv, recv[0], recv[1]))
        if not p2p:
            return
        works = dist.batch_isend_irecv(p2p)
        if recv is not None and len(works) == len(p2p):
            # One work per op: wait for the receive, let the send run on.
            works[-1].wait()
            works = works[:-1]
        elif recv is not None:
            # Coalesced (NCCL): one work for the group; waiting orders the streams, not the host.
            for work in works:
                work.wait()
            works = []
        for work in works:
            assert send_tensor is not None
            self._in_flight.append((work, send_tensor))

    def flush(self) -> None:
        self._post(None)
        super().flush()


class _PrepostedMailbox(_Mailbox):
    """Receives posted one op ahead and sends posted at once (gloo, see the module docstring).

    Op k + 1's receive is posted only after op k's input arrived, so at most one receive is
    outstanding and receives from one peer are matched in schedule order.
    """

    def __init__(
        self,
        peers: Sequence[int | None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(peers, shape, dtype, device)
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}

    def prepost(self, k: int) -> None:
        if k >= len(self._peers) or k in self._posted:
            return
        peer = self._peers[k]
        if peer is None:
            return
        buf = self._buffer()
        work = dist.irecv(buf, src=peer)
        assert work is not None
        self._posted[k] = (work, buf)

    def receive(self, k: int) -> torch.Tensor | None:
        self.prepost(k)
        entry = self._posted.pop(k, None)
        if entry is None:
            return None
        entry[0].wait()
        return entry[1]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        work = dist.isend(tensor, dst=dst)
        assert work is not None
        self._in_flight.append((work, tensor))

    def flush(self) -> None:
        assert not self._posted, "every posted receive was consumed"
        super().flush()


def _split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    offset = 0
    for t in like:
        n = t.numel()
        yield flat[offset : offset + n].view_as(t)
        offset += n


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 vector of ``tensors``, in order."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, in order; ``flat`` must hold exactly their elements."""
    assert flat.numel() == sum(t.numel() for t in like)
    return list(_split_like(flat, like))
