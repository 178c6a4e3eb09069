"""A site's training text: corpora, the split of the embedded default corpus, and batch sampling.

The embedded default corpus is the Python standard library's own source tree, present on every
machine, so a federation runs on real, non-IID text without downloading anything. Its unit is a
top-level module (a ``*.py`` file or a package directory); whole modules go to one site, and a
fixed ~10% of modules, chosen by a stable hash of the name, are held out for validation.

Users point a site at their own directory of text files instead (``ByteCorpus.from_text_dir``).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FILE_SEPARATOR = b"\n\n"

# Directories under the stdlib root that are not library source a model should learn from
# (third-party code, the interpreter's own test suite, test data, build configuration).
_SKIPPED_TOP_LEVEL = frozenset({"site-packages", "dist-packages", "lib-dynload", "test", "tests"})
# Directory names skipped at any depth inside a package (e.g. ``lib2to3/tests``, ``ctypes/test``,
# ``idlelib/idle_test``).
_SKIPPED_DIRS = frozenset({"__pycache__", "test", "tests", "idle_test", "testdata", "idlelib"})

HELDOUT_MODULUS = 10


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where a site's training and validation text comes from."""

    source: str = "stdlib"
    """``stdlib`` (the embedded default corpus) or ``dir`` (a directory of text files)."""
    path: str = ""
    """For ``dir``: the directory of training text."""
    val_path: str = ""
    """For ``dir``: a directory of validation text; empty holds out the tail of ``path``."""
    shard_index: int = 0
    """For ``stdlib``: which of ``num_shards`` disjoint module sets this site trains on."""
    num_shards: int = 1
    """For ``stdlib``: how many sites split the standard library."""
    max_bytes: int = 0
    """Cap on training bytes loaded (0: no cap)."""
    val_fraction: float = 0.05
    """For ``dir`` without ``val_path``: the fraction of bytes held out at the end."""

    def __post_init__(self) -> None:
        if self.source not in ("stdlib", "dir"):
            raise ValueError(f"site.data.source must be 'stdlib' or 'dir', got {self.source!r}")
        if self.source == "dir" and not self.path:
            raise ValueError("site.data.path is required when site.data.source = 'dir'")
        if self.num_shards < 1:
            raise ValueError(f"site.data.num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"site.data.shard_index must be in [0, {self.num_shards}), got {self.shard_index}"
            )
        if self.max_bytes < 0:
            raise ValueError("site.data.max_bytes must be >= 0")
        if not 0 < self.val_fraction < 1:
            raise ValueError("site.data.val_fraction must be in (0, 1)")


@dataclass
class SiteData:
    """A site's training corpus and its validation corpus (never trained on)."""

    train: ByteCorpus
    val: ByteCorpus


def load_corpora(d: DataConfig) -> SiteData:
    """The training and validation corpora ``d`` describes."""
    max_bytes = d.max_bytes or None
    if d.source == "stdlib":
        shards, heldout = stdlib_split(d.num_shards)
        train = ByteCorpus.from_stdlib_modules(shards[d.shard_index], max_bytes)
        val = ByteCorpus.from_stdlib_modules(heldout, 4 << 20)
        return SiteData(train, val)
    corpus = ByteCorpus.from_text_dir(d.path, max_bytes)
    if d.val_path:
        return SiteData(corpus, ByteCorpus.from_text_dir(d.val_path, 4 << 20))
    cut = int(len(corpus) * (1 - d.val_fraction))
    return SiteData(
        ByteCorpus(corpus.data[:cut], source=f"{corpus.source}[:{cut}]"),
        ByteCorpus(corpus.data[cut:], source=f"{corpus.source}[{cut}:]"),
    )


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_skipped_dir(name: str) -> bool:
    return name in _SKIPPED_DIRS or name.startswith((".", "test_", "config-"))


def _package_files(package_dir: Path) -> list[Path]:
    files: list[Path] = []
    for path in package_dir.rglob("*.py"):
        relative = path.relative_to(package_dir)
        if any(_is_skipped_dir(part) for part in relative.parts[:-1]):
            continue
        if path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(package_dir).as_posix())


def stdlib_modules(root: Path | None = None) -> dict[str, list[Path]]:
    """Top-level stdlib modules by name, each with its source files, sorted by name then path.

    A module is a top-level ``*.py`` file or a top-level package directory (all ``*.py`` below it,
    test directories excluded). The machine-generated ``_sysconfigdata_*`` files are left out: they
    differ between machines and carry no code worth learning.
    """
    root = stdlib_root() if root is None else root
    modules: dict[str, list[Path]] = {}
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name in _SKIPPED_TOP_LEVEL or _is_skipped_dir(entry.name):
            continue
        if entry.is_file() and entry.suffix == ".py":
            if entry.name.startswith("_sysconfigdata_"):
                continue
            modules[entry.stem] = [entry]
        elif entry.is_dir():
            files = _package_files(entry)
            if files:
                modules[entry.name] = files
    return modules


def is_heldout(module_name: str) -> bool:
    """Whether a module belongs to the validation set: stable across machines and Python runs."""
    digest = hashlib.blake2b(module_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0


def balanced_split(sizes: Mapping[str, int], num_shards: int) -> list[list[str]]:
    """Whole items into ``num_shards`` disjoint shards of about equal total size.

    Greedy longest-processing-time: items by size descending (then name), each to the shard with
    the fewest bytes so far (lowest index on ties). The largest and smallest shard then differ by
    at most the largest item. Each shard's names are returned sorted.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards > len(sizes):
        raise ValueError(f"num_shards={num_shards} exceeds the number of modules ({len(sizes)})")
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    totals = [0] * num_shards
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(num_shards), key=lambda i: (totals[i], i))
        shards[target].append(name)
        totals[target] += sizes[name]
    return [sorted(shard) for shard in shards]


def stdlib_split(num_shards: int, *, root: Path | None = None) -> tuple[list[list[str]], list[str]]:
    """``(modules per shard, heldout modules)`` of the stdlib corpus, deterministic per stdlib tree.

    Held-out modules never appear in any shard; shards are disjoint and balanced by source bytes.
    """
    modules = stdlib_modules(root)
    heldout = [name for name in modules if is_heldout(name)]
    sizes = {
        name: sum(path.stat().st_size for path in files)
        for name, files in modules.items()
        if not is_heldout(name)
    }
    return balanced_split(sizes, num_shards), heldout


def _join(chunks: Iterable[bytes], max_bytes: int | None) -> np.ndarray:
    """Concatenate chunks with the file separator, stopping once ``max_bytes`` are gathered."""
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        if parts:
            parts.append(FILE_SEPARATOR)
            total += len(FILE_SEPARATOR)
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    data = b"".join(parts)
    if max_bytes is not None:
        data = data[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8).copy()


class ByteCorpus:
    """A corpus as one ``uint8`` array: its files' bytes joined by a blank line, in a fixed order."""

    def __init__(self, data: np.ndarray, *, source: str) -> None:
        assert data.dtype == np.uint8 and data.ndim == 1
        self.data = data
        self.source = source  # where the bytes came from, for log lines and errors

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __repr__(self) -> str:
        return f"ByteCorpus(source={self.source!r}, num_bytes={len(self)})"

    @classmethod
    def from_stdlib_modules(
        cls, modules: Iterable[str], max_bytes: int | None = None, *, root: Path | None = None
    ) -> ByteCorpus:
        """The named top-level stdlib modules, in the given order, optionally cut to ``max_bytes``."""
        _check_max_bytes(max_bytes)
        available = stdlib_modules(root)
        names = list(modules)
        unknown = [name for name in names if name not in available]
        if unknown:
            raise ValueError(f"unknown stdlib module(s): {', '.join(unknown)}")
        if not names:
            raise ValueError("no stdlib modules given")
        files = [path for name in names for path in available[name]]
        data = _join((path.read_bytes() for path in files), max_bytes)
        return cls(data, source=f"stdlib[{len(names)} modules]")

    @classmethod
    def from_text_dir(cls, path: str | Path, max_bytes: int | None = None) -> ByteCorpus:
        """Every UTF-8 text file below ``path`` (recursively, hidden entries skipped), by sorted path.

        Files that do not decode as UTF-8 (binaries, other encodings) and empty files are skipped.
        """
        _check_max_bytes(max_bytes)
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"corpus directory {str(root)!r} does not exist or is not a directory")
        files = sorted(
            (
                p
                for p in root.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(root).parts)
            ),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        data = _join(_utf8_texts(files), max_bytes)
        if len(data) == 0:
            raise ValueError(f"corpus directory {str(root)!r} holds no non-empty UTF-8 text files")
        return cls(data, source=str(root))


def _utf8_texts(files: Iterable[Path]) -> Iterable[bytes]:
    for path in files:
        raw = path.read_bytes()
        if not raw:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield raw


def _check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")


def _check_fits(corpus: ByteCorpus, context_len: int) -> None:
    if len(corpus) < context_len + 1:
        raise ValueError(
            f"corpus {corpus.source!r} has {len(corpus)} bytes, "
            f"fewer than context_len + 1 = {context_len + 1}"
        )


def sampler_seed(seed: int, shard_index: int) -> int:
    """The batch sampler seed of the site training on shard ``shard_index`` of a run seeded
    ``seed``: distinct per shard, and never the model's own seed."""
    return seed * 1000 + shard_index + 1


class BatchSampler:
    """Random windows of ``context_len + 1`` bytes as ``(x, y)`` int64 tensors ``[B, T]``.

    ``y`` is ``x`` shifted by one byte. The sequence of batches is fixed by the seed, and
    ``state_dict``/``load_state_dict`` let a restarted site continue it exactly.
    """

    def __init__(self, corpus: ByteCorpus, *, batch_size: int, context_len: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        _check_fits(corpus, context_len)
        self.corpus = corpus
        self.batch_size = batch_size
        self.context_len = context_len
        self.seed = seed
        self.step = 0  # batches drawn so far
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._offsets = np.arange(context_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_starts = len(self.corpus) - self.context_len
        starts = self._rng.integers(0, num_starts, size=self.batch_size)
        windows = self.corpus.data[starts[:, None] + self._offsets].astype(np.int64)
        self.step += 1
        x = torch.from_numpy(windows[:, :-1].copy())
        y = torch.from_numpy(windows[:, 1:].copy())
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """Only str and int values; PCG64's 128-bit integers are kept as hex strings."""
        state = self._rng.bit_generator.state
        return {
            "batch_size": self.batch_size,
            "context_len": self.context_len,
            "seed": self.seed,
            "step": self.step,
            "bit_generator": {
                "name": state["bit_generator"],
                "state": format(state["state"]["state"], "x"),
                "inc": format(state["state"]["inc"], "x"),
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("batch_size", "context_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}"
                )
        saved = state["bit_generator"]
        if saved["name"] != "PCG64":
            raise ValueError(f"sampler state uses bit generator {saved['name']!r}, expected PCG64")
        self._rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(saved["state"], 16), "inc": int(saved["inc"], 16)},
            "has_uint32": int(saved["has_uint32"]),
            "uinteger": int(saved["uinteger"]),
        }
        self.seed = int(state["seed"])
        self.step = int(state["step"])


def eval_batches(
    corpus: ByteCorpus, num_batches: int, batch_size: int, context_len: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches: the same arguments always give the same tensors."""
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    sampler = BatchSampler(corpus, batch_size=batch_size, context_len=context_len, seed=seed)
    return [sampler.next_batch() for _ in range(num_batches)]
