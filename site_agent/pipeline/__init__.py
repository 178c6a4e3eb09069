"""Intra-site pipeline parallelism over ``torch.distributed.pipelining``.

The pure-Python pieces: ``partition`` cuts a chain of units into stages (bottleneck-optimal),
``layout`` says which rank holds which stages, ``schedule`` and ``simulate`` time a schedule
without running it. The torch pieces, imported only by those who need them: ``cut`` (a job's
model into stages by module name), ``engine`` (one rank's stages and inner step), ``rank`` (a
rank's part in the leader's commands, the workers' loop), ``leader`` (rank 0's
``PipelineTrainer``) and ``procgroup`` (joining torchrun's process group).
"""
