"""The digits job (site_agent.jobs.digits): its label-skewed split, the job contract, deterministic
initial weights, the baseline of a site trained alone, and refused options."""

from __future__ import annotations

import importlib
import io
import sys
from typing import Any

import numpy as np
import pytest
import torch

from crossdc.bench.alone import train_alone
from site_agent.jobs.contract import JobContext, JobError, build_job, federated_state
from site_agent.trainer import JobTrainer

pytest.importorskip("sklearn")

from site_agent.jobs.digits import (  # noqa: E402 (after the skip)
    FACTORY,
    load_data,
    split_indices,
    validation_indices,
)

CPU = torch.device("cpu")
torch.set_num_threads(1)  # tiny matrices: threads only contend


def context(seed: int = 0, **options: Any) -> JobContext:
    return JobContext(site_id="s", seed=seed, device=CPU, options=options)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skew", [0.0, 0.9, 1.0])
def test_split_is_disjoint_covering_and_skewed(skew: float) -> None:
    _, labels = load_data()
    val = validation_indices(labels, 0.25, seed=0)
    # Stratified: a quarter of every class, and only the split seed chooses it.
    for c in range(10):
        assert (labels[val] == c).sum() == round(0.25 * (labels == c).sum())
    assert not np.array_equal(val, validation_indices(labels, 0.25, seed=1))
    shares = [split_indices(labels, s, 3, skew, seed=0) for s in range(3)]
    union = np.concatenate([val, *shares])
    assert len(union) == len(set(union.tolist())) == len(labels)  # disjoint and covering
    assert np.array_equal(shares[1], split_indices(labels, 1, 3, skew, seed=0))
    for s, share in enumerate(shares):
        classes = set(labels[share].tolist())
        if skew == 1.0:
            assert classes == {c for c in range(10) if c % 3 == s}
        else:
            assert classes == set(range(10))
        if skew == 0.0:  # IID: every class evenly over the sites
            counts = np.bincount(labels[share], minlength=10)
            train_counts = np.bincount(labels, minlength=10) - np.bincount(
                labels[val], minlength=10
            )
            assert np.all(np.abs(counts - train_counts / 3) <= 1)


@pytest.mark.timeout(120)
def test_job_meets_the_contract_and_federates_batchnorm_statistics(tmp_path: Any) -> None:
    rng_before = torch.random.get_rng_state()
    job = build_job(FACTORY, context(site_index=1, num_sites=3))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global RNG is untouched
    assert job.architecture == {"hidden": 64}  # type: ignore[attr-defined]
    trainer = JobTrainer(job)
    first = next(iter(job.batches()))
    job.load_state_dict({"epoch": 0, "position": 0})  # type: ignore[attr-defined]
    metrics = trainer.preflight()
    assert set(metrics) == {"loss", "accuracy"} and 0.0 <= metrics["accuracy"] <= 1.0
    assert np.isfinite(metrics["loss"])
    x, y = next(iter(job.batches()))  # preflight put the cursor back
    assert torch.equal(x, first[0]) and torch.equal(y, first[1])
    assert x.shape == (32, 64) and x.dtype == torch.float32 and 0 <= x.min() <= x.max() <= 1
    assert job.weight((x, y)) == 32  # type: ignore[attr-defined]

    names = set(federated_state(job.model))
    assert {"1.running_mean", "1.running_var", "1.weight", "1.bias"} <= names
    assert "1.num_batches_tracked" in job.model.state_dict()
    assert "1.num_batches_tracked" not in names

    # A checkpoint loads with weights_only and resumes the same batches.
    trainer.train_steps(50)  # past one epoch of this 404-image share (12.6 batches)
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["job"]["epoch"] >= 1
    expected = next(iter(job.batches()))
    again = JobTrainer(build_job(FACTORY, context(site_index=1, num_sites=3)))
    again.load_state_dict(state)
    got = next(iter(again.job.batches()))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.timeout(120)
def test_same_seed_same_initial_model_at_every_site() -> None:
    jobs = [build_job(FACTORY, context(7, site_index=s, num_sites=3)) for s in (0, 2)]
    a, b = (federated_state(job.model) for job in jobs)
    assert list(a) == list(b)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert np.array_equal(jobs[0].val_indices, jobs[1].val_indices)  # type: ignore[attr-defined]
    assert not set(jobs[0].train_indices) & set(jobs[1].train_indices)  # type: ignore[attr-defined]
    other = federated_state(build_job(FACTORY, context(8, site_index=0, num_sites=3)).model)
    assert not torch.equal(a["0.weight"], other["0.weight"])


@pytest.mark.timeout(120)
def test_a_site_alone_is_bounded_by_the_classes_it_sees() -> None:
    """With skew 1 a site never sees the other sites' classes, and cross entropy only lowers their
    logits, so it is right on at most the validation images of its own classes: 180/450 = 0.40
    for site 0 (classes 0, 3, 6, 9), about 0.30 for sites 1 and 2. One model on all the data
    reaches 0.96-0.98 in the same steps (measured over seeds 0-4)."""
    _, labels = load_data()
    val_labels = labels[validation_indices(labels, 0.25, seed=0)]
    for site in range(3):
        seen = [c for c in range(10) if c % 3 == site]
        bound = float(np.isin(val_labels, seen).mean())
        assert bound <= 0.41
        alone = train_alone({"site_index": site, "num_sites": 3, "skew": 1.0}, seed=0, steps=300)
        # 0.01: four images' worth of slack, should an unseen class ever win the argmax.
        assert alone["accuracy"] <= bound + 0.01, (site, alone, bound)
        assert alone["accuracy"] >= bound - 0.05  # it does learn its own classes
    everything = train_alone({"num_sites": 1}, seed=0, steps=300)
    assert everything["accuracy"] > 0.85, everything


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"site_idx": 0}, "site_idx"),
        ({"site_index": 3, "num_sites": 3}, "site_index"),
        ({"site_index": -1, "num_sites": 3}, "site_index"),
        ({"site_index": "0", "num_sites": 3}, "site_index"),
        ({"num_sites": 0}, "num_sites"),
        ({"skew": 1.5}, "skew"),
        ({"skew": -0.1}, "skew"),
        ({"batch_size": 1}, "batch_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"lr": 0}, "lr"),
        ({"site_index": 11, "num_sites": 12, "skew": 1.0}, "site_index"),  # owns no class
    ],
)
def test_bad_options_name_the_field(options: dict[str, Any], named: str) -> None:
    with pytest.raises(JobError, match=named):
        build_job(FACTORY, context(**options))


@pytest.mark.timeout(120)
def test_without_sklearn_it_imports_and_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any import of it fails
    monkeypatch.delitem(sys.modules, "site_agent.jobs.digits")
    module = importlib.import_module("site_agent.jobs.digits")
    with pytest.raises(JobError, match=r"pip install crossdc\[sklearn\]"):
        build_job(FACTORY, context())
    assert module.load_data is not load_data
