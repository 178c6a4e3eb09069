"""Intra-site pipeline parallelism: stage partition, schedules as data, and their simulator.

The pieces here are pure Python (``profile_layers`` imports torch on call): ``partition`` cuts a
layer chain into stages, ``schedule`` says which forward/backward ops each stage runs in what order,
and ``simulate`` times a schedule without running it. The modules that run a pipeline over
torch.distributed (``runtime`` and the modules it names) are imported only by those who need them.
"""

from site_agent.pipeline.partition import (
    PartitionPlan,
    TransferModel,
    brute_force_partition,
    partition_layers,
    profile_layers,
)
from site_agent.pipeline.schedule import (
    SCHEDULES,
    Op,
    Schedule,
    gpipe,
    make_schedule,
    one_f_one_b,
    validate_schedule,
)
from site_agent.pipeline.simulate import OpTiming, SimResult, simulate

__all__ = [
    "SCHEDULES",
    "Op",
    "OpTiming",
    "PartitionPlan",
    "Schedule",
    "SimResult",
    "TransferModel",
    "brute_force_partition",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "partition_layers",
    "profile_layers",
    "simulate",
    "validate_schedule",
]
