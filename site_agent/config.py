"""A site agent's configuration: one frozen dataclass per component, read from ``[site]``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from comm.ops.configio import load_section
from comm.ops.httpsec import HttpSecurityConfig
from comm.security.kits import SecurityConfig
from comm.security.masking import SecAggConfig
from comm.transport.profile import ChannelConfig
from site_agent.model import ModelConfig
from site_agent.privacy import DPConfig
from site_agent.trainer import InnerOptimConfig


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where a site's training and validation text comes from."""

    source: str = "stdlib"
    """``stdlib`` (the embedded default corpus) or ``dir`` (a directory of text files)."""
    path: str = ""
    """For ``dir``: the directory of training text."""
    val_path: str = ""
    """For ``dir``: a directory of validation text; empty holds out the tail of ``path``."""
    shard_index: int = 0
    """For ``stdlib``: which of ``num_shards`` disjoint module sets this site trains on."""
    num_shards: int = 1
    """For ``stdlib``: how many sites split the standard library."""
    max_bytes: int = 0
    """Cap on training bytes loaded (0: no cap)."""
    val_fraction: float = 0.05
    """For ``dir`` without ``val_path``: the fraction of bytes held out at the end."""

    def __post_init__(self) -> None:
        if self.source not in ("stdlib", "dir"):
            raise ValueError(f"site.data.source must be 'stdlib' or 'dir', got {self.source!r}")
        if self.source == "dir" and not self.path:
            raise ValueError("site.data.path is required when site.data.source = 'dir'")
        if self.num_shards < 1:
            raise ValueError(f"site.data.num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"site.data.shard_index must be in [0, {self.num_shards}), got {self.shard_index}"
            )
        if self.max_bytes < 0:
            raise ValueError("site.data.max_bytes must be >= 0")
        if not 0 < self.val_fraction < 1:
            raise ValueError("site.data.val_fraction must be in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    """Everything one site agent needs; every field can be set in ``[site]``."""

    site_id: str
    """This data center's name, unique in the federation (e.g. ``eu``)."""
    coordinator: str = ""
    """The coordinator's ZeroMQ endpoint, e.g. ``tcp://coord.example.org:7710``."""
    coordinator_endpoint_file: str = ""
    """Alternatively, a file holding ``{"endpoint": ...}`` (written by a local coordinator)."""
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
    eval_batches: int = 8
    """Validation batches per evaluation."""
    eval_batch_size: int = 16
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
    """Pipeline schedule: ``gpipe`` or ``1f1b``."""
    microbatches: int = 4
    """Micro-batches per pipeline step."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """The site's startup kit (``crossdc keys issue``); ``insecure = true`` for loopback only."""
    secure_aggregation: SecAggConfig | None = None
    """Mask updates pairwise so the coordinator learns only their sum (as the coordinator's)."""
    privacy: DPConfig | None = None
    """Differential privacy of this site's updates (clip + Gaussian noise); off when absent."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)

    def __post_init__(self) -> None:
        if not self.site_id or not self.site_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(
                f"site.site_id must be non-empty letters, digits, '-' or '_', got {self.site_id!r}"
            )
        if bool(self.coordinator) == bool(self.coordinator_endpoint_file):
            raise ValueError(
                "site.coordinator: set exactly one of coordinator or coordinator_endpoint_file"
            )
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
        if self.eval_batches < 1 or self.eval_batch_size < 1:
            raise ValueError("site.eval_batches and site.eval_batch_size must be >= 1")
        if self.stages < 1 or self.replicas < 1:
            raise ValueError("site.stages and site.replicas must be >= 1")
        if self.stages > self.model.num_layers + 2:
            raise ValueError(
                f"site.stages={self.stages} exceeds the model's {self.model.num_layers + 2} layers"
            )
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"site.schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if self.microbatches < 1:
            raise ValueError("site.microbatches must be >= 1")

        self.security.require()

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


def load_site_config(path: str | Path, **explicit: object) -> SiteConfig:
    return load_section(SiteConfig, path, "site", **explicit)
