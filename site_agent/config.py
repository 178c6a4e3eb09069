"""A site agent's configuration: one frozen dataclass per component, read from ``[site]``, and
the device ``site.device`` resolves to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from comm.ops.configio import ConfigError, build, env_overrides, load_toml, merge
from comm.ops.httpsec import HttpSecurityConfig
from comm.security.masking import SecAggConfig
from comm.security.rolekits import SecurityConfig
from comm.transport.profile import ChannelConfig
from site_agent.jobs.contract import BYTEGPT_FACTORY, check_job_options
from site_agent.pipeline.layout import TORCH_SCHEDULES, check_data_parallel
from site_agent.privacy import DPConfig


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The site's job: the factory crossdc calls for its model, data, loss and optimizer."""

    factory: str = BYTEGPT_FACTORY
    """``package.module:callable``; the default is the embedded byte GPT."""
    python_path: tuple[str, ...] = ()
    """Directories put in front of ``sys.path`` before the factory is imported."""
    options: dict[str, Any] = field(default_factory=dict)
    """``[site.job.options]``: handed to the factory as they are."""
    grad_clip: float = 1.0
    """Largest global gradient L2 norm: crossdc clips every job's gradients to it before the
    optimizer step; 0 disables clipping."""
    max_nonfinite_steps: int = 8
    """A non-finite loss skips its step; this many in a row stop the site."""

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"site.job.factory must look like 'package.module:callable', got {self.factory!r}"
            )
        if self.max_nonfinite_steps < 1:
            raise ValueError("site.job.max_nonfinite_steps must be >= 1")
        if not self.grad_clip >= 0:
            raise ValueError(f"site.job.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    """Everything one site agent needs; every field can be set in ``[site]``."""

    site_id: str
    """This data center's name, unique in the federation (e.g. ``eu``)."""
    coordinator: str = ""
    """The coordinator's ZeroMQ endpoint, e.g. ``tcp://coord.example.org:7710``."""
    coordinator_endpoint_file: str = ""
    """Alternatively, a file holding ``{"endpoint": ...}`` (written by a local coordinator)."""
    coordinator_shards: tuple[str, ...] = ()
    """A coordinator of several shards: every shard's endpoint, shard 0's first (it is
    ``coordinator``; the site's kit names them all). Empty: one coordinator process."""
    shard_result_wait_s: float = 300.0
    """With ``coordinator_shards``: how long shard 0's plans wait behind a result of which a
    shard's part has not come (shard 0 sends a result before the plan naming its version);
    then the result is dropped and the site catches up. Shard 0's next round's plan drops it
    at once."""
    state_dir: str = "./site-state"
    """Site-local checkpoint directory."""
    metrics_port: int = 0
    """HTTP port for /metrics and /status; 0 turns it off."""
    metrics_host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    http: HttpSecurityConfig = field(default_factory=HttpSecurityConfig)
    """TLS and basic auth for the HTTP port (``[site.http]``); plain HTTP without it."""
    seed: int = 1234
    """Seed of the initial model (all sites use the same) and, offset by the site, of sampling."""
    device: str = "auto"
    """``auto`` (CUDA if present), ``cpu`` or ``cuda[:N]``."""
    num_threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    steps_per_poll: int = 4
    """Inner steps between two looks at the coordinator link (where results are merged)."""
    fault_slow_step_s: float = 0.0
    """Fault drill: extra seconds per inner step, making this site a straggler on purpose."""
    fault_exit_before_send_round: int = 0
    """Fault drill: the process exits right before sending its update of this round (after
    masking it, under secure aggregation); 0 disables."""
    stages: int = 1
    """Pipeline stages inside the site."""
    replicas: int = 1
    """Data-parallel replicas of the pipeline inside the site."""
    schedule: str = "1f1b"
    """Pipeline schedule, one of torch's: ``gpipe``, ``1f1b``, ``interleaved_1f1b``,
    ``looped_bfs``, ``interleaved_zb`` or ``zbv`` (the last four put two stages on each rank)."""
    data_parallel: str = "ddp"
    """How the replicas of a pipeline stage combine their gradients: ``ddp`` (torch's
    DistributedDataParallel around each stage: one bucketed all-reduce per step, overlapping the
    last micro-batch's backward), ``fsdp`` (FSDP2's ``fully_shard`` on each stage: gradients
    and optimizer state sharded over the replicas) or ``allreduce`` (one flat all-reduce after
    the schedule). ``ddp`` cannot run ``interleaved_zb`` or ``zbv``, whose split backward
    bypasses DDP's hooks; the others run every schedule."""
    microbatches: int = 4
    """Micro-batches per pipeline step."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """The site's startup kit (``crossdc keys issue``); ``insecure = true`` for loopback only."""
    secure_aggregation: SecAggConfig | None = None
    """Mask updates pairwise so the coordinator learns only their sum (as the coordinator's)."""
    privacy: DPConfig | None = None
    """Differential privacy of this site's updates (clip + Gaussian noise); off when absent."""
    job: JobConfig = field(default_factory=JobConfig)
    """``[site.job]``: what this site trains (the embedded byte GPT unless set) and with which
    options."""
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    rank_timeout_s: float = 1800.0
    """A site whose model is sharded over its ranks (library mode under torchrun): how long a
    rank waits for the others in one collective of a sync call (an update's or a result's
    bytes, the state hash, a checkpoint) before it fails. The ranks' wait for rank 0 between
    two steps, as long as its agent spends talking to the coordinator, is not bounded by it."""
    error_feedback_decay: float = 1.0
    """β of the uplink's error feedback: each round sends C(Δ + β e) and keeps the rest as e. 1
    conserves every dropped value; SparseLoCo's recipe (``coordinator.outer_strategy =
    "sparseloco"``) uses 0.95, the decayed residual standing in for outer momentum."""

    def _check_shards(self) -> None:
        """A sharded coordinator's endpoints: two or more, distinct, shard 0's ``coordinator``."""
        if not self.shard_result_wait_s > 0:
            raise ValueError(
                f"site.shard_result_wait_s must be > 0, got {self.shard_result_wait_s!r}"
            )
        shards = self.coordinator_shards
        if not shards:
            return
        if len(shards) < 2 or len(set(shards)) != len(shards):
            raise ValueError(
                f"site.coordinator_shards must name two or more distinct endpoints, got {shards!r}"
            )
        bad = [e for e in shards if not e.startswith(("tcp://", "ipc://"))]
        if bad:
            raise ValueError(f"site.coordinator_shards: {bad[0]!r} is not a ZeroMQ endpoint")
        if self.coordinator != shards[0]:
            raise ValueError(
                f"site.coordinator must be shard 0's endpoint, coordinator_shards[0] = "
                f"{shards[0]!r}, got {self.coordinator!r}"
            )

    def __post_init__(self) -> None:
        if not self.rank_timeout_s > 0:
            raise ValueError(f"site.rank_timeout_s must be > 0, got {self.rank_timeout_s!r}")
        if not 0.0 <= self.error_feedback_decay <= 1.0:
            raise ValueError(
                f"site.error_feedback_decay must be in [0, 1], got {self.error_feedback_decay}"
            )
        if not self.site_id or not self.site_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(
                f"site.site_id must be non-empty letters, digits, '-' or '_', got {self.site_id!r}"
            )
        if bool(self.coordinator) == bool(self.coordinator_endpoint_file):
            raise ValueError(
                "site.coordinator: set exactly one of coordinator or coordinator_endpoint_file"
            )
        self._check_shards()
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"site.metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"site.device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.num_threads < 0:
            raise ValueError("site.num_threads must be >= 0")
        if self.fault_slow_step_s < 0:
            raise ValueError("site.fault_slow_step_s must be >= 0")
        if self.steps_per_poll < 1:
            raise ValueError("site.steps_per_poll must be >= 1")
        if self.stages < 1 or self.replicas < 1:
            raise ValueError("site.stages and site.replicas must be >= 1")
        # The job's own check of its options, where it offers one (the byte GPT does).
        checked = check_job_options(self.job.factory, self.job.options, self.job.python_path)
        if checked is not None and checked.layers is not None and self.stages > checked.layers:
            raise ValueError(
                f"site.stages={self.stages} exceeds the model's {checked.layers} layers"
            )
        if self.schedule not in TORCH_SCHEDULES:
            raise ValueError(
                f"site.schedule must be one of {', '.join(TORCH_SCHEDULES)}, got {self.schedule!r}"
            )
        if self.microbatches < 1:
            raise ValueError("site.microbatches must be >= 1")
        check_data_parallel(self.data_parallel, self.schedule, self.replicas, prefix="site.")

        self.security.require()

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    def not_for_sharded_sites(self) -> str:
        """What of this config a site whose model is sharded over its ranks does not do yet
        (``site_agent.shardreplica``), or ''."""
        if self.privacy is not None:
            return "differential privacy (site.privacy)"
        if self.secure_aggregation is not None:
            return "secure aggregation (site.secure_aggregation)"
        return ""


BYTEGPT_SECTIONS = ("model", "data", "optim", "eval_batches", "eval_batch_size")
"""The byte GPT job's settings a ``[site]`` table may still hold where its job's options belong
(``[site.model]`` for ``[site.job.options.model]``, and so on): read as those options."""


def bytegpt_sections_as_options(table: Mapping[str, Any], prefix: str = "site") -> dict[str, Any]:
    """``table`` (a ``[site]`` table) with the byte GPT's settings written in the site's own
    tables moved into the job's options, where they belong.

    ``[site.model]``, ``[site.data]``, ``[site.optim]``, ``site.eval_batches`` and
    ``site.eval_batch_size`` become the same keys of ``[site.job.options]``, a key given there
    winning; ``site.optim.grad_clip`` (clipping applies to every job) becomes
    ``site.job.grad_clip`` unless that is given. The byte GPT's settings with another job are
    refused, not ignored, unless they are the byte GPT's defaults (which change nothing): that
    job takes its settings from ``[site.job.options]``."""
    where = f"{prefix}." if prefix else ""
    legacy = {k: table[k] for k in BYTEGPT_SECTIONS if k in table}
    if not legacy:
        return dict(table)
    out = {k: v for k, v in table.items() if k not in BYTEGPT_SECTIONS}
    job = out.get("job", {})
    if not isinstance(job, Mapping):
        return dict(table)  # build names the bad value
    job = dict(job)
    optim = legacy.get("optim")
    if isinstance(optim, Mapping) and "grad_clip" in optim:
        job.setdefault("grad_clip", optim["grad_clip"])
        rest = {k: v for k, v in optim.items() if k != "grad_clip"}
        if rest:
            legacy["optim"] = rest
        else:
            del legacy["optim"]
    factory = job.get("factory", BYTEGPT_FACTORY)
    if legacy and factory != BYTEGPT_FACTORY:
        for name, value in legacy.items():
            # At the byte GPT's defaults a section changes nothing (and is dropped); a bad one is
            # named as written.
            checked = check_job_options(BYTEGPT_FACTORY, {name: value}, where=prefix)
            if checked is None or not checked.unchanged:
                raise ConfigError(
                    f"{where}{name} configures the built-in byte GPT job only; the job "
                    f"{factory!r} takes its settings from [{where}job.options]"
                )
        legacy = {}
    if legacy:
        # Checked as written, so that a bad one is named as the user wrote it (site.model...).
        check_job_options(BYTEGPT_FACTORY, legacy, where=prefix)
        options = job.get("options", {})
        job["options"] = merge(legacy, options) if isinstance(options, Mapping) else options
    out["job"] = job
    return out


def site_config_from_table(table: Mapping[str, Any]) -> SiteConfig:
    """A ``[site]`` table (its byte GPT sections read as its job's options) as a SiteConfig."""
    return build(SiteConfig, bytegpt_sections_as_options(table), prefix="site")


def load_site_config(path: str | Path, **explicit: object) -> SiteConfig:
    """Read ``[site]`` of a TOML file (plus ``CROSSDC_SITE_*`` overrides) into a SiteConfig."""
    doc = load_toml(path)
    unknown = sorted(set(doc) - {"site"})
    if unknown:
        raise ConfigError(f"unknown table [{unknown[0]}] in {path} (expected [site])")
    table = merge(doc.get("site", {}), env_overrides("site"))
    return build(SiteConfig, bytegpt_sections_as_options(table), prefix="site", **explicit)


def resolve_device(spec: str) -> str:
    """The device ``site.device`` names on this machine (``auto``: CUDA when present)."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"site.device={spec!r} but CUDA is not available")
    return spec
