"""One pipeline stage's training step: a schedule's op list run over torch.distributed.

This module owns what a single rank does inside one inner step of a pipelined site.
``StageExecutor`` runs this stage's list of ``Op`` (from ``schedule``) in order. F(i) receives
the activation from the previous stage (stage 0 takes the micro-batch tokens), runs the forward,
keeps what B(i) needs and sends its output on; the last stage turns logits into
``lm_loss / num_microbatches``. B(i) receives the output gradient (the last stage starts from its
loss), runs the backward and sends the input gradient back. Gradients accumulate over the
micro-batches; then the stage's gradients are averaged over the data-parallel replicas (one
all-reduce per stage group), clipped by the global norm over the whole pipeline (squared norms
all-reduced over the replica's stages) and AdamW steps exactly as in ``LocalTrainer``.
Tensors move through a ``mailbox`` (which also says why no schedule the simulator runs to the end
can deadlock here); ``stage`` holds the layout and the stage's module.

Every op records when it began waiting for its input, when its compute started and when it ended
(``time.perf_counter``, comparable across processes of one host), so a step's measured bubble and
per-stage times can be set against ``simulate``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from site_agent.model import lm_loss
from site_agent.pipeline.mailbox import P2P_MODES, Mailbox, make_mailbox
from site_agent.pipeline.schedule import Op, Schedule, validate_schedule
from site_agent.pipeline.simulate import simulate
from site_agent.pipeline.stage import PipelineLayout, StageModule, build_adamw, split_like
from site_agent.trainer import InnerOptimConfig, learning_rate

# Same constant as torch.nn.utils.clip_grad_norm_, so clipping matches the single-process trainer.
_CLIP_EPS = 1e-6

# microbatch -> (stage input, stage output or scaled loss), held from F(i) until B(i)
_Stored = dict[int, tuple[torch.Tensor, torch.Tensor]]


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
        loss_sum, records = self._run_ops(inputs, targets, activation_shape)
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

    def _run_ops(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        activation_shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[OpRecord]]:
        """This stage's ops of one step, in order, until every send has left; returns the sum of
        the scaled micro-batch losses (zero but on the last stage) and each op's record."""
        stored: _Stored = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        records: list[OpRecord] = []
        peers = [self._peer(op) for op in self.ops]
        mailbox = make_mailbox(
            self.p2p, peers, activation_shape, self.activation_dtype, self.device
        )
        for k, op in enumerate(self.ops):
            wait_start = time.perf_counter()
            received = mailbox.receive(k)
            start = self._now()
            mailbox.prepost(k + 1)
            if op.kind == "F":
                loss = self._forward(op.microbatch, received, inputs, targets, stored, mailbox)
                if loss is not None:
                    loss_sum += loss
            else:
                self._backward(op.microbatch, received, stored, mailbox)
            end = self._now()
            records.append(OpRecord(op=op, wait_start_s=wait_start, start_s=start, end_s=end))
        mailbox.flush()
        assert not stored, "every F has had its B"
        return loss_sum, records

    def _forward(
        self,
        i: int,
        received: torch.Tensor | None,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        stored: _Stored,
        mailbox: Mailbox,
    ) -> torch.Tensor | None:
        """F(i): returns, on the last stage, micro-batch i's scaled loss (detached)."""
        if self.is_first:
            assert inputs is not None
            x = inputs[i]
        else:
            assert received is not None
            x = received.requires_grad_(True)
        out = self.module(x)
        if self.is_last:
            assert targets is not None
            loss = lm_loss(out, targets[i]) / self.num_microbatches
            stored[i] = (x, loss)
            return loss.detach()
        stored[i] = (x, out)
        assert self.next_rank is not None
        mailbox.send(out.detach(), self.next_rank)
        return None

    def _backward(
        self, i: int, received: torch.Tensor | None, stored: _Stored, mailbox: Mailbox
    ) -> None:
        """B(i): backward from the loss (last stage) or the received output gradient."""
        x, out = stored.pop(i)
        if self.is_last:
            torch.autograd.backward(out)
        else:
            assert received is not None
            torch.autograd.backward(out, grad_tensors=received)
        if not self.is_first:
            assert x.grad is not None and self.prev_rank is not None
            mailbox.send(x.grad, self.prev_rank)

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
        for g, synced in zip(grads, split_like(flat, grads), strict=True):
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
