"""A team's own FSDP2 training loop under torchrun, federated with crossdc: only the ``with``
block is new. No rank holds the whole model: each syncs its own shard.

    torchrun --nproc-per-node=2 train_fsdp.py site.toml

``site.toml`` is a ``[site]`` table like any site's (its ``[site.job] factory`` names the job
whose model this script trains, ``regression_job:make_job``). Rank 0 talks to the coordinator;
every rank enters the block, encodes its own rows' update and applies its own rows of a result.
"""

import os
import sys

import torch
import torch.distributed as dist
from regression_job import make_data, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import crossdc

dist.init_process_group("gloo")  # "nccl" on GPUs, with the mesh on "cuda"
rank, world = dist.get_rank(), dist.get_world_size()
model = make_model(seed=1234)  # the federation's seed: every site starts from the same weights
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    if any(True for _ in layer.parameters()):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = make_data(seed=5 + rank, centre=0.5, n=512)  # each rank its own data
val_x, val_y = make_data(seed=7, centre=0.0, n=256)


def evaluate(model: torch.nn.Module) -> dict[str, float]:  # every rank runs it
    return {"loss": float(((model(val_x).squeeze(-1) - val_y) ** 2).mean())}


BATCH = 32  # a step counts for its batch's samples on every rank
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
print(f"rank {rank}: done after {step} steps; exit code {fed.exit_code}", flush=True)
dist.destroy_process_group()
os._exit(0)  # gloo's threads may still hold tensors at interpreter exit
