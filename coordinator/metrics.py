"""The coordinator's Prometheus metrics, declared once (docs/architecture.md, "Observability").

Each :class:`CoordinatorMetrics` owns its registry, so several coordinators can live in one
process (tests) without colliding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from comm.ops.observe import crossdc_version, register_process_collectors

# Round and transfer durations on a WAN range from seconds to tens of minutes.
DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, float("inf"))
SIZE_BUCKETS = tuple(float(4**i) for i in range(5, 17)) + (float("inf"),)

CertificateSource = Callable[[], Iterable[tuple[str, str, float]]]
"""What the coordinator trusts now, as ``(site, serial, not_after)``: read at each scrape."""


class _CertificateExpiry(Collector):
    """``crossdc_certificate_expiry_timestamp_seconds{site, serial}``, one per certificate the
    coordinator accepts (issued, CA-signed, not revoked), read from the source at each scrape."""

    NAME = "crossdc_certificate_expiry_timestamp_seconds"

    def __init__(self) -> None:
        self.source: CertificateSource | None = None

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            self.NAME,
            "Expiry (not_after, unix seconds) of each site certificate the coordinator accepts",
            labels=["site", "serial"],
        )

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        if self.source is not None:
            for site, serial, not_after in self.source():
                family.add_metric([site, serial], float(not_after))
        yield family


CASource = Callable[[], Iterable[tuple[str, float]]]
"""The CAs the coordinator trusts now, as ``(fingerprint, not_after)``: read at each scrape."""


class _CAExpiry(Collector):
    """``crossdc_ca_certificate_expiry_timestamp_seconds{ca}``, one per CA the coordinator
    trusts (two during a CA rollover), read from the source at each scrape."""

    NAME = "crossdc_ca_certificate_expiry_timestamp_seconds"

    def __init__(self) -> None:
        self.source: CASource | None = None

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            self.NAME,
            "Expiry (notAfter, unix seconds) of each federation CA certificate the coordinator "
            "trusts (ca: its key's fingerprint); no site certificate of a CA verifies after it",
            labels=["ca"],
        )

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        if self.source is not None:
            for fingerprint, not_after in self.source():
                family.add_metric([fingerprint], float(not_after))
        yield family


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._declare_rounds(r)
        self._declare_updates(r)
        self._declare_traffic(r)
        self._declare_model(r)
        self._declare_events(r)
        self._declare_process(r)

    def _declare_rounds(self, r: CollectorRegistry) -> None:
        """Rounds: completed, aborted, their duration, the global version, quorum and members."""
        self.rounds = Counter("crossdc_rounds_total", "Outer rounds completed", registry=r)
        self.rounds_aborted = Counter(
            "crossdc_rounds_aborted_total", "Outer rounds aborted without quorum", registry=r
        )
        self.round_duration = Histogram(
            "crossdc_round_duration_seconds",
            "Wall time from opening a round to publishing its result",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.global_version = Gauge(
            "crossdc_global_version", "Round id of the current global model", registry=r
        )
        self.quorum_size = Gauge(
            "crossdc_quorum_size", "Updates merged in the last completed round", registry=r
        )
        self.members = Gauge("crossdc_members", "Sites currently joined", registry=r)

    def _declare_updates(self, r: CollectorRegistry) -> None:
        """Site updates: accepted and planned extra steps per site, rejections by reason."""
        self.updates_accepted = Counter(
            "crossdc_updates_accepted_total", "Site updates accepted", ["site"], registry=r
        )
        self.extra_steps = Counter(
            "crossdc_extra_steps_total",
            "Extra inner steps planned for a site that landed early (arrival alignment)",
            ["site"],
            registry=r,
        )
        self.rejected = Counter(
            "crossdc_rejected_total", "Messages or updates rejected", ["reason"], registry=r
        )
        # The fold's cost: values of accepted updates, each checked on arrival and folded into
        # its round's mean at the close, and the CPU time of the thread that did both (the
        # coordinator's main thread; the transport's and the writer's threads are not counted),
        # so their ratio is the fold's speed.
        self.fold_parameter_updates = Counter(
            "crossdc_fold_parameter_updates_total",
            "Parameter values of accepted updates decoded, checked and folded into a round",
            registry=r,
        )
        self.fold_cpu_seconds = Counter(
            "crossdc_fold_cpu_seconds_total",
            "CPU time of the thread that checked accepted updates and folded them at the close",
            registry=r,
        )

    def _declare_traffic(self, r: CollectorRegistry) -> None:
        """Bytes on the wire and in tensor payloads, before and after compression."""
        self.wire_bytes = Counter(
            "crossdc_wire_bytes_total",
            "Bytes on coordinator<->site sockets (after compression)",
            ["direction"],
            registry=r,
        )
        self.payload_raw_bytes = Counter(
            "crossdc_payload_raw_bytes_total",
            "Tensor payload bytes before compression (fp32)",
            ["direction"],
            registry=r,
        )
        self.payload_bytes = Counter(
            "crossdc_payload_bytes_total",
            "Tensor payload bytes after compression",
            ["direction"],
            registry=r,
        )
        self.update_size = Histogram(
            "crossdc_update_size_bytes",
            "Encoded size of accepted site updates",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        # The receive budget: chunked messages reassembled at once are bounded; others wait.
        self.transfers_waiting = Gauge(
            "crossdc_transfers_waiting",
            "Chunked messages waiting for the receive budget (their senders hold, resending nothing)",
            registry=r,
        )
        self.transfers_waited = Counter(
            "crossdc_transfers_waited_total",
            "Chunked messages that waited for the receive budget before they were reassembled",
            registry=r,
        )
        self.reassembly_peak_bytes = Gauge(
            "crossdc_reassembly_peak_bytes",
            "Most bytes held at once for chunked messages being received, since the start",
            registry=r,
        )

    def _declare_model(self, r: CollectorRegistry) -> None:
        """The model: outer gradient norm, validation and training loss."""
        self.outer_grad_norm = Gauge(
            "crossdc_outer_grad_norm", "L2 norm of the last outer gradient", registry=r
        )
        self.val_loss = Gauge(
            "crossdc_val_loss", "Validation loss of the latest evaluated global model", registry=r
        )
        self.train_loss = Gauge(
            "crossdc_train_loss", "Token-weighted mean inner training loss, last round", registry=r
        )

    def _declare_events(self, r: CollectorRegistry) -> None:
        """Late updates, joins, identity conflicts and sites removed for silence."""
        self.late_updates = Counter(
            "crossdc_late_updates_total",
            "Updates that arrived after their round closed, kept for a later round",
            registry=r,
        )
        self.joins = Counter("crossdc_joins_total", "Site joins", registry=r)
        self.catch_up_deltas = Counter(
            "crossdc_catch_up_deltas_total",
            "Broadcast deltas sent to sites behind (rejoined, or asking for the model) instead of "
            "the model",
            registry=r,
        )
        self.site_timeouts = Counter(
            "crossdc_site_timeouts_total", "Sites removed for silence", registry=r
        )
        self.identity_conflicts = Counter(
            "crossdc_identity_conflicts_total",
            "Joins of a site from a second connection, refused while its current connection "
            "kept heartbeating: two holders of one site key (a stolen key, or the site run twice)",
            ["site"],
            registry=r,
        )
        self.messages_resent = Counter(
            "crossdc_messages_resent_total",
            "Messages that must arrive (plans, results, models) sent again to a site because "
            "their acknowledgement was late: lost in a reset, a stalled transfer, the site away",
            registry=r,
        )
        self.messages_abandoned = Counter(
            "crossdc_messages_abandoned_total",
            "Messages that must arrive given up unacknowledged (over the held bounds, or the "
            "site restarted or was removed)",
            registry=r,
        )
        self.duplicates_dropped = Counter(
            "crossdc_duplicates_dropped_total",
            "Messages from sites dropped because the coordinator already had them (a resend "
            "whose original arrived)",
            registry=r,
        )

    def _declare_process(self, r: CollectorRegistry) -> None:
        """The process and its build, the certificates it trusts, refused HTTP requests."""
        register_process_collectors(r)
        self.build_info = Gauge(
            "crossdc_build_info", "Always 1; the crossdc version running", ["version"], registry=r
        )
        self.build_info.labels(version=crossdc_version()).set(1)
        self._certificates = _CertificateExpiry()
        r.register(self._certificates)
        self._cas = _CAExpiry()
        r.register(self._cas)
        self.trust_refused = Counter(
            "crossdc_trust_reload_refused_total",
            "Changes to the kit's trust material (ca.pem, retired/, crl.pem) the running "
            "coordinator refused to load, keeping what it had",
            ["reason"],
            registry=r,
        )
        self.http_refused = Counter(
            "crossdc_http_refused_total",
            "Requests to /metrics or /status refused (TLS handshake, missing or wrong credentials)",
            ["reason"],
            registry=r,
        )

    def watch_certificates(self, source: CertificateSource) -> None:
        """Expose the expiry of the certificates ``source()`` returns, at every scrape."""
        self._certificates.source = source

    def watch_cas(self, source: CASource) -> None:
        """Expose the expiry of the CAs ``source()`` returns, at every scrape."""
        self._cas.source = source

    def refused(self, reason: str) -> None:
        self.http_refused.labels(reason=reason).inc()
