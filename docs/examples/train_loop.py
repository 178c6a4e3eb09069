"""A team's own training loop, federated with crossdc: only the ``with`` block is new.

    python train_loop.py site.toml

``site.toml`` is a ``[site]`` table like any site's; its ``[site.job] factory`` names the job
whose model this script trains (``regression_job:make_job``), so that sites running
``crossdc agent`` with that job federate with this one.
"""

import sys

import torch
from regression_job import make_data, make_model

import crossdc

model = make_model(seed=1234)  # the federation's seed: every site starts from the same weights
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = make_data(seed=5, centre=0.5, n=512)
val_x, val_y = make_data(seed=7, centre=0.0, n=256)


def evaluate(model: torch.nn.Module) -> dict[str, float]:
    return {"loss": float(((model(val_x).squeeze(-1) - val_y) ** 2).mean())}


BATCH = 32  # a step counts for its batch's samples, as the job's agent sites count theirs
fed = crossdc.Federation(sys.argv[1], model, optimizer, evaluate=evaluate, weight_per_step=BATCH)
with fed:
    for step in range(1_000_000):
        if fed.finished:
            break
        i = (step * BATCH) % len(x)
        loss = ((model(x[i : i + BATCH]).squeeze(-1) - y[i : i + BATCH]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(f"done after {step} steps; exit code {fed.exit_code}")
