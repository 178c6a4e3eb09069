"""Intra-site pipeline parallelism over ``torch.distributed.pipelining`` (docs/pipelines.md).

``partition`` and ``layout`` are pure Python; the other modules import torch and
are imported only where they are needed.
"""
