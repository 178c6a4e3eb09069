"""Corpora: the stdlib split, text directories, batch sampling and its resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from site_agent.jobs.bytegpt.data import (
    FILE_SEPARATOR,
    BatchSampler,
    ByteCorpus,
    balanced_split,
    eval_batches,
    is_heldout,
    stdlib_modules,
    stdlib_split,
)


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    _write(root / "abc.py", "a = 1\n")
    _write(root / "zlibby.py", "z = 2\n")
    _write(root / "_sysconfigdata__linux.py", "build_time_vars = {}\n")
    _write(root / "README.txt", "not python\n")
    _write(root / "email" / "__init__.py", "")
    _write(root / "email" / "parser.py", "p = 3\n")
    _write(root / "email" / "mime" / "text.py", "t = 4\n")
    _write(root / "email" / "__pycache__" / "parser.py", "cached\n")
    _write(root / "email" / "tests" / "test_x.py", "bad\n")
    _write(root / "lib2to3" / "fixer.py", "f = 5\n")
    _write(root / "lib2to3" / "tests" / "data" / "bom.py", "broken(\n")
    _write(root / "site-packages" / "numpy" / "x.py", "third party\n")
    _write(root / "test" / "test_os.py", "suite\n")
    _write(root / "idlelib" / "editor.py", "idle\n")
    _write(root / "lib-dynload" / "x.so", b"\x7fELF")
    _write(root / "noscripts" / "data.txt", "no python here\n")
    return root


def test_stdlib_modules_skips_tests_and_third_party(fake_stdlib: Path) -> None:
    modules = stdlib_modules(fake_stdlib)
    assert list(modules) == ["abc", "email", "lib2to3", "zlibby"]
    email = [p.relative_to(fake_stdlib).as_posix() for p in modules["email"]]
    assert email == ["email/__init__.py", "email/mime/text.py", "email/parser.py"]
    assert [p.name for p in modules["lib2to3"]] == ["fixer.py"]


def test_real_stdlib_has_modules_and_no_tests() -> None:
    modules = stdlib_modules()
    assert {"argparse", "json", "email", "asyncio"} <= set(modules)
    assert not {"test", "idlelib", "site-packages", "__pycache__"} & set(modules)
    for files in modules.values():
        for path in files:
            assert path.suffix == ".py"
            assert not {"test", "tests", "__pycache__", "idle_test"} & set(path.parts)


def test_heldout_is_a_stable_tenth() -> None:
    # Golden values: the hash must not depend on the process (unlike hash()).
    names = [f"module_{i}" for i in range(2000)]
    fraction = sum(is_heldout(n) for n in names) / len(names)
    assert 0.07 < fraction < 0.13
    assert [n for n in names[:60] if is_heldout(n)] == [
        "module_4", "module_9", "module_19", "module_23", "module_26",
        "module_31", "module_33", "module_44", "module_46", "module_56",
    ]  # fmt: skip
    assert [n for n in ["ast", "json", "os", "collections", "http"] if is_heldout(n)] == [
        "ast",
        "collections",
        "http",
    ]


def test_stdlib_split_is_disjoint_deterministic_and_balanced() -> None:
    num_shards = 4
    shards, heldout = stdlib_split(num_shards)
    assert (shards, heldout) == stdlib_split(num_shards)
    assert len(shards) == num_shards
    all_modules = stdlib_modules()
    seen: set[str] = set()
    for shard in shards:
        assert shard, "no shard may be empty"
        assert not seen & set(shard)
        seen |= set(shard)
    assert not seen & set(heldout)
    assert seen | set(heldout) == set(all_modules)
    assert heldout == sorted(heldout) and all(is_heldout(n) for n in heldout)
    assert 0.03 * len(all_modules) < len(heldout) < 0.2 * len(all_modules)

    def size(name: str) -> int:
        return sum(p.stat().st_size for p in all_modules[name])

    totals = [sum(size(n) for n in shard) for shard in shards]
    largest_module = max(size(n) for n in seen)
    # The guarantee of the greedy split: the spread is at most one (the largest) module.
    assert max(totals) - min(totals) <= largest_module
    assert max(totals) < 1.5 * min(totals)


def test_balanced_split_golden() -> None:
    sizes = {"a": 10, "b": 7, "c": 5, "d": 5, "e": 1}
    # a->0, b->1, c->1 (7<10), d->0 (10<12), e->1 (12<15)
    assert balanced_split(sizes, 2) == [["a", "d"], ["b", "c", "e"]]
    assert balanced_split(sizes, 1) == [["a", "b", "c", "d", "e"]]


def test_split_rejects_bad_shard_counts(fake_stdlib: Path) -> None:
    with pytest.raises(ValueError, match="num_shards"):
        stdlib_split(0)
    with pytest.raises(ValueError, match="exceeds the number of modules"):
        stdlib_split(100, root=fake_stdlib)


def test_corpus_from_stdlib_modules_joins_files(fake_stdlib: Path) -> None:
    corpus = ByteCorpus.from_stdlib_modules(["zlibby", "email"], root=fake_stdlib)
    expected = FILE_SEPARATOR.join([b"z = 2\n", b"", b"t = 4\n", b"p = 3\n"])
    assert corpus.data.dtype == np.uint8
    assert corpus.data.tobytes() == expected
    cut = ByteCorpus.from_stdlib_modules(["zlibby", "email"], max_bytes=9, root=fake_stdlib)
    assert cut.data.tobytes() == expected[:9]
    with pytest.raises(ValueError, match="unknown stdlib module"):
        ByteCorpus.from_stdlib_modules(["nope"], root=fake_stdlib)


def test_corpus_from_real_stdlib_slice() -> None:
    corpus = ByteCorpus.from_stdlib_modules(["textwrap"], max_bytes=4096)
    assert len(corpus) == 4096
    assert b"import " in corpus.data.tobytes()


def test_from_text_dir_reads_utf8_files_in_sorted_order(tmp_path: Path) -> None:
    _write(tmp_path / "b.txt", "second")
    _write(tmp_path / "a" / "z.md", "first é")
    _write(tmp_path / "blob.bin", b"\xff\xfe\x00\x81")
    _write(tmp_path / "empty.txt", "")
    _write(tmp_path / ".git" / "config", "hidden")
    corpus = ByteCorpus.from_text_dir(tmp_path)
    assert corpus.data.tobytes() == "first é".encode() + FILE_SEPARATOR + b"second"
    assert ByteCorpus.from_text_dir(str(tmp_path), max_bytes=3).data.tobytes() == b"fir"


def test_from_text_dir_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="missing.*does not exist"):
        ByteCorpus.from_text_dir(missing)
    _write(tmp_path / "binary" / "x.bin", b"\xff\xff\xff")
    with pytest.raises(ValueError, match="binary.*no non-empty UTF-8 text"):
        ByteCorpus.from_text_dir(tmp_path / "binary")


def _corpus(num_bytes: int = 1000) -> ByteCorpus:
    return ByteCorpus(np.arange(num_bytes, dtype=np.int64).astype(np.uint8), source="test")


def test_sampler_shapes_and_shift() -> None:
    sampler = BatchSampler(_corpus(), batch_size=4, context_len=8, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 8)
    assert x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    # The corpus counts up mod 256, so every target is its input plus one.
    assert torch.equal((x + 1) % 256, y)


def test_sampler_covers_the_last_byte() -> None:
    corpus = _corpus(10)
    sampler = BatchSampler(corpus, batch_size=64, context_len=9, seed=0)
    x, y = sampler.next_batch()
    assert torch.equal(y, torch.arange(1, 10).expand(64, 9))


def test_sampler_resume_continues_the_same_batches() -> None:
    sampler = BatchSampler(_corpus(), batch_size=3, context_len=16, seed=5)
    for _ in range(4):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [sampler.next_batch() for _ in range(3)]

    restarted = BatchSampler(_corpus(), batch_size=3, context_len=16, seed=999)
    restarted.load_state_dict(state)
    assert restarted.step == 4
    for want, got in zip(expected, [restarted.next_batch() for _ in range(3)], strict=True):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_sampler_rejects_state_of_another_shape() -> None:
    state = BatchSampler(_corpus(), batch_size=3, context_len=16, seed=0).state_dict()
    other = BatchSampler(_corpus(), batch_size=4, context_len=16, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)


def test_short_corpus_is_rejected() -> None:
    with pytest.raises(ValueError, match="fewer than context_len"):
        BatchSampler(_corpus(16), batch_size=2, context_len=16, seed=0)
    with pytest.raises(ValueError, match="fewer than context_len"):
        eval_batches(_corpus(8), num_batches=1, batch_size=1, context_len=8)


def test_eval_batches_are_fixed() -> None:
    a = eval_batches(_corpus(), num_batches=3, batch_size=2, context_len=8, seed=1)
    b = eval_batches(_corpus(), num_batches=3, batch_size=2, context_len=8, seed=1)
    c = eval_batches(_corpus(), num_batches=3, batch_size=2, context_len=8, seed=2)
    assert len(a) == 3
    assert all(
        torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True)
    )
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c, strict=True))
