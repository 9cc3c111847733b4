"""How many cores a run may use: the CPUs this process may run on, not the machine's count."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPUs this process may run on: a cluster job's or a container's share of the node (Slurm and
    `taskset` set it), where the system says; else the machine's count. A 4-core job on a 128-core node
    that sized its threads and processes by the node's count would run 30 times too many."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on macOS or Windows
        return os.cpu_count() or 1
