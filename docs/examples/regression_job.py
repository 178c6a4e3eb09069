"""A job written outside crossdc: a small regression network on synthetic data.

Each site draws its inputs around its own ``centre`` (``[site.job.options]``), so the sites'
data differ; every site validates on the same held-out set. Run it with::

    [site.job]
    factory = "regression_job:make_job"
    python_path = ["docs/examples"]
    [site.job.options]
    centre = 1.0
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

W_TRUE = torch.linspace(-1.0, 1.0, 8)


def make_model(seed: int) -> nn.Module:
    """The same weights for the same seed, on every site and in ``train_loop.py``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data(seed: int, centre: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) + centre
    return x, x @ W_TRUE + 0.1 * torch.randn(n, generator=g)


class RegressionJob:
    def __init__(self, seed: int, centre: float) -> None:
        with torch.random.fork_rng():
            self.model = make_model(seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.x, self.y = make_data(100 + int(centre * 10), centre, 512)
        self.val_x, self.val_y = make_data(7, 0.0, 256)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.x), 32):
            yield self.x[i : i + 32], self.y[i : i + 32]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.output_loss(model(x), y)

    # With these two a site may pipeline the job (site.stages = 2: the first Linear and the
    # Tanh on one rank, the last Linear on the other).
    def split(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output.squeeze(-1) - target) ** 2).mean()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device  # CUDA, or a pipelined site's CPU copy
        out = model(self.val_x.to(device)).squeeze(-1)
        mse = float(((out - self.val_y.to(device)) ** 2).mean())
        return {"loss": mse, "rmse": mse**0.5}


def make_job(ctx) -> RegressionJob:  # type: ignore[no-untyped-def]
    unknown = set(ctx.options) - {"centre"}
    if unknown:
        raise ValueError(f"unknown option {sorted(unknown)[0]!r} (known: centre)")
    return RegressionJob(ctx.seed, float(ctx.options.get("centre", 0.0)))
