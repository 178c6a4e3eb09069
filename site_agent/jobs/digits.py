"""A job that is not a language model: a small MLP classifier on scikit-learn's ``load_digits``
(1,797 8x8 images, 10 classes), split non-IID across sites by label.

It owns its options (``DigitsOptions``), the split (``validation_indices`` and ``split_indices``,
pure functions of the labels), the model (64 -> hidden -> BatchNorm -> ReLU -> 10, so the
federation also averages BatchNorm's running statistics while ``num_batches_tracked`` stays local),
and a seeded endless batch stream with a resumable cursor. (The baseline a federation must beat,
one site trained alone on its own skewed share, is ``crossdc.bench.alone.train_alone``.) Use it as
``[site.job] factory = "site_agent.jobs.digits:make_job"``; scikit-learn is needed only there
(``pip install crossdc[sklearn]``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from site_agent.jobs.contract import JobContext, parse_options

FACTORY = "site_agent.jobs.digits:make_job"
NUM_CLASSES = 10
NUM_FEATURES = 64
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsOptions:
    """``[site.job.options]`` of the digits job."""

    site_index: int = 0
    """This site's share, in ``[0, num_sites)``; it owns the classes ``c % num_sites == site_index``."""
    num_sites: int = 1
    """Shares the training images are divided into."""
    skew: float = 0.9
    """Label skew in ``[0, 1]``: 1 = a site sees only its own classes, 0 = IID shares."""
    hidden: int = 64
    batch_size: int = 32
    lr: float = 1e-2
    weight_decay: float = 1e-4
    val_fraction: float = 0.25
    """Held-out share of every class, common to all sites."""
    split_seed: int = 0
    """Seed of the split: the same at every site, whatever its index."""

    def __post_init__(self) -> None:
        rules = {
            "num_sites": (self.num_sites >= 1, ">= 1"),
            "site_index": (0 <= self.site_index < self.num_sites, f"in [0, {self.num_sites})"),
            "skew": (0 <= self.skew <= 1, "in [0, 1]"),
            "hidden": (self.hidden >= 1, ">= 1"),
            "batch_size": (self.batch_size >= 2, ">= 2 (BatchNorm trains on two or more)"),
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "val_fraction": (0 < self.val_fraction < 1, "in (0, 1)"),
            "split_seed": (self.split_seed >= 0, ">= 0"),
        }
        for name, (ok, rule) in rules.items():
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"site.job.options.{name} must be {rule}, got {value}")


def validation_indices(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """The held-out images (sorted): ``round(val_fraction * n_c)`` of every class c, drawn with
    ``seed`` alone, so every site evaluates on the same ones."""
    rng = np.random.default_rng([seed, 0])
    picked = [
        rng.permutation(members)[: round(val_fraction * len(members))]
        for members in (np.flatnonzero(labels == c) for c in np.unique(labels))
    ]
    return np.sort(np.concatenate(picked))


def split_indices(
    labels: np.ndarray,
    site_index: int,
    num_sites: int,
    skew: float,
    seed: int,
    val_fraction: float = 0.25,
) -> np.ndarray:
    """Site ``site_index``'s training images (sorted). Of each class c's training images (those
    not held out), a ``skew`` share goes to its owner ``c % num_sites`` and the rest is dealt
    round-robin to all sites (starting after the owner), so shares are disjoint and their union
    is the training set; skew 0 gives IID shares."""
    held_out = validation_indices(labels, val_fraction, seed)
    train = np.setdiff1d(np.arange(len(labels)), held_out)
    rng = np.random.default_rng([seed, 1])
    mine: list[np.ndarray] = []
    for c in np.unique(labels):
        members = rng.permutation(train[labels[train] == c])
        owned = round(skew * len(members))
        if int(c) % num_sites == site_index:
            mine.append(members[:owned])
        dealt = members[owned:]
        mine.append(dealt[(np.arange(len(dealt)) + int(c) + 1) % num_sites == site_index])
    return np.sort(np.concatenate(mine))


@functools.lru_cache(maxsize=1)
def load_data() -> tuple[np.ndarray, np.ndarray]:
    """``load_digits`` as float32 features in [0, 1] and int64 labels (read-only)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            f"the digits job needs scikit-learn ({exc}): pip install crossdc[sklearn]"
        ) from exc
    x, y = load_digits(return_X_y=True)
    features, labels = (x / 16.0).astype(np.float32), y.astype(np.int64)
    features.flags.writeable = labels.flags.writeable = False
    return features, labels


def build_model(hidden: int, seed: int) -> nn.Module:
    """The MLP, initialised from ``seed`` alone (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )


class DigitsJob:
    """One site's digits classifier: shuffled batches of its share (an epoch's order drawn from
    ``(seed, site_index, epoch)``, a batch running on into the next epoch), cross entropy, and
    loss and accuracy on the common validation set. A batch weighs its examples."""

    def __init__(self, ctx: JobContext, opts: DigitsOptions) -> None:
        features, labels = load_data()
        self.train_indices = split_indices(
            labels, opts.site_index, opts.num_sites, opts.skew, opts.split_seed, opts.val_fraction
        )
        self.val_indices = validation_indices(labels, opts.val_fraction, opts.split_seed)
        if len(self.train_indices) == 0:
            raise ValueError(
                f"site.job.options.site_index={opts.site_index} holds no training image "
                f"(num_sites={opts.num_sites}, skew={opts.skew})"
            )
        device = ctx.device
        self._x = torch.from_numpy(features[self.train_indices]).to(device)
        self._y = torch.from_numpy(labels[self.train_indices]).to(device)
        self._val = (
            torch.from_numpy(features[self.val_indices]).to(device),
            torch.from_numpy(labels[self.val_indices]).to(device),
        )
        self.model = build_model(opts.hidden, ctx.seed).to(device)
        self.architecture = {"hidden": opts.hidden}
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": opts.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=opts.lr,
        )
        self.batch_size = opts.batch_size
        self._seed = (ctx.seed % 2**63, opts.site_index)
        self._epoch = self._position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        rng = np.random.default_rng([*self._seed, epoch])
        return torch.from_numpy(rng.permutation(len(self.train_indices))).to(self._x.device)

    def batches(self) -> Iterator[Batch]:
        while True:
            parts: list[torch.Tensor] = []
            need = self.batch_size
            while need:
                if self._position == len(self._order):
                    self._epoch, self._position = self._epoch + 1, 0
                    self._order = self._permutation(self._epoch)
                part = self._order[self._position : self._position + need]
                parts.append(part)
                self._position += len(part)
                need -= len(part)
            index = torch.cat(parts)
            yield self._x[index], self._y[index]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.output_loss(model(x), y)

    def split(self, batch: Batch) -> Batch:
        """The model's input and the labels: a site may pipeline the job (each stage's
        BatchNorm then normalizes a micro-batch)."""
        return batch

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def weight(self, batch: Batch) -> int:
        return int(batch[1].shape[0])

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                device = next(model.parameters()).device  # a pipelined site's copy: the CPU
                x, y = (t.to(device) for t in self._val)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                accuracy = (logits.argmax(dim=1) == y).double().mean()
        finally:
            model.train(was_training)
        return {"loss": float(loss), "accuracy": float(accuracy)}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.train_indices):
            raise ValueError(f"digits job state out of range: epoch={epoch}, position={position}")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)


def make_job(ctx: JobContext) -> DigitsJob:
    """The digits job's factory."""
    return DigitsJob(ctx, parse_options(DigitsOptions, ctx.options))
