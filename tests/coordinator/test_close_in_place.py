"""A close steps tensor by tensor in place (coordinator.aggregate.outer_step): the same params,
momentum, residual and broadcast bytes as the whole-model step, the old state's arrays
overwritten only after ``prepare``; a step failing after that gets the durable state back
(GlobalModel.changing); θ0 is kept where it arrived (coordinator.intake.received_model)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import pytest

from comm.codecs.registry import get_codec
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import ErrorCode, InitParams
from comm.wire.tensors import encode_tensors
from coordinator.aggregate import HeldMean, MeanFold, outer_step, whole_model_step
from coordinator.global_model import GlobalModel
from coordinator.intake import received_model
from coordinator.state import GlobalState, MemoryStateStore
from coordinator.strategies.diloco import DiLoCo
from coordinator.strategies.sparseloco import SparseLoCo

SHAPES = {"emb.w": (64, 24), "norm.var": (24,), "head.w": (24, 10), "head.b": (10,)}
DOWNLINKS = ("fp32", "int8", "int4")


def _arrays(seed: int, scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _state() -> GlobalState:
    return GlobalState(
        params=_arrays(0, 1.0),
        momentum=_arrays(1, 0.01),
        residual=_arrays(2, 0.001),
        global_version=3,
        round_counter=3,
        model_fingerprint="f",
    )


def _updates() -> list[tuple[str, float, Mapping[str, np.ndarray]]]:
    """A round's mean of two updates and a late round's of one, each folded when read."""
    codec = get_codec("fp32")
    on_time, late = MeanFold(1e9, ["eu", "us"]), MeanFold(1e9)
    for site, seed, weight in (("us", 11, 5.0), ("eu", 10, 3.0)):
        assert isinstance(
            on_time.add(site, weight, encode_tensors(_arrays(seed, 0.01), codec), SHAPES), str
        )
    assert isinstance(late.add("ap", 2.0, encode_tensors(_arrays(12, 0.01), codec), SHAPES), str)
    return [("round 4", on_time.weight, on_time.mean()), ("late@3", 1.0, late.mean())]


class _WholeModelsOnly:
    """DiLoCo's step without its tensor_step: the whole-model path."""

    def __init__(self, inner: DiLoCo | SparseLoCo) -> None:
        self._inner = inner

    def outer_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._inner.outer_step(*args, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("downlink", DOWNLINKS)
@pytest.mark.parametrize("strategy", [DiLoCo(lr=0.7, momentum=0.9), SparseLoCo(lr=0.5)])
def test_the_step_in_place_is_the_whole_model_step_bit_for_bit(
    downlink: str, strategy: DiLoCo | SparseLoCo
) -> None:
    names = list(SHAPES)
    kw = {"downlink": downlink, "inner_steps": 40, "final": False, "averaged": {"norm.var"}}
    st = _state()
    reference = whole_model_step(
        _WholeModelsOnly(strategy), copy.deepcopy(st), names, _updates(), **kw
    )
    calls: list[dict[str, bytes]] = []
    before = {k: v.tobytes() for k, v in st.params.items()}

    def prepare() -> None:  # nothing has changed yet
        calls.append({k: v.tobytes() for k, v in st.params.items()})

    updates = _updates()
    step = outer_step(strategy, st, names, updates, prepare=prepare, **kw)
    assert calls == [before]
    # Each mean folded each tensor once: the step reads a tensor of an update once.
    assert [m.folded for _, _, m in updates if isinstance(m, HeldMean)] == [len(names)] * 2
    for kind in ("params", "momentum", "residual"):
        got, want = getattr(step.state, kind), getattr(reference.state, kind)
        for k in names:
            assert got[k].tobytes() == want[k].tobytes(), (kind, k)
            assert got[k] is getattr(st, kind)[k]  # the old state's arrays, overwritten
    assert [e.name for e in step.encoded] == names
    for mine, theirs in zip(step.encoded, reference.encoded, strict=True):
        assert mine.codec == theirs.codec and mine.meta == theirs.meta
        assert [bytes(b) for b in mine.buffers] == [bytes(b) for b in theirs.buffers]
    assert (step.rule, step.outer_grad_norm) == (reference.rule, reference.outer_grad_norm)
    assert step.numel == reference.numel == sum(int(np.prod(s)) for s in SHAPES.values())


@pytest.mark.timeout(60)
def test_a_step_refused_before_prepare_changes_nothing() -> None:
    st = _state()
    before = copy.deepcopy(st)
    prepared: list[bool] = []
    missing = [("round 4", 1.0, {k: v for k, v in _arrays(10, 0.01).items() if k != "head.b"})]
    with pytest.raises(ValueError, match="has no tensor 'head.b'"):
        outer_step(
            DiLoCo(),
            st,
            list(SHAPES),
            missing,
            downlink="int4",
            inner_steps=1,
            final=False,
            averaged=(),
            prepare=lambda: prepared.append(True),
        )
    with pytest.raises(ValueError, match="unknown"):
        outer_step(
            DiLoCo(),
            st,
            list(SHAPES),
            _updates(),
            downlink="nosuchcodec",
            inner_steps=1,
            final=False,
            averaged=(),
            prepare=lambda: prepared.append(True),
        )
    assert not prepared
    for kind in ("params", "momentum", "residual"):
        for k in SHAPES:
            assert getattr(st, kind)[k].tobytes() == getattr(before, kind)[k].tobytes()


def _model(store: MemoryStateStore, drained: list[str]) -> GlobalModel:
    def persist(state: GlobalState, counter_only: bool) -> None:
        if counter_only:
            store.save_counter(state)
        else:
            store.save(state)

    return GlobalModel(
        num_fragments=1,
        deltas_dir=None,
        signing_key=None,
        persist=persist,
        later=lambda action: action(),
        drain=lambda: drained.append("drained"),
        reload=store.load,
    )


@pytest.mark.timeout(60)
def test_a_step_failing_after_prepare_gets_the_durable_state_back() -> None:
    store, drained = MemoryStateStore(), []
    model = _model(store, drained)
    model.install(_arrays(0, 1.0), "f")
    st = model.state
    assert st is not None
    durable = {k: v.tobytes() for k, v in st.params.items()}
    with pytest.raises(RuntimeError, match="half way"), model.changing() as prepare:
        prepare()
        st.params["emb.w"][:] = 7.0  # half changed, then the step fails
        raise RuntimeError("half way")
    assert drained == ["drained"]
    assert model.state is not None and model.state is not st
    assert {k: v.tobytes() for k, v in model.state.params.items()} == durable
    # A step refused before prepare keeps the state as it is (nothing was changed).
    kept = model.state
    with pytest.raises(ValueError), model.changing():
        raise ValueError("refused")
    assert model.state is kept and drained == ["drained"]


@pytest.mark.timeout(60)
def test_theta0_is_kept_where_it_arrived() -> None:
    params = _arrays(0, 1.0)
    msg = InitParams(
        site_id="eu",
        model_fingerprint="f",
        payload=encode_tensors(params, get_codec("fp32")),
    )
    # Off the wire, reassembled into one writable buffer as a chunked message is.
    frames = [bytearray(bytes(f)) for f in to_wire(msg, session="s", seq=1)]
    received = from_wire(frames)
    assert isinstance(received, InitParams)
    got = received_model(received.payload)
    for k, v in params.items():
        assert got[k].tobytes() == v.tobytes() and got[k].shape == v.shape
        assert np.shares_memory(
            got[k], received.payload[[e.name for e in received.payload].index(k)].buffers[0]
        )
    store, drained = MemoryStateStore(), []
    model = _model(store, drained)
    state = model.install(got, "f", owned=True)
    assert all(state.params[k] is got[k] for k in params)
    # Read-only bytes are copied; a non-finite value is refused, naming the tensor.
    copied = received_model(msg.payload)
    assert all(not np.shares_memory(copied[k], params[k]) for k in params)
    payload = encode_tensors(params, get_codec("fp32"))
    payload[-1].buffers[0][3] = np.nan  # what a site's encoder would refuse to send
    bad = InitParams(site_id="eu", model_fingerprint="f", payload=payload)
    frames = [bytearray(bytes(f)) for f in to_wire(bad, session="s", seq=2)]
    received = from_wire(frames)
    assert isinstance(received, InitParams)
    with pytest.raises(WireError) as err:
        received_model(received.payload)
    assert err.value.code == ErrorCode.NON_FINITE and "head.b" in err.value.detail
