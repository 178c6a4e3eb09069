"""θ0 described (``coordinator.initial_model``): built at most once and only when asked; a state
directory's record of a description vouches for a state of its fingerprint, anything else is
checked in full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.initial_model import (
    RECORD,
    DescribedModel,
    InitialModel,
    check_holds,
    read_record,
    remember,
)

pytestmark = pytest.mark.timeout(30)

PARAMS = {"w": np.arange(4, dtype=np.float32)}


def _described(fingerprint: str, built: list[int], seed: int = 1) -> DescribedModel:
    def build() -> InitialModel:
        built.append(seed)
        return InitialModel(PARAMS, fingerprint)

    return DescribedModel({"seed": seed, "model": {"a": 1, "b": 2}}, build)


def test_a_description_is_built_once_and_only_when_asked() -> None:
    built: list[int] = []
    described = _described("fp", built)
    assert built == []
    assert described.built() is described.built()
    assert built == [1]


def test_the_digest_is_the_description_whatever_its_keys_order() -> None:
    a = DescribedModel({"seed": 1, "model": {"a": 1, "b": 2}}, lambda: InitialModel({}, ""))
    b = DescribedModel({"model": {"b": 2, "a": 1}, "seed": 1}, lambda: InitialModel({}, ""))
    c = DescribedModel({"seed": 2, "model": {"a": 1, "b": 2}}, lambda: InitialModel({}, ""))
    assert a.digest == b.digest != c.digest
    assert InitialModel(PARAMS, "fp").digest is None


def test_the_record_vouches_for_a_state_of_its_fingerprint_without_a_build(tmp_path: Path) -> None:
    built: list[int] = []
    remember(_described("fp", built), "fp", tmp_path)
    check_holds(_described("fp", built), "fp", tmp_path, "the state")
    assert built == []


def test_a_changed_description_is_built_and_refused_when_it_is_another_model(
    tmp_path: Path,
) -> None:
    built: list[int] = []
    remember(_described("fp", built), "fp", tmp_path)
    with pytest.raises(ValueError, match="describes model other, but the state holds model fp"):
        check_holds(_described("other", built, seed=2), "fp", tmp_path, "the state")
    assert built == [2]
    assert read_record(tmp_path) == (_described("fp", []).digest, "fp"), "record unchanged"


def test_a_full_check_that_passes_is_recorded(tmp_path: Path) -> None:
    built: list[int] = []
    check_holds(_described("fp", built, seed=3), "fp", tmp_path, "the state")  # no record yet
    assert built == [3]
    check_holds(_described("fp", built, seed=3), "fp", tmp_path, "the state")
    assert built == [3], "the second start trusts the record"


def test_a_record_of_another_fingerprint_or_unreadable_is_no_voucher(tmp_path: Path) -> None:
    built: list[int] = []
    remember(_described("fp", built), "fp", tmp_path)
    with pytest.raises(ValueError, match="holds model fp2"):
        check_holds(_described("fp", built), "fp2", tmp_path, "the state")
    (tmp_path / RECORD).write_text("{not json")
    assert read_record(tmp_path) is None
    check_holds(_described("fp", built), "fp", tmp_path, "the state")
    assert built == [1, 1]


def test_built_theta0_is_always_compared_and_never_recorded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="describes model fp, but the state holds model x"):
        check_holds(InitialModel(PARAMS, "fp"), "x", tmp_path, "the state")
    check_holds(InitialModel(PARAMS, "fp"), "fp", tmp_path, "the state")
    assert not (tmp_path / RECORD).exists()
