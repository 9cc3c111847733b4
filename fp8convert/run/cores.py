"""How many cores a run may use."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPUs this process may run on (a Slurm job's or a container's share of the node, as `taskset`
    sets it), else the machine's count: a 4-core job on a 128-core node must not size itself by 128."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on macOS or Windows
        return os.cpu_count() or 1


def io_share(cores: int) -> int:
    """Threads for I/O that costs CPU time (a CPU run's readers, the prefetcher): a quarter of the cores,
    from 1 to 4 (plenty for a disk)."""
    return min(4, max(1, cores // 4))
