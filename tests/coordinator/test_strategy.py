"""Aggregation and outer-step math: golden numbers, torch parity, determinism."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from coordinator.strategies.base import nesterov_step, weighted_mean
from coordinator.strategies.diloco import DiLoCo

pytestmark = pytest.mark.timeout(60)


def test_weighted_mean_golden() -> None:
    out = weighted_mean(
        [
            (1.0, {"a": np.array([1.0, 2.0], np.float32)}),
            (3.0, {"a": np.array([5.0, 6.0], np.float32)}),
        ]
    )
    np.testing.assert_allclose(out["a"], [4.0, 5.0], rtol=1e-7)
    assert out["a"].dtype == np.float32


def test_weighted_mean_rejects_empty_and_zero_weight() -> None:
    with pytest.raises(ValueError):
        weighted_mean([])
    with pytest.raises(ValueError, match="weights"):
        weighted_mean([(0.0, {"a": np.ones(2, np.float32)})])


def test_nesterov_golden_two_steps() -> None:
    p = {"w": np.array([1.0], np.float32)}
    g = {"w": np.array([0.5], np.float32)}
    b = {"w": np.zeros(1, np.float32)}
    p1, b1 = nesterov_step(p, g, b, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(b1["w"], [0.5], rtol=1e-6)
    np.testing.assert_allclose(p1["w"], [0.335], rtol=1e-6)
    p2, b2 = nesterov_step(p1, g, b1, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(b2["w"], [0.95], rtol=1e-6)
    np.testing.assert_allclose(p2["w"], [-0.6135], rtol=1e-5)


def test_nesterov_matches_torch_sgd() -> None:
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(64).astype(np.float32)
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(5)]
    t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.SGD([t], lr=0.7, momentum=0.9, nesterov=True)
    params, buf = {"w": p0.copy()}, {"w": np.zeros(64, np.float32)}
    for g in grads:
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        params, buf = nesterov_step(params, {"w": g}, buf, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(params["w"], t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_diloco_outer_step_is_deterministic_and_order_free() -> None:
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal(100).astype(np.float32)}
    mom = {"w": rng.standard_normal(100).astype(np.float32)}
    ups = [
        (s, float(w), {"w": rng.standard_normal(100).astype(np.float32)})
        for s, w in [("eu", 3), ("us", 5), ("ap", 7)]
    ]
    s = DiLoCo()
    a = s.outer_step(params, mom, ups)
    b = s.outer_step(params, mom, list(reversed(ups)))
    assert a.params["w"].tobytes() == b.params["w"].tobytes()
    assert a.momentum["w"].tobytes() == b.momentum["w"].tobytes()
    # One site with lr 1 and no momentum: θ' = θ − Δ = that site's local parameters.
    one = DiLoCo(lr=1.0, momentum=0.0).outer_step(
        params, {"w": np.zeros(100, np.float32)}, [ups[0]]
    )
    np.testing.assert_allclose(one.params["w"], params["w"] - ups[0][2]["w"], rtol=1e-6)
    assert one.outer_grad_norm == pytest.approx(float(np.linalg.norm(ups[0][2]["w"])), rel=1e-5)


def test_diloco_outer_warmup_is_the_plain_mean_then_nesterov() -> None:
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal(50).astype(np.float32)}
    mom = {"w": rng.standard_normal(50).astype(np.float32)}
    ups = [(s, 1.0, {"w": rng.standard_normal(50).astype(np.float32)}) for s in ("a", "b")]
    mean = (ups[0][2]["w"] + ups[1][2]["w"]) / 2
    s = DiLoCo(lr=0.7, momentum=0.9, warmup_steps=100)
    for steps in (1, 100):  # up to and including the warm-up's last step
        warm = s.outer_step(params, mom, ups, inner_steps=steps)
        np.testing.assert_allclose(warm.params["w"], params["w"] - mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(warm.momentum["w"], mean, rtol=1e-6, atol=1e-7)
    nesterov = DiLoCo(lr=0.7, momentum=0.9).outer_step(params, mom, ups)
    for steps in (101, None):  # past the warm-up, or progress unknown: Nesterov
        after = s.outer_step(params, mom, ups, inner_steps=steps)
        assert after.params["w"].tobytes() == nesterov.params["w"].tobytes()
        assert after.momentum["w"].tobytes() == nesterov.momentum["w"].tobytes()
    assert not np.allclose(nesterov.params["w"], params["w"] - mean)
    # A final step (no round starts from it) is the plain mean as well.
    final = s.outer_step(params, mom, ups, inner_steps=101, final=True)
    np.testing.assert_allclose(final.params["w"], params["w"] - mean, rtol=1e-6, atol=1e-6)
    assert final.rule == "mean (final round)"
    assert warm.rule.startswith("mean (outer warm-up") and after.rule.startswith("nesterov")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        DiLoCo(warmup_steps=-1)


def test_statistics_tensors_are_averaged_never_extrapolated() -> None:
    # A BatchNorm variance stepped by Nesterov (lr 0.7, momentum 0.9 amplifies the mean step
    # 1.33x on the first round) could turn negative; named as averaged it is the plain mean.
    params = {"w": np.ones(3, np.float32), "var": np.full(3, 1.0, np.float32)}
    mom = {k: np.zeros(3, np.float32) for k in params}
    ups = [("a", 1.0, {"w": np.full(3, 0.9, np.float32), "var": np.full(3, 0.9, np.float32)})]
    out = DiLoCo(lr=0.7, momentum=0.9).outer_step(params, mom, ups, averaged={"var"})
    np.testing.assert_array_equal(out.params["var"], params["var"] - ups[0][2]["var"])
    expected_w = DiLoCo(lr=0.7, momentum=0.9).outer_step(params, mom, ups).params["w"]
    np.testing.assert_array_equal(out.params["w"], expected_w)
    assert not np.array_equal(expected_w, out.params["var"])


@pytest.mark.timeout(60)
def test_sparseloco_is_plain_sgd_on_the_mean_without_momentum() -> None:
    from coordinator.strategies.sparseloco import SparseLoCo

    params = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    buf = {"w": np.array([5.0, 5.0], dtype=np.float32)}
    updates = [
        ("b", 3.0, {"w": np.array([0.0, 4.0], dtype=np.float32)}),
        ("a", 1.0, {"w": np.array([4.0, 0.0], dtype=np.float32)}),
    ]
    out = SparseLoCo(lr=0.5).outer_step(params, buf, updates)
    np.testing.assert_allclose(out.params["w"], [1.0 - 0.5 * 1.0, 2.0 - 0.5 * 3.0], rtol=1e-6)
    np.testing.assert_array_equal(out.momentum["w"], buf["w"])  # no buffer of its own
    # Same inputs, any order: bit-identical.
    again = SparseLoCo(lr=0.5).outer_step(params, buf, updates[::-1])
    assert again.params["w"].tobytes() == out.params["w"].tobytes()


@pytest.mark.timeout(60)
def test_outer_strategy_config_names_the_field() -> None:
    from comm.security.masking import SecAggConfig
    from comm.security.rolekits import SecurityConfig
    from coordinator.config import CoordinatorConfig, sections
    from coordinator.service import _outer_strategy
    from coordinator.strategies.sparseloco import SparseLoCo

    insecure = SecurityConfig(insecure=True)
    with pytest.raises(ValueError, match="coordinator.outer_strategy"):
        CoordinatorConfig(security=insecure, outer_strategy="sparse")
    with pytest.raises(ValueError, match="outer_strategy = 'sparseloco' cannot run with"):
        CoordinatorConfig(
            security=insecure,
            outer_strategy="sparseloco",
            secure_aggregation=SecAggConfig(clip_bound=8.0),
        )
    cfg = CoordinatorConfig(security=insecure, outer_strategy="sparseloco", outer_lr=0.65)
    assert _outer_strategy(sections(cfg).outer) == SparseLoCo(lr=0.65)
    assert isinstance(_outer_strategy(sections(CoordinatorConfig(security=insecure)).outer), DiLoCo)


@pytest.mark.timeout(60)
def test_site_error_feedback_decay_is_checked() -> None:
    from comm.security.rolekits import SecurityConfig
    from site_agent.config import SiteConfig

    base = {"site_id": "eu", "coordinator": "tcp://127.0.0.1:1"}
    insecure = SecurityConfig(insecure=True)
    with pytest.raises(ValueError, match="site.error_feedback_decay"):
        SiteConfig(**base, security=insecure, error_feedback_decay=1.5)
    cfg = SiteConfig(**base, security=insecure, error_feedback_decay=0.95)
    assert cfg.error_feedback_decay == 0.95


# A strategy added the way a new one is: one class, registered by its name, declaring what it
# is compatible with. Nothing else names it, yet the config, the service and the commands take it.


@pytest.fixture
def toy_strategy() -> Iterator[type]:
    from dataclasses import dataclass
    from typing import ClassVar

    from coordinator import strategies
    from coordinator.strategies.base import OuterResult, OuterSettings, OuterStrategy

    @dataclass(frozen=True)
    class ToyMean(OuterStrategy):
        """θ ← θ − lr · mean(Δ): no momentum, so any broadcast of a dense delta suits it."""

        name: ClassVar[str] = "toymean"
        summary: ClassVar[str] = "a test's plain mean"
        why_not_other_broadcasts: ClassVar[str] = "the toy is dense"

        lr: float = 1.0

        @classmethod
        def from_settings(cls, settings: OuterSettings) -> ToyMean:
            return cls(lr=settings.lr)

        def outer_step(self, params, momentum, updates, **_: object) -> OuterResult:  # type: ignore[no-untyped-def, override]
            grad = weighted_mean([(w, t) for _, w, t in sorted(updates, key=lambda u: u[0])])
            new = {
                k: (p - np.float32(self.lr) * grad[k]).astype(np.float32) for k, p in params.items()
            }
            return OuterResult(new, dict(momentum), 0.0, "toy mean")

    strategies.register(ToyMean)
    try:
        yield ToyMean
    finally:
        strategies.unregister("toymean")


def test_a_registered_strategy_is_configured_built_and_stepped(toy_strategy: type) -> None:
    from comm.security.masking import SecAggConfig
    from comm.security.rolekits import SecurityConfig
    from coordinator import strategies
    from coordinator.config import CoordinatorConfig, sections
    from coordinator.service import _outer_strategy

    insecure = SecurityConfig(insecure=True)
    assert strategies.names() == ("diloco", "sparseloco", "toymean")
    cfg = CoordinatorConfig(security=insecure, outer_strategy="toymean", outer_lr=0.5)
    toy = _outer_strategy(sections(cfg).outer)
    assert toy == toy_strategy(lr=0.5)
    params = {"w": np.array([1.0, 2.0], np.float32)}
    updates = [
        ("b", 3.0, {"w": np.array([0.0, 4.0], np.float32)}),
        ("a", 1.0, {"w": np.array([4.0, 0.0], np.float32)}),
    ]
    out = toy.outer_step(params, {"w": np.zeros(2, np.float32)}, updates)
    np.testing.assert_allclose(out.params["w"], [1.0 - 0.5 * 1.0, 2.0 - 0.5 * 3.0], rtol=1e-6)
    # Its declarations are what the config checks: secure aggregation yes, a sparse broadcast no.
    CoordinatorConfig(
        security=insecure, outer_strategy="toymean", secure_aggregation=SecAggConfig(clip_bound=8.0)
    )
    with pytest.raises(
        ValueError,
        match=r"needs coordinator.outer_strategy = 'sparseloco' \(got 'toymean'\): the toy is dense",
    ):
        CoordinatorConfig(security=insecure, outer_strategy="toymean", broadcast="sparse")
    with pytest.raises(ValueError, match="use 'diloco' or 'toymean' or turn secure"):
        CoordinatorConfig(
            security=insecure,
            outer_strategy="sparseloco",
            secure_aggregation=SecAggConfig(clip_bound=8.0),
        )


def test_a_registered_strategy_is_offered_by_the_commands(toy_strategy: type) -> None:
    from crossdc.bench.equal_tokens_args import build_parser as equal_tokens_parser
    from crossdc.bench.wan import build_parser as wan_parser
    from crossdc.demo_args import add_demo_arguments, outer_strategy_problem

    demo = argparse.ArgumentParser()
    add_demo_arguments(demo)
    assert outer_strategy_problem(demo.parse_args(["--outer-strategy", "toymean"])) is None
    sparse = demo.parse_args(["--outer-strategy", "toymean", "--broadcast", "sparse"])
    assert outer_strategy_problem(sparse) == (
        "--broadcast sparse needs --outer-strategy sparseloco (got 'toymean'): the toy is dense"
    )
    assert wan_parser().parse_args(["--outer-strategy", "toymean"]).outer_strategy == "toymean"
    assert equal_tokens_parser("").parse_args(["--strategy", "toymean"]).strategy == "toymean"


def test_a_strategy_name_is_registered_once(toy_strategy: type) -> None:
    from coordinator import strategies

    twin = type("Twin", (toy_strategy,), {})
    with pytest.raises(ValueError, match="'toymean' is registered twice"):
        strategies.register(twin)
    assert strategies.get("toymean") is toy_strategy
    with pytest.raises(
        ValueError, match="unknown outer strategy 'nope'; known: diloco, sparseloco"
    ):
        strategies.get("nope")


def test_the_sparse_broadcast_runs_the_ordered_step_a_strategy_declares() -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    from coordinator import strategies
    from coordinator.strategies.base import OuterStrategy, as_ordered
    from coordinator.strategies.sparseloco import SparseLoCo

    sparse = SparseLoCo(lr=0.5)
    assert as_ordered(sparse) is sparse
    with pytest.raises(TypeError, match="DiLoCo does not declare the sparse broadcast"):
        as_ordered(DiLoCo())

    @dataclass(frozen=True)
    class Unordered(OuterStrategy):
        name: ClassVar[str] = "unordered"
        summary: ClassVar[str] = "declares the sparse broadcast, has no ordered step"
        broadcasts: ClassVar[frozenset[str]] = frozenset({"dense", "sparse"})

    with pytest.raises(ValueError, match="unordered declares the sparse broadcast but has no"):
        strategies.register(Unordered)
    assert "unordered" not in strategies.names()


def test_a_strategy_declaring_the_sparse_broadcast_with_a_step_of_its_own_is_refused() -> None:
    # Every site applies a sparse broadcast with comm.codecs.broadcast.sparse_step, whatever the
    # strategy: a strategy stepping otherwise would be accepted and then fail every site's state
    # hash. Registration refuses it.
    from dataclasses import dataclass
    from typing import ClassVar

    from comm.codecs.broadcast import sparse_step
    from coordinator import strategies
    from coordinator.strategies.base import (
        OuterResult,
        OuterStrategy,
        SparseBroadcastStep,
        as_ordered,
    )
    from coordinator.strategies.sparseloco import SparseLoCo

    @dataclass(frozen=True)
    class Doubled(OuterStrategy):
        name: ClassVar[str] = "doubled"
        summary: ClassVar[str] = "declares the sparse broadcast, steps twice as far"
        broadcasts: ClassVar[frozenset[str]] = frozenset({"dense", "sparse"})
        lr: float = 1.0

        def ordered_step(self, params, momentum, weighted, *, averaged=()) -> OuterResult:  # type: ignore[no-untyped-def]
            new = sparse_step(params, weighted, lr=2 * self.lr, averaged=averaged)
            return OuterResult(new, dict(momentum), 0.0, "doubled")

    @dataclass(frozen=True)
    class Overridden(SparseBroadcastStep, OuterStrategy):
        name: ClassVar[str] = "overridden"
        summary: ClassVar[str] = "derives the sites' step, then overrides it"
        broadcasts: ClassVar[frozenset[str]] = frozenset({"sparse"})
        lr: float = 1.0

        def ordered_step(self, params, momentum, weighted, *, averaged=()) -> OuterResult:  # type: ignore[no-untyped-def]
            return Doubled(self.lr).ordered_step(params, momentum, weighted, averaged=averaged)

    for cls in (Doubled, Overridden):
        with pytest.raises(
            ValueError,
            match=rf"^{cls.name} declares the sparse broadcast with an ordered_step of its own: "
            r"every site applies a sparse broadcast with comm.codecs.broadcast.sparse_step",
        ):
            strategies.register(cls)
        assert cls.name not in strategies.names()
        with pytest.raises(TypeError, match=f"{cls.__name__} does not run the step"):
            as_ordered(cls())
    # The one that runs the sites' step is taken, and its step is theirs.
    assert issubclass(SparseLoCo, SparseBroadcastStep)
    assert SparseLoCo.ordered_step is SparseBroadcastStep.ordered_step
    params = {"w": np.array([1.0, 2.0], np.float32)}
    weighted = [(1.0, {"w": np.array([0.5, 0.25], np.float32)})]
    got = SparseLoCo(lr=0.5).ordered_step(params, {"w": np.zeros(2, np.float32)}, weighted)
    np.testing.assert_array_equal(got.params["w"], sparse_step(params, weighted, lr=0.5)["w"])


def test_what_a_strategy_needs_is_checked_against_what_the_aggregation_reveals() -> None:
    from comm.security.masking import SecAggConfig
    from comm.security.rolekits import SecurityConfig
    from coordinator import strategies
    from coordinator.aggregate import SparseForward, WeightedMean
    from coordinator.config import CoordinatorConfig
    from coordinator.secure_aggregation import MaskedSumAggregator
    from coordinator.strategies.base import Revealed
    from crossdc.demo_args import add_demo_arguments, outer_strategy_problem

    # The aggregators declare what they reveal, the strategies what they need.
    assert WeightedMean.reveals is SparseForward.reveals is Revealed.EACH_UPDATE
    assert MaskedSumAggregator.reveals is Revealed.SUM
    assert strategies.get("diloco").needs is Revealed.SUM
    assert strategies.get("sparseloco").needs is Revealed.EACH_UPDATE
    assert strategies.supporting(reveals=Revealed.SUM) == ["diloco"]
    assert strategies.supporting() == ["diloco", "sparseloco"]
    assert strategies.problem("diloco", reveals=Revealed.SUM) is None
    assert strategies.problem("sparseloco", broadcast="sparse") is None
    why = (
        "it needs each update as its site encoded it (its sites send the chunk top-k of their "
        "error feedback, which must arrive sparse), and {0} reveals only the sum of the "
        "updates; use 'diloco' or turn {1} off"
    )
    assert strategies.problem("sparseloco", reveals=Revealed.SUM) == (
        "coordinator.outer_strategy = 'sparseloco' cannot run with the aggregation: "
        + why.format("the aggregation", "the aggregation")
    )
    # The config's and the demo's messages name their own keys.
    with pytest.raises(ValueError) as refused:
        CoordinatorConfig(
            security=SecurityConfig(insecure=True),
            outer_strategy="sparseloco",
            secure_aggregation=SecAggConfig(clip_bound=8.0),
        )
    assert str(refused.value) == (
        "coordinator.outer_strategy = 'sparseloco' cannot run with "
        "coordinator.secure_aggregation: "
        + why.format("coordinator.secure_aggregation", "secure aggregation")
    )
    demo = argparse.ArgumentParser()
    add_demo_arguments(demo)
    args = demo.parse_args(["--outer-strategy", "sparseloco", "--secure-aggregation"])
    assert outer_strategy_problem(args) == (
        "--outer-strategy sparseloco cannot run with --secure-aggregation: "
        + why.format("--secure-aggregation", "secure aggregation")
    )
