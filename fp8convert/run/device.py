"""Which device quantizes, and how much of it (and of the host's threads) a run may use."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..errors import FP8ConvertError
from ..options import DEFAULT_MAX_RESIDENT
from ..units import plural
from .prefetch import io_share, usable_cores


def resolve_device(device: str, option: str = "--device") -> torch.device:
    """'auto', 'cpu', 'cuda' or 'cuda:N' as a torch.device this machine has; errors name `option`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise FP8ConvertError(f"{option} {device!r}: not a device (auto, cpu, cuda or cuda:N)") from e
    if dev.type not in ("cpu", "cuda"):
        raise FP8ConvertError(f"{option} {device!r}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FP8ConvertError(f"{option} {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            count = plural(torch.cuda.device_count(), "CUDA device")
            raise FP8ConvertError(f"{option} {device}: this machine has {count}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def budget_for(dev: torch.device, max_resident: int | None) -> int:
    return max_resident or DEFAULT_MAX_RESIDENT[dev.type]


def io_threads(device_type: str) -> tuple[int, int]:
    """(reader, writer) threads: with a GPU, 8 and 8 keep the disk busy; on the CPU quantizing needs the cores."""
    if device_type != "cpu":
        return 8, 8
    cores = usable_cores()
    return io_share(cores), 1 if cores <= 4 else 2


def quantizing_threads(torch_threads: int, cores: int, environ=os.environ) -> int | None:
    """Above 4 cores, the cores less the readers': a torch thread waiting for a core holds up the rest."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    spared = io_share(cores) if cores > 4 else 0  # the CPU's readers
    return max(1, min(torch_threads, cores - spared))


@contextlib.contextmanager
def cpu_threads_for_quantizing() -> Iterator[None]:
    before = torch.get_num_threads()
    threads = quantizing_threads(before, usable_cores())
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
