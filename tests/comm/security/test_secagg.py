"""Secure aggregation: exact masked sums, uniform-looking single vectors, the dropout re-run rule,
the overflow guard, and the refusals that keep masks from ever being reused."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import pytest
import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comm.security.certs import make_ca_certificate, make_site_certificate, parse_ca_certificate
from comm.security.masking import (
    WEIGHT_KEY,
    Peer,
    SecAggConfig,
    encode_fixed,
    to_signed,
    x25519_from_curve_secret,
    x25519_public_bytes,
)
from comm.security.secagg import (
    MaskingPlan,
    PeerRefused,
    PeerTrust,
    SecAggSession,
    decide_attempt,
    plan_from_message,
    plan_message,
    unmask_mean,
    unmask_sum,
    unmask_sum_fixed,
)
from tests.support.secagg import (
    CFG,
    CFG32,
    Arrays,
    make_plan,
    make_sessions,
    mask_all,
    random_updates,
)


def _plain_fixed_sum(
    updates: Mapping[str, Arrays], weights: Mapping[str, float], cfg: SecAggConfig
) -> dict[str, npt.NDArray[np.int64]]:
    """The sum of each site's own fixed-point encoding, with no masks: the reference."""
    out: dict[str, npt.NDArray[np.int64]] = {}
    for site, arrays in updates.items():
        w = weights[site]
        encoded = {
            n: encode_fixed(n, np.asarray(a, np.float64) * w, cfg) for n, a in arrays.items()
        }
        encoded[WEIGHT_KEY] = encode_fixed(WEIGHT_KEY, np.array([w]), cfg)
        for name, enc in encoded.items():
            out[name] = out.get(name, 0) + to_signed(enc, cfg)
    return out


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_sites=st.integers(min_value=2, max_value=6),
    shapes=st.lists(
        st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    cfg=st.sampled_from([CFG, CFG32]),
)
def test_secure_agg_masked_sum_equals_plain_fixed_point_sum(
    num_sites: int, shapes: list[tuple[int, ...]], seed: int, cfg: SecAggConfig
) -> None:
    rng = np.random.default_rng(seed)
    sites = [f"site{i}" for i in range(num_sites)]
    updates = random_updates(rng, sites, shapes, cfg.clip_bound)
    weights = {s: float(rng.choice([1.0, rng.uniform(0, 1)])) for s in sites}
    sessions = make_sessions(sites, cfg)
    plan = make_plan(sessions)
    masked = mask_all(sessions, plan, updates, weights)
    got = unmask_sum_fixed(masked, plan, cfg)
    want = _plain_fixed_sum(updates, weights, cfg)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    # Decoded, the sum is within the rounding of the encoding of the true weighted sum.
    decoded = unmask_sum(masked, plan, cfg, dtype=np.float64)
    for name in updates[sites[0]]:
        true = sum(weights[s] * updates[s][name].astype(np.float64) for s in sites)
        np.testing.assert_allclose(
            decoded[name], true, rtol=0, atol=num_sites * 2.0**-cfg.frac_bits
        )


@pytest.mark.timeout(30)
def test_secure_agg_weighted_mean() -> None:
    rng = np.random.default_rng(7)
    sites = ["eu", "us", "ap"]
    updates = random_updates(rng, sites, [(4, 8), (3,)], 1.0)
    weights = {"eu": 0.25, "us": 1.0, "ap": 0.5}
    sessions = make_sessions(sites, CFG)
    plan = make_plan(sessions)
    mean, total = unmask_mean(mask_all(sessions, plan, updates, weights), plan, CFG)
    assert total == pytest.approx(1.75, abs=1e-9)
    for name in updates["eu"]:
        want = np.average([updates[s][name] for s in sites], axis=0, weights=list(weights.values()))
        np.testing.assert_allclose(mean[name], want, atol=1e-6)
    zero = {s: 0.0 for s in sites}
    sessions = make_sessions(sites, CFG)
    plan = make_plan(sessions, round_id=2)
    with pytest.raises(ValueError, match="total weight"):
        unmask_mean(mask_all(sessions, plan, updates, zero), plan, CFG)


def _bit_frequencies(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    bits = np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1)
    freq: npt.NDArray[np.float64] = bits.mean(axis=0)
    return freq


@pytest.mark.timeout(30)
def test_secure_agg_single_masked_vector_looks_uniform() -> None:
    """One masked vector (or the sum of any proper subset) tells the coordinator nothing: it is
    indistinguishable from uniform words, and unrelated to the plain encoding, even for an
    all-zero update."""
    n = 1 << 14
    sites = ["a", "b", "c"]
    updates = {s: {"w": np.zeros(n, np.float32)} for s in sites}
    updates["b"]["w"][:] = 0.5
    sessions = make_sessions(sites, CFG)
    plan = make_plan(sessions)
    masked = mask_all(sessions, plan, updates)
    plain_b = encode_fixed("w", updates["b"]["w"], CFG)
    subset = masked["a"]["w"] + masked["b"]["w"]  # two of three: still masked by c's pairs
    for words in (masked["a"]["w"], masked["b"]["w"], subset):
        assert words.dtype == np.uint64
        freq = _bit_frequencies(words)
        # Each of the 64 bit positions is 1 with probability 1/2: 6 standard deviations.
        assert np.all(np.abs(freq - 0.5) < 6 * np.sqrt(0.25 / n)), freq
        assert np.mean(words == plain_b) < 1e-3
        assert len(np.unique(words)) > n - 2
    # The plain encoding is far from uniform (the test above can fail).
    assert np.any(np.abs(_bit_frequencies(plain_b) - 0.5) > 0.4)


@pytest.mark.timeout(30)
def test_secure_agg_dropout_rerun_yields_survivors_exact_sum() -> None:
    rng = np.random.default_rng(3)
    sites = ["a", "b", "c", "d"]
    updates = random_updates(rng, sites, [(16,), (2, 3)], 2.0)
    sessions = make_sessions(sites, CFG)
    plan = make_plan(sessions, round_id=5)
    first = mask_all(sessions, plan, updates)
    late_d = first.pop("d")  # d masked, then dropped before delivering
    # Unmasking without d is refused, and forcing it would give garbage (d's masks remain).
    with pytest.raises(ValueError, match="do not match the masking set"):
        unmask_sum_fixed(first, plan, CFG)
    survivors_plan = MaskingPlan(
        round_id=5, attempt=0, participants={s: plan.participants[s] for s in first}
    )
    forced = unmask_sum_fixed(first, survivors_plan, CFG)
    ones = {s: 1.0 for s in first}
    want = _plain_fixed_sum({s: updates[s] for s in first}, ones, CFG)
    assert not np.array_equal(forced["layers.0.weight"], want["layers.0.weight"])

    decision, reason = decide_attempt(plan, received=set(first), config=CFG)
    assert decision.action == "rerun" and "['d']" in reason
    assert decision.plan is not None
    rerun = decision.plan
    assert rerun.attempt == 1 and set(rerun.participants) == {"a", "b", "c"}
    second = mask_all(sessions, rerun, updates)
    assert decide_attempt(rerun, received=set(second), config=CFG)[0].action == "unmask"
    got = unmask_sum_fixed(second, rerun, CFG)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    # The dropped site's late vector belongs to the abandoned attempt and is refused.
    with pytest.raises(ValueError, match="masking set"):
        unmask_sum_fixed({**second, "d": late_d}, rerun, CFG)
    # Fresh masks per attempt: no survivor's two vectors share a mask.
    assert not np.any(first["a"]["layers.0.weight"] == second["a"]["layers.0.weight"])


@pytest.mark.timeout(30)
def test_secure_agg_dropout_rule_terminates() -> None:
    sessions = make_sessions(["a", "b", "c"], CFG)
    plan = make_plan(sessions)
    decision, reason = decide_attempt(plan, received={"a"}, config=CFG)
    assert decision.action == "abandon" and decision.plan is None and "min_sites" in reason
    last = MaskingPlan(round_id=1, attempt=CFG.max_attempts - 1, participants=plan.participants)
    decision, reason = decide_attempt(last, received={"a", "b"}, config=CFG)
    assert decision.action == "abandon" and "last allowed attempt" in reason
    # Each re-run strictly shrinks the set and attempts are capped: the chain is finite.
    current: MaskingPlan | None = plan
    steps = 0
    while current is not None and steps < 10:
        decision, _ = decide_attempt(current, received=sorted(current.participants)[1:], config=CFG)
        current = decision.plan if decision.action == "rerun" else None
        steps += 1
    assert steps <= CFG.max_attempts


@pytest.mark.timeout(30)
def test_secure_agg_overflow_guard_raises() -> None:
    sessions = make_sessions(["a", "b"], CFG)
    plan = make_plan(sessions)
    a = sessions["a"]
    too_big = {"w": np.array([0.0, CFG.clip_bound * 1.001], np.float32)}
    with pytest.raises(ValueError, match="clip_bound"):
        a.mask(too_big, round_id=1, participants=plan.participants)
    with pytest.raises(ValueError, match="NaN or Inf"):
        a.mask({"w": np.array([np.inf])}, round_id=1, participants=plan.participants)
    with pytest.raises(ValueError, match="weight"):
        a.mask({"w": np.zeros(2)}, round_id=1, participants=plan.participants, weight=1.5)
    with pytest.raises(ValueError, match="reserved"):
        a.mask({WEIGHT_KEY: np.zeros(2)}, round_id=1, participants=plan.participants)
    # Refused inputs record nothing: the same round can still be masked.
    a.mask({"w": np.zeros(2)}, round_id=1, participants=plan.participants)
    # A config whose worst-case sum could wrap is refused up front, naming the field.
    with pytest.raises(ValueError, match="secagg.clip_bound"):
        SecAggConfig(clip_bound=2.0**31, max_sites=2)
    with pytest.raises(ValueError, match="secagg.clip_bound"):
        SecAggConfig(clip_bound=1.0, frac_bits=28, word_bits=32, max_sites=16)
    with pytest.raises(ValueError, match="secagg.word_bits"):
        SecAggConfig(clip_bound=1.0, word_bits=16)
    # At the bound the worst case sums exactly without wrapping.
    cfg = SecAggConfig(clip_bound=1.0, frac_bits=26, word_bits=32, max_sites=16)
    worst = np.full(4, -1.0)
    total = sum(to_signed(encode_fixed("w", worst, cfg), cfg) for _ in range(cfg.max_sites))
    assert np.all(total == -cfg.max_sites * 2**26)


@pytest.mark.timeout(30)
def test_secure_agg_site_refuses_unsafe_plans() -> None:
    sessions = make_sessions(["a", "b", "c"], CFG)
    plan = make_plan(sessions)
    a = sessions["a"]
    x = {"w": np.zeros(3)}
    with pytest.raises(ValueError, match="not in the masking set"):
        a.mask(x, round_id=1, participants={s: plan.participants[s] for s in "bc"})
    with pytest.raises(ValueError, match="outside"):
        a.mask(x, round_id=1, participants={"a": plan.participants["a"]})
    with pytest.raises(ValueError, match="other keys"):
        a.mask(x, round_id=1, participants={**plan.participants, "a": sessions["b"].peer()})
    with pytest.raises(ValueError, match="does not follow"):
        a.mask(x, round_id=1, attempt=1, participants=plan.participants)
    a.mask(x, round_id=1, participants=plan.participants)
    with pytest.raises(ValueError, match="never reused"):
        a.mask(x, round_id=1, participants=plan.participants)
    with pytest.raises(ValueError, match="survivors"):  # not a strict subset
        a.mask(x, round_id=1, attempt=1, participants=plan.participants)
    swapped = {
        "a": plan.participants["a"],
        "b": SecAggSession(site_id="b", session_id="sess-1", config=CFG).peer(),
    }
    with pytest.raises(ValueError, match="survivors"):  # a key changed between attempts
        a.mask(x, round_id=1, attempt=1, participants=swapped)
    a.mask(x, round_id=1, attempt=1, participants={s: plan.participants[s] for s in "ab"})
    a.mask(x, round_id=2, participants=plan.participants)  # a new round starts over


@pytest.mark.timeout(30)
def test_secure_agg_curve_keys_are_x25519_keys() -> None:
    public, secret = zmq.curve_keypair()
    key = x25519_from_curve_secret(secret)
    import zmq.utils.z85 as z85

    assert x25519_public_bytes(key) == z85.decode(public)


NOW = 1_700_000_000.0


def _certified(site_ids: list[str]) -> dict[str, PeerTrust]:
    """Each site's certified identity under one CA, as its kit would give it."""
    ca_key = Ed25519PrivateKey.generate()
    validity = {"not_before": int(NOW) - 60, "not_after": int(NOW) + 86400}
    ca = parse_ca_certificate(make_ca_certificate(ca_key, serial="1", **validity))
    trusts = {}
    for i, site in enumerate(site_ids):
        public, secret = zmq.curve_keypair()
        cert = make_site_certificate(
            ca_key, site_id=site, curve_public=public, serial=f"{i + 2:x}", **validity
        )
        trusts[site] = PeerTrust(
            static_key=x25519_from_curve_secret(secret),
            certificate=cert.to_pem(),
            cas=lambda: (ca,),
            wall_clock=lambda: NOW,
        )
    return trusts


@pytest.mark.timeout(30)
def test_secure_agg_certified_plan_on_the_wire_gives_the_exact_sum() -> None:
    """With certificates, every site verifies its peers from the relayed plan and the masked
    sum is still the exact fixed-point sum."""
    sites = ["eu", "us", "ap"]
    trusts = _certified(sites)
    sessions = {
        s: SecAggSession(site_id=s, session_id="sess-1", config=CFG, trust=trusts[s]) for s in sites
    }
    attempt, relayed = plan_from_message(plan_message(make_plan(sessions)))
    plan = MaskingPlan(round_id=1, attempt=attempt, participants=relayed)
    rng = np.random.default_rng(3)
    updates = random_updates(rng, sites, [(3, 4)], 1.0)
    masked = mask_all(sessions, plan, updates)
    ones = dict.fromkeys(sites, 1.0)
    got = unmask_sum_fixed(masked, plan, CFG)
    for name, want in _plain_fixed_sum(updates, ones, CFG).items():
        np.testing.assert_array_equal(got[name], want)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("certified", [False, True])
def test_secure_agg_static_keys_defeat_key_substitution(certified: bool) -> None:
    """A coordinator that relays its own session key in place of site b's learns a's update
    when pair keys use session keys alone; not when they also use the certified static keys,
    even though it relays b's genuine certificate (which a verifies) and masks as well as it
    can with a key and certificate of its own."""
    x_a = {"w": np.linspace(-1, 1, 32)}
    trusts = _certified(["a", "b"])
    own = _certified(["b"])["b"]  # the attacker holds no CURVE secret of b's
    attacker_trust = PeerTrust(
        static_key=own.static_key,
        certificate=own.certificate,
        cas=trusts["a"].cas,  # it may verify a's certificate too
        wall_clock=lambda: NOW,
    )
    a = SecAggSession(
        site_id="a", session_id="sess-1", config=CFG, trust=trusts["a"] if certified else None
    )
    attacker = SecAggSession(
        site_id="b", session_id="sess-1", config=CFG, trust=attacker_trust if certified else None
    )
    fake_b = Peer(
        session_public=attacker.session_public,
        certificate=trusts["b"].certificate if certified else None,  # b's genuine one
    )
    participants = {"a": a.peer(), "b": fake_b}
    masked_a = a.mask(x_a, round_id=1, participants=participants)
    masked_b = attacker.mask(
        {"w": np.zeros(32)}, round_id=1, participants={"a": a.peer(), "b": attacker.peer()}
    )
    plan = MaskingPlan(round_id=1, attempt=0, participants=participants)
    recovered = unmask_sum(dict(a=masked_a, b=masked_b), plan, CFG, dtype=np.float64)["w"]
    leaked = bool(np.allclose(recovered, x_a["w"], atol=1e-6))
    assert leaked is (not certified)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "session_public",
    [bytes(32), (1).to_bytes(32, "little"), (2**255 - 19).to_bytes(32, "little"), bytes(31)],
    ids=["all_zero", "order_4", "non_canonical_zero", "31_bytes"],
)
def test_a_peer_with_an_unusable_session_key_is_refused_by_name(session_public: bytes) -> None:
    """A relayed session key no pair can mask with is refused naming the peer, before any
    exchange, and nothing is recorded: the site can still mask that round with a good plan."""
    sessions = make_sessions(["a", "b", "c"], CFG)
    good = make_plan(sessions).participants
    bad = {**good, "c": Peer(session_public=session_public)}
    with pytest.raises(PeerRefused, match="peer 'c'") as refused:
        sessions["a"].mask({"w": np.zeros(3)}, round_id=1, participants=bad)
    assert refused.value.site_id == "c"
    sessions["a"].mask({"w": np.zeros(3)}, round_id=1, participants=good)
