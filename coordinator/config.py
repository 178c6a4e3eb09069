"""The coordinator's configuration: one frozen dataclass, read from ``[coordinator]`` in TOML,
and the sections each component takes.

Users write one ``[coordinator]`` table (:class:`CoordinatorConfig`, every key and every check
there). :func:`sections` cuts it into small frozen sections, one per concern, and the service
hands each component only the sections it uses: the rounds' shape (:class:`RoundsConfig`, the
lifecycle and the opening), the outer step (:class:`OuterConfig`: the strategy; the closing's
last plain mean), how updates are aggregated (:class:`AggregationConfig`), the scheduler's
policy (a :class:`~coordinator.scheduler.SchedulePolicy`: the planner), validation requests
(:class:`EvaluationConfig`: the closing), the socket (:class:`PostConfig`: the post office), the
durable state (:class:`StateConfig`) and the membership's site timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.ops.configio import load_section
from comm.ops.httpsec import HttpSecurityConfig
from comm.security.masking import SecAggConfig
from comm.security.rolekits import SecurityConfig
from comm.transport.profile import ChannelConfig
from coordinator import strategies
from coordinator.faults import FaultPlan
from coordinator.scheduler import SchedulePolicy, directions


@dataclass(frozen=True, kw_only=True)
class InitialModelConfig:
    """θ0 from the federation's seed and model config, built at the coordinator's first start
    exactly as every site builds it: no site uploads it, and each proves by hash at its join
    that it holds the same (a restart on its state builds it only if this table changed:
    ``coordinator.initial_model``). Without this table the first site to join uploads its
    parameters as θ0 (for a model that cannot be rebuilt from a seed, e.g. a user's
    checkpoint)."""

    seed: int
    """The sites' ``site.seed``."""
    model: dict[str, Any] = field(default_factory=dict)
    """The byte GPT's model options as the sites give them, ``[site.job.options.model]`` (the
    default job, ``site_agent/jobs/bytegpt``); its keys are checked against that model's config
    when the coordinator starts."""


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
    http: HttpSecurityConfig = field(default_factory=HttpSecurityConfig)
    """TLS and basic auth for the HTTP port (``[coordinator.http]``); plain HTTP without it."""
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
    outer_warmup_steps: int = 150
    """Rounds whose model has at most this many inner steps behind it (the slots of the completed
    rounds and its own) merge by a plain mean (outer lr 1, no momentum); Nesterov from then on.
    0: Nesterov from the first round."""
    outer_strategy: str = "diloco"
    """``diloco``: token-weighted mean, then SGD with Nesterov momentum (``outer_momentum``, with
    the warm-up and final mean above). ``sparseloco``: the sites' error-feedback accumulators
    are the only memory: the mean of their sparse updates times ``outer_lr``, no momentum buffer
    (pair it with the ``chunktopk`` uplink codec, ``site.error_feedback_decay = 0.95`` and
    ``broadcast = "sparse"``)."""
    broadcast: str = "dense"
    """``dense``: the outer step's delta through the downlink codec (with the coordinator's error
    feedback). ``sparse`` (``outer_strategy = "sparseloco"`` only): the round's encoded updates
    themselves, forwarded with their weights; each site runs the coordinator's step on them and
    lands on its parameters bit for bit, so no downlink codec or residual is involved."""
    outer_final_mean: bool = True
    """With ``max_rounds`` set and one fragment, the last round merges by the plain mean too: the
    kept model is the sites' average, not Nesterov's look-ahead past it."""
    uplink_codec: str = "auto"
    """Codec the sites use for pseudo-gradients; ``auto`` lets the scheduler choose per site."""
    downlink_codec: str = "auto"
    """Codec of the broadcast global delta (with error feedback); ``auto``: the scheduler's."""
    codec_ladder: tuple[str, ...] = (
        "fp32",
        "fp16",
        "int8",
        "int4",
        "int4+zstd",
        "int3+zstd",
    )
    """Codecs the scheduler may choose, least compressed first."""
    codec_loss_costs: dict[str, float] = field(
        default_factory=lambda: {
            "fp32": 0.0,
            "fp16": 0.0,
            "int8": 0.0009,
            "int4": 0.0024,
            "int4+zstd": 0.0024,
            "int3+zstd": 0.0067,
            "int2+zstd": 0.048,
            "int4+zstd/int3+zstd": 0.0037,
            "int3+zstd/int4+zstd": 0.0034,
        }
    )
    """Measured cost in validation loss, relative to fp32 (0.003 = +0.3%), of each codec used
    both ways (key ``"int4"``) or of an uplink codec with a downlink codec (key
    ``"int3+zstd/int4+zstd"``), as ``crossdc bench convergence`` reports it (defaults: its runs
    at the demo's scale, two seeds, equal tokens, with error feedback; ``+zstd`` is lossless, so
    int4+zstd costs what int4 does; see docs/wan.md). Bytes first: the scheduler takes the
    measured combination of ladder codecs with the fewest bytes whose cost is within
    ``codec_loss_budget`` (with the defaults: int3+zstd up, int4+zstd down, +0.34%); a
    combination missing here is never chosen that way. With none within the budget it falls
    back to the least compressed codec whose sync fits (``sync_fraction``,
    ``unmeasured_codec``)."""
    codec_loss_budget: float = 0.005
    """Largest loss cost (relative, see ``codec_loss_costs``) a codec may have to be chosen."""
    unmeasured_codec: str = "int8"
    """Fallback (no codec within the loss budget): the choice for a site whose link is not
    measured yet."""
    num_fragments: int = 1
    """Streaming sync: the model is synced in this many fragments, staggered over H steps."""
    overlap: bool = True
    """Sites keep training while a sync is in flight (the result is merged when it lands)."""
    target_utilization: float = 0.95
    """Compute utilization the scheduler aims for when it sizes codecs and slots."""
    sync_fraction: float = 0.25
    """Fallback (no codec within the loss budget), with overlap: the scheduler gives a site the
    least compressed codec whose sync takes at most this fraction of a slot's compute (else the
    most compressed)."""
    max_inner_steps: int = 2000
    """Upper bound on H when the scheduler lengthens slots to fit a slow link."""
    align_arrivals: bool = True
    """A site whose update landed early in the last closed round trains extra inner steps (up to
    a second slot) so that it lands with the others instead of waiting or merging stale results."""
    grace_floor_s: float = 1.0
    """Shortest wait for stragglers once a round has quorum."""
    grace_ceiling_s: float = 120.0
    """Longest wait for stragglers once a round has quorum."""
    max_staleness_rounds: int = 8
    """A late update older than this many rounds is refused (counted), not merged."""
    eval_every_rounds: int = 1
    """Ask a site for the validation loss of every N-th global version (and the last)."""
    site_uplink_codecs: dict[str, str] = field(default_factory=dict)
    """Per-site override of ``uplink_codec``, e.g. ``{ap = "int4"}`` for a thin link."""
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
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """Keys: the federation kit (``crossdc keys init``); ``insecure = true`` for loopback only."""
    secure_aggregation: SecAggConfig | None = None
    """Pairwise-masked updates: the coordinator learns only the sum (sites must agree)."""
    faults: FaultPlan = field(default_factory=FaultPlan)
    """Deterministic crash points for fault drills; all off by default."""
    initial_model: InitialModelConfig | None = None
    """Build θ0 from a seed instead of taking the first site's upload (see the table's doc)."""
    shards: int = 1
    """Coordinator processes, each owning a disjoint, size-balanced set of the model's tensors
    (``comm/wire/partition.py``), started by torchrun, a StatefulSet or systemd template units
    (``coordinator/sharding.py``); 1 is one coordinator process for the whole model."""
    shard_ports: str = "offset"
    """With several shards: ``offset`` (shards share a host) makes shard i bind ``bind``'s port
    + i and serve ``metrics_port`` + i; ``same`` (one shard per host or pod) keeps both."""
    shard_control_bind: str = "tcp://127.0.0.1:7720"
    """With several shards: where shard 0 listens for the other shards (its control plane).
    This host only by default; shards on several hosts need another address (``0.0.0.0``, a
    pod's), which needs ``[coordinator.security]`` keys: the plane admits only the
    coordinator's key, and without keys anyone who reaches it could join as a shard."""
    shard_control: str = ""
    """Where the other shards reach shard 0's ``shard_control_bind``; empty: torchrun's
    ``MASTER_ADDR`` at that port when started by torchrun, else ``127.0.0.1`` (one host)."""

    def __post_init__(self) -> None:
        self._check_shards()
        self._check_rounds()
        self._check_outer()
        self._check_limits()
        self._check_schedule()
        self._check_codecs()
        self.security.require()

    def _check_shards(self) -> None:
        """The shard count and how the shards' ports differ."""
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"coordinator.shards must be an integer >= 1, got {self.shards!r}")
        if self.shard_ports not in ("offset", "same"):
            raise ValueError(
                f"coordinator.shard_ports must be 'offset' or 'same', got {self.shard_ports!r}"
            )
        if self.shards == 1:
            return
        for key in ("shard_control_bind", "shard_control"):
            value = getattr(self, key)
            if (value or key == "shard_control_bind") and not _tcp_port(value):
                raise ValueError(
                    f"coordinator.{key} must be tcp://HOST:PORT with a port > 0, got {value!r}"
                )
        host = self.shard_control_bind[len("tcp://") :].rpartition(":")[0].strip("[]")
        if self.security.insecure and host not in _LOOPBACK and not host.startswith("127."):
            raise ValueError(
                f"coordinator.shard_control_bind = {self.shard_control_bind!r} listens beyond "
                "this host with security.insecure = true: any host that reaches it could join "
                "the shards' control plane and forge a shard's results. Bind it to 127.0.0.1 "
                "(every shard on this host) or give the shards a kit (security.kit_dir)"
            )
        if self.shard_ports == "offset":
            port = self.bind.rpartition(":")[2] if self.bind.startswith("tcp://") else ""
            for key, first in (
                ("bind", int(port) if port.isdigit() else 0),
                ("metrics_port", self.metrics_port),
            ):
                if first and first + self.shards - 1 > 65535:
                    raise ValueError(
                        f"coordinator.{key}: {self.shards} shards from port {first} run past "
                        "65535 (shard_ports = 'offset' gives shard i the port + i)"
                    )
        if self.keep_checkpoints < 2:
            raise ValueError(
                f"coordinator.shards = {self.shards} needs coordinator.keep_checkpoints >= 2 (a "
                f"shard may have to go back one version), got {self.keep_checkpoints}"
            )
        for key, value, plain in (
            ("num_fragments", self.num_fragments, 1),
            ("secure_aggregation", self.secure_aggregation, None),
            ("broadcast", self.broadcast, "dense"),
        ):
            if value != plain:
                raise ValueError(
                    f"coordinator.shards = {self.shards} needs coordinator.{key} at its "
                    f"default ({plain!r})"
                )

    def _check_rounds(self) -> None:
        """The endpoint, the HTTP port, membership and the rounds' shape."""
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

    def _check_outer(self) -> None:
        """The outer optimizer."""
        if not self.outer_lr > 0:
            raise ValueError(f"coordinator.outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_warmup_steps < 0:
            raise ValueError(
                f"coordinator.outer_warmup_steps must be >= 0, got {self.outer_warmup_steps}"
            )
        # Secure aggregation's masked sum reveals only the sum of a round's updates (its
        # aggregator declares so); every other aggregation sees each update.
        sum_only = self.secure_aggregation is not None
        problem = strategies.problem(
            self.outer_strategy,
            broadcast=self.broadcast,
            reveals=strategies.Revealed.SUM if sum_only else strategies.Revealed.EACH_UPDATE,
            spelling=strategies.Spelling(
                sum_only="coordinator.secure_aggregation", sum_only_words="secure aggregation"
            ),
        )
        if problem is not None:
            raise ValueError(problem)
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(
                f"coordinator.outer_momentum must be in [0, 1), got {self.outer_momentum}"
            )

    def _check_limits(self) -> None:
        """Site silence, checkpoints kept and the update-norm guard."""
        if self.site_timeout_s <= 0:
            raise ValueError("coordinator.site_timeout_s must be > 0")
        if self.keep_checkpoints < 1:
            raise ValueError("coordinator.keep_checkpoints must be >= 1")
        if not self.max_update_norm > 0:
            raise ValueError("coordinator.max_update_norm must be > 0")

    def _check_schedule(self) -> None:
        """Fragments, the scheduler's targets and bounds, grace, staleness and evaluation."""
        if self.num_fragments < 1:
            raise ValueError(f"coordinator.num_fragments must be >= 1, got {self.num_fragments}")
        if self.num_fragments > self.num_inner_steps:
            raise ValueError("coordinator.num_fragments must be <= coordinator.num_inner_steps")
        if not 0 < self.target_utilization < 1:
            raise ValueError("coordinator.target_utilization must be in (0, 1)")
        if not 0 < self.sync_fraction <= 1:
            raise ValueError("coordinator.sync_fraction must be in (0, 1]")
        if self.max_inner_steps < self.num_inner_steps:
            raise ValueError("coordinator.max_inner_steps must be >= coordinator.num_inner_steps")
        if not 0 <= self.grace_floor_s <= self.grace_ceiling_s:
            raise ValueError("coordinator.grace_floor_s must be in [0, grace_ceiling_s]")
        if self.max_staleness_rounds < 0:
            raise ValueError("coordinator.max_staleness_rounds must be >= 0")
        if self.eval_every_rounds < 1:
            raise ValueError("coordinator.eval_every_rounds must be >= 1")

    def _check_codecs(self) -> None:
        """Every codec named (ladder, unmeasured, fixed, per site) exists and parses."""
        from comm.codecs.registry import get_codec

        if not self.codec_ladder:
            raise ValueError("coordinator.codec_ladder must name at least one codec")
        specs = {f"codec_ladder[{i}]": c for i, c in enumerate(self.codec_ladder)}
        specs["unmeasured_codec"] = self.unmeasured_codec
        if self.unmeasured_codec not in self.codec_ladder:
            raise ValueError("coordinator.unmeasured_codec must be one of codec_ladder")
        for name in ("uplink_codec", "downlink_codec"):
            if getattr(self, name) != "auto":
                specs[name] = getattr(self, name)
        specs.update({f"site_uplink_codecs.{k}": v for k, v in self.site_uplink_codecs.items()})
        for key in self.codec_loss_costs:
            try:
                up, down = directions(key) if isinstance(key, str) else (key, key)
            except ValueError as exc:
                raise ValueError(f"coordinator.codec_loss_costs.{key}: {exc}") from None
            specs[f"codec_loss_costs.{key}"] = up
            if down != up:
                specs[f"codec_loss_costs.{key} (downlink)"] = down
        for name, cost in self.codec_loss_costs.items():
            if (
                isinstance(cost, bool)
                or not isinstance(cost, int | float)
                or not math.isfinite(cost)
            ):
                raise ValueError(
                    f"coordinator.codec_loss_costs.{name} must be a number, got {cost!r}"
                )
        budget = self.codec_loss_budget
        if isinstance(budget, bool) or not (isinstance(budget, int | float) and budget >= 0):
            raise ValueError(f"coordinator.codec_loss_budget must be >= 0, got {budget!r}")
        for name, spec in specs.items():
            if not isinstance(spec, str):
                raise ValueError(f"coordinator.{name} must be a codec name, got {spec!r}")
            try:
                get_codec(spec)
            except ValueError as exc:
                raise ValueError(f"coordinator.{name}: {exc}") from None

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


_LOOPBACK = ("localhost", "::1")


def _tcp_port(endpoint: str) -> int:
    """The port of a ``tcp://HOST:PORT`` endpoint; 0 when it is not one."""
    if not endpoint.startswith("tcp://"):
        return 0
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return int(port) if host and port.isdigit() else 0


def load_coordinator_config(path: str | Path, **explicit: object) -> CoordinatorConfig:
    return load_section(CoordinatorConfig, path, "coordinator", **explicit)


# ---- the sections components take ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RoundsConfig:
    """When rounds open, close and give up: what the lifecycle decides with and the opening
    announces."""

    min_sites: int
    quorum_fraction: float
    max_rounds: int
    max_open: int
    """Rounds open at once: 2 when sync overlaps compute, else 1."""
    num_fragments: int
    max_staleness_rounds: int
    round_deadline_s: float
    grace_floor_s: float
    grace_ceiling_s: float


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer step: the strategy by name, its settings, and the last round's plain mean."""

    strategy: str
    lr: float
    momentum: float
    warmup_steps: int
    final_mean: bool
    """The run's last round merges by the plain mean (with ``max_rounds`` and one fragment)."""


@dataclass(frozen=True, kw_only=True)
class AggregationConfig:
    """How every round aggregates its updates (the aggregator is chosen from this, once)."""

    broadcast: str
    max_update_norm: float
    secure_aggregation: SecAggConfig | None

    @property
    def sum_word_bytes(self) -> int:
        """Bytes per value of a round's sum: float32 (the weighted mean's, one tensor at a time
        at the close), or the masked sum's own words (``word_bits``) under secure aggregation,
        kept whole while the round is open."""
        masked = self.secure_aggregation
        return masked.word_bits // 8 if masked is not None else 4

    @property
    def holds_updates(self) -> bool:
        """Whether a round holds each update as the bytes it came as until its close (the
        weighted mean, the sparse broadcast); False: it adds each to a sum kept whole while the
        round is open (secure aggregation's masked sum)."""
        return self.secure_aggregation is None


@dataclass(frozen=True, kw_only=True)
class EvaluationConfig:
    """Which results a site is asked to validate, and how long the end waits for the last."""

    every_rounds: int
    final_wait_s: float


@dataclass(frozen=True, kw_only=True)
class PostConfig:
    """The coordinator's socket: where it binds, its WAN profile, and how long a finished
    federation's last messages may take to go out."""

    bind: str
    channel: ChannelConfig
    finish_flush_s: float


@dataclass(frozen=True, kw_only=True)
class StateConfig:
    """Where the durable state lives and how many checkpoints are kept."""

    dir: str
    keep_checkpoints: int

    @property
    def path(self) -> Path | None:
        """The state directory (None: no directory, ``dir`` is empty)."""
        return Path(self.dir) if self.dir else None


@dataclass(frozen=True, kw_only=True)
class Sections:
    """The ``[coordinator]`` table, cut into the sections the components take."""

    rounds: RoundsConfig
    outer: OuterConfig
    aggregation: AggregationConfig
    schedule: SchedulePolicy
    """The scheduler's policy, less the model's size (the planner adds it per round)."""
    evaluation: EvaluationConfig
    post: PostConfig
    state: StateConfig
    site_timeout_s: float
    """The membership's: a member silent for this long is removed."""
    faults: FaultPlan


def sections(cfg: CoordinatorConfig) -> Sections:
    """The sections of ``cfg`` (checked already: every check is the table's)."""
    return Sections(
        rounds=RoundsConfig(
            min_sites=cfg.min_sites,
            quorum_fraction=cfg.quorum_fraction,
            max_rounds=cfg.max_rounds,
            max_open=2 if cfg.overlap else 1,
            num_fragments=cfg.num_fragments,
            max_staleness_rounds=cfg.max_staleness_rounds,
            round_deadline_s=cfg.round_deadline_s,
            grace_floor_s=cfg.grace_floor_s,
            grace_ceiling_s=cfg.grace_ceiling_s,
        ),
        outer=OuterConfig(
            strategy=cfg.outer_strategy,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            warmup_steps=cfg.outer_warmup_steps,
            final_mean=cfg.outer_final_mean,
        ),
        aggregation=AggregationConfig(
            broadcast=cfg.broadcast,
            max_update_norm=cfg.max_update_norm,
            secure_aggregation=cfg.secure_aggregation,
        ),
        schedule=SchedulePolicy(
            num_inner_steps=cfg.num_inner_steps,
            num_fragments=cfg.num_fragments,
            overlap=cfg.overlap,
            target_utilization=cfg.target_utilization,
            sync_fraction=cfg.sync_fraction,
            ladder=cfg.codec_ladder,
            loss_costs=cfg.codec_loss_costs,
            loss_budget=cfg.codec_loss_budget,
            fixed_uplink=cfg.site_uplink_codecs,
            default_uplink=None if cfg.uplink_codec == "auto" else cfg.uplink_codec,
            fixed_downlink=None if cfg.downlink_codec == "auto" else cfg.downlink_codec,
            unmeasured_codec=cfg.unmeasured_codec,
            max_inner_steps=cfg.max_inner_steps,
            align_arrivals=cfg.align_arrivals,
        ),
        evaluation=EvaluationConfig(
            every_rounds=cfg.eval_every_rounds, final_wait_s=cfg.final_eval_wait_s
        ),
        post=PostConfig(bind=cfg.bind, channel=cfg.channel, finish_flush_s=cfg.round_deadline_s),
        state=StateConfig(dir=cfg.state_dir, keep_checkpoints=cfg.keep_checkpoints),
        site_timeout_s=cfg.site_timeout_s,
        faults=cfg.faults,
    )
