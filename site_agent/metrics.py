"""A site agent's Prometheus metrics, declared once (docs/architecture.md, "Observability")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from comm.ops.observe import crossdc_version, register_process_collectors

DURATION_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, float("inf"))
STEP_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, float("inf"))


class SiteMetrics:
    def __init__(self, site_id: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.site_id = site_id
        lab = ["site"]
        self._declare_progress(r, lab)
        self._declare_compute(r, lab)
        self._declare_wire(r, lab)
        self._declare_sync(r, lab)
        self._declare_process(r, lab)

    def _declare_progress(self, r: CollectorRegistry, lab: list[str]) -> None:
        """Training progress: steps, tokens, rounds, losses and the global version held."""
        self._inner_steps = Counter(
            "crossdc_site_inner_steps_total", "Inner optimizer steps", lab, registry=r
        )
        self._tokens = Counter("crossdc_site_tokens_total", "Tokens trained on", lab, registry=r)
        self._rounds = Counter(
            "crossdc_site_rounds_total",
            "Outer rounds this site sent an update for",
            lab,
            registry=r,
        )
        self._train_loss = Gauge(
            "crossdc_site_train_loss", "Mean inner training loss, last round", lab, registry=r
        )
        self._val_loss = Gauge(
            "crossdc_site_val_loss", "Validation loss of the global model", lab, registry=r
        )
        self._global_version = Gauge(
            "crossdc_site_global_version", "Global model version held", lab, registry=r
        )
        self._val_metric = Gauge(
            "crossdc_site_val_metric",
            "The job's other validation metrics of the global model (accuracy, say), by name",
            ["site", "metric"],
            registry=r,
        )
        self._nonfinite_steps = Counter(
            "crossdc_site_nonfinite_steps_total",
            "Inner steps skipped because the job's loss was NaN or infinite",
            lab,
            registry=r,
        )

    def _declare_compute(self, r: CollectorRegistry, lab: list[str]) -> None:
        """Where the time goes: compute, utilization and stalls on the coordinator."""
        self._compute_util = Gauge(
            "crossdc_site_compute_utilization",
            "Inner steps per second over the training period / the rate with no sync in flight",
            lab,
            registry=r,
        )
        self._stall = Counter(
            "crossdc_site_sync_stall_seconds_total",
            "Seconds not computing while waiting on the coordinator",
            lab,
            registry=r,
        )
        self._compute = Counter(
            "crossdc_site_compute_seconds_total", "Seconds spent in inner steps", lab, registry=r
        )
        self._round_compute = Histogram(
            "crossdc_site_round_compute_seconds",
            "Inner-step compute per round",
            lab,
            buckets=DURATION_BUCKETS,
            registry=r,
        )

    def _declare_wire(self, r: CollectorRegistry, lab: list[str]) -> None:
        """The coordinator link: bytes, rejected messages, measured RTT and goodput."""
        self._wire_bytes = Counter(
            "crossdc_site_wire_bytes_total",
            "Bytes on this site's coordinator socket",
            ["site", "direction"],
            registry=r,
        )
        self._rejected = Counter(
            "crossdc_site_rejected_total",
            "Messages rejected by this site",
            ["site", "reason"],
            registry=r,
        )
        self._link_rtt = Gauge(
            "crossdc_site_link_rtt_seconds",
            "Measured round trip to the coordinator",
            lab,
            registry=r,
        )
        self._link_goodput = Gauge(
            "crossdc_site_link_goodput_bytes_per_second",
            "Measured goodput of transfers from the coordinator, bytes per second",
            lab,
            registry=r,
        )
        self._link_measured = Gauge(
            "crossdc_site_link_measured",
            "1 once the link's RTT and goodput are both measured; 0: they are not yet (no sample)",
            lab,
            registry=r,
        )

    def _declare_sync(self, r: CollectorRegistry, lab: list[str]) -> None:
        """What syncing costs: privacy spent, uplink residual, merge delay."""
        self._dp_epsilon = Gauge(
            "crossdc_site_dp_epsilon",
            "Differential-privacy epsilon spent so far (at the configured delta)",
            lab,
            registry=r,
        )
        self._ef_norm = Gauge(
            "crossdc_site_error_feedback_norm", "L2 norm of the uplink residual", lab, registry=r
        )
        self._merge_delay = Histogram(
            "crossdc_site_merge_delay_steps",
            "Inner steps between sending a fragment's update and merging its result",
            lab,
            buckets=STEP_BUCKETS,
            registry=r,
        )

    def _declare_process(self, r: CollectorRegistry, lab: list[str]) -> None:
        """The process and its build, the site's certificate, refused HTTP requests."""
        register_process_collectors(r)
        self._build_info = Gauge(
            "crossdc_build_info",
            "Always 1; the crossdc version running",
            ["site", "version"],
            registry=r,
        )
        self._build_info.labels(site=self.site_id, version=crossdc_version()).set(1)
        self._cert_expiry = Gauge(
            "crossdc_site_certificate_expiry_timestamp_seconds",
            "Expiry (not_after, unix seconds) of this site's certificate",
            lab,
            registry=r,
        )
        self._trust_refused = Counter(
            "crossdc_site_trust_reload_refused_total",
            "Changes to the site's kit (site.pem, ca.pem) the running agent refused to load, "
            "keeping the certificate it had",
            ["site", "reason"],
            registry=r,
        )
        self._http_refused = Counter(
            "crossdc_site_http_refused_total",
            "Requests to /metrics or /status refused (TLS handshake, missing or wrong credentials)",
            ["site", "reason"],
            registry=r,
        )

    def inner(self, steps: int, tokens: int, seconds: float, loss: float) -> None:
        s = self.site_id
        self._inner_steps.labels(site=s).inc(steps)
        self._tokens.labels(site=s).inc(tokens)
        self._compute.labels(site=s).inc(seconds)
        self._round_compute.labels(site=s).observe(seconds)
        self._train_loss.labels(site=s).set(loss)

    def round_sent(self) -> None:
        self._rounds.labels(site=self.site_id).inc()

    def val_loss(self, value: float) -> None:
        self._val_loss.labels(site=self.site_id).set(value)

    def val_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._val_metric.labels(site=self.site_id, metric=name).set(value)

    def nonfinite_step(self, _step: int) -> None:
        self._nonfinite_steps.labels(site=self.site_id).inc()

    def global_version(self, version: int) -> None:
        self._global_version.labels(site=self.site_id).set(version)

    def utilization(self, value: float) -> None:
        self._compute_util.labels(site=self.site_id).set(value)

    def stalled(self, seconds: float) -> None:
        self._stall.labels(site=self.site_id).inc(seconds)

    def wire(self, sent: int, received: int) -> None:
        self._wire_bytes.labels(site=self.site_id, direction="out").inc(sent)
        self._wire_bytes.labels(site=self.site_id, direction="in").inc(received)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(site=self.site_id, reason=reason).inc()

    def link(self, *, rtt_s: float, goodput_bytes_per_s: float, measured: bool) -> None:
        """The link's figures; ``measured`` False while they are not measurements yet."""
        self._link_rtt.labels(site=self.site_id).set(rtt_s)
        self._link_goodput.labels(site=self.site_id).set(goodput_bytes_per_s)
        self._link_measured.labels(site=self.site_id).set(1 if measured else 0)

    def certificate_expiry(self, not_after: float) -> None:
        self._cert_expiry.labels(site=self.site_id).set(not_after)

    def trust_refused(self, reason: str) -> None:
        self._trust_refused.labels(site=self.site_id, reason=reason).inc()

    def refused(self, reason: str) -> None:
        self._http_refused.labels(site=self.site_id, reason=reason).inc()

    def dp_epsilon(self, value: float) -> None:
        self._dp_epsilon.labels(site=self.site_id).set(value)

    def ef_norm(self, value: float) -> None:
        self._ef_norm.labels(site=self.site_id).set(value)

    def merge_delay(self, steps: int) -> None:
        self._merge_delay.labels(site=self.site_id).observe(steps)
