"""The coordinator's configuration: one frozen dataclass, read from ``[coordinator]`` in TOML."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from comm.channel import ChannelConfig
from comm.configio import load_section
from coordinator.faults import FaultPlan


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Everything one coordinator needs; every field can be set in ``[coordinator]``."""

    bind: str = "tcp://0.0.0.0:7710"
    """ZeroMQ endpoint the ROUTER binds; port 0 picks a free port (written to endpoint.json)."""
    state_dir: str = "./coordinator-state"
    """Durable state: global parameters, outer-optimizer state, round counter, history."""
    metrics_port: int = 9710
    """HTTP port for /metrics and /status; 0 turns it off."""
    metrics_host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    min_sites: int = 2
    """A round opens only when at least this many sites are joined and in sync."""
    quorum_fraction: float = 1.0
    """A round may close at its deadline with this fraction of participants' updates."""
    round_deadline_s: float = 1800.0
    """Seconds a round waits for updates before closing with quorum or aborting."""
    num_inner_steps: int = 100
    """H: inner steps each site trains per round."""
    max_rounds: int = 0
    """Stop (and tell sites to stop) after this many completed rounds; 0 runs forever."""
    outer_lr: float = 0.7
    """Outer SGD learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    uplink_codec: str = "fp32"
    """Codec the sites use for pseudo-gradients."""
    downlink_codec: str = "fp32"
    """Codec for the global delta the coordinator broadcasts."""
    max_update_norm: float = 1e6
    """An update whose L2 norm exceeds this is rejected (a guard against corrupt sites)."""
    site_timeout_s: float = 30.0
    """A site not heard from for this long is removed from membership."""
    final_eval_wait_s: float = 120.0
    """After the last round, how long to wait for the final validation loss before stopping."""
    keep_checkpoints: int = 2
    """How many durable global checkpoints to keep on disk."""
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    """WAN socket profile."""
    faults: FaultPlan = field(default_factory=FaultPlan)
    """Deterministic crash points for fault drills; all off by default."""

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"coordinator.bind must be a ZeroMQ endpoint, got {self.bind!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"coordinator.metrics_port must be in [0, 65535], got {self.metrics_port}"
            )
        if self.min_sites < 1:
            raise ValueError(f"coordinator.min_sites must be >= 1, got {self.min_sites}")
        if not 0.0 < self.quorum_fraction <= 1.0:
            raise ValueError(
                f"coordinator.quorum_fraction must be in (0, 1], got {self.quorum_fraction}"
            )
        if self.round_deadline_s <= 0:
            raise ValueError("coordinator.round_deadline_s must be > 0")
        if self.num_inner_steps < 1:
            raise ValueError(
                f"coordinator.num_inner_steps must be >= 1, got {self.num_inner_steps}"
            )
        if self.max_rounds < 0:
            raise ValueError("coordinator.max_rounds must be >= 0")
        if not self.outer_lr > 0:
            raise ValueError(f"coordinator.outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(
                f"coordinator.outer_momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if self.site_timeout_s <= 0:
            raise ValueError("coordinator.site_timeout_s must be > 0")
        if self.keep_checkpoints < 1:
            raise ValueError("coordinator.keep_checkpoints must be >= 1")
        if not self.max_update_norm > 0:
            raise ValueError("coordinator.max_update_norm must be > 0")
        from comm.compress import get_codec

        for name in ("uplink_codec", "downlink_codec"):
            try:
                get_codec(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"coordinator.{name}: {exc}") from None

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


def load_coordinator_config(path: str | Path, **explicit: object) -> CoordinatorConfig:
    return load_section(CoordinatorConfig, path, "coordinator", **explicit)
