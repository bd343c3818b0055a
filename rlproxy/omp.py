"""Hand a thread's idle OpenMP workers back, so they do not slow another thread's.

torch's CPU kernels run on an OpenMP pool per calling thread, and the pool's workers live as long
as that thread. With more OpenMP workers alive than cores, libgomp stops letting any worker spin
between parallel regions, so a thread that runs many small regions (the engine's decode step:
hundreds) sleeps and wakes in each one. In one process the engine and the trainer each have a
thread: the trainer's pool, idle between steps, made the engine decode ~1.5x slower after every
step, and the engine's, idle between groups, slowed the trainer's steps (docs/engine.md, "Sampling
after a step"). OpenMP 5's `omp_pause_resource_all` ends the calling thread's pool; the next parallel
region there starts a new one, in well under a millisecond. Both threads call it when they go idle.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: end the threads, keep the settings


@cache
def _pause_all() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).omp_pause_resource_all  # the runtime torch loaded (libgomp, libomp)
    except (AttributeError, OSError):
        log.debug("no omp_pause_resource_all in this process: idle OpenMP workers stay")
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_workers() -> bool:
    """End the calling thread's OpenMP workers (call it outside any parallel region, between two
    pieces of torch work); False where the runtime has no pause (then nothing changes)."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0
