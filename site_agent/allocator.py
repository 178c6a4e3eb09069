"""The host allocator's policy on a sharded site's ranks: large blocks go back to the system.

FSDP2 gathers each block's parameters whole for its forward and backward and frees them after,
a layer's worth at a time (the all-gather's buffer and the unsharded parameters; the gradients
before they are reduce-scattered). glibc's malloc serves a block this large from ``mmap`` only
until the first one is freed: its threshold then rises to that size, and the next ones come from
the heap, which keeps them once they are freed. A rank of a 201M-parameter model on 2 ranks kept
about 1.5 GiB so (twice the model's gathered layers, more than its own shard of the parameters,
gradients and Adam's moments together), on top of what it holds.

:func:`return_large_blocks` fixes the threshold (which also stops it moving): a block of at least
``threshold`` bytes is mapped on its own and unmapped when freed. It does nothing where the C
library is not glibc, or when the process was started with ``MALLOC_MMAP_THRESHOLD_`` set (the
operator's choice stands).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("crossdc.site")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
DEFAULT_THRESHOLD = 4 << 20

_set: int | None = None


def return_large_blocks(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Have this process's malloc map blocks of ``threshold`` bytes and more on their own, so
    freeing one returns it to the system; True if the policy is in force (set now or before)."""
    global _set
    if _set is not None:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return False
    _set = threshold
    log.debug("malloc: blocks of %d bytes and more are mapped on their own", threshold)
    return True
