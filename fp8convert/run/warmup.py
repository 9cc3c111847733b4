"""torch imported (and CUDA started) in a background thread: both take seconds, while the main thread goes
on with what needs neither (preparing OUT, reading ahead); the pipeline's `import torch` then finds them done.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path

from . import startup_pages

# Pinned host memory from malloc and cudaHostRegister by 8 threads, not one cudaHostAlloc at a time: the
# readers' and the writer's buffers are pinned in every run's critical path.
PINNED_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
TORCH_THREAD = "fp8convert-torch"
CUDA_DRIVER = "libcuda.so.1"  # the name torch's CUDA runtime loads the driver by
PAGES_WAIT_S = 3.0  # the longest torch's import and the checkpoint's reads wait for the start-up pages to be queued


def pin_by_registering() -> None:
    """PINNED_ALLOC_CONF, unless the user configured the allocator or torch has read its configuration."""
    if "torch" in sys.modules or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = PINNED_ALLOC_CONF


class TorchStart:
    """Import torch, and start CUDA unless `device` is the CPU, in a thread (failures are left for the pipeline)
    once an earlier run's start-up pages are queued (`pages_queued`); `record`: where this run records its own."""

    def __init__(self, device: str):
        self.device = device
        self.record = None if "torch" in sys.modules else record_path(device)  # torch loaded before: no record
        if device != "cpu":
            pin_by_registering()
        self.pages_queued = startup_pages.read_ahead(self.record)
        self.thread = threading.Thread(target=self._load, name=TORCH_THREAD, daemon=True)
        self.thread.start()
        self.join = self.thread.join

    def record_pages(self) -> None:
        """Call after the run's quantizing: CUDA reads a kernel's code only when it first runs."""
        startup_pages.record(self.record)

    def _load(self) -> None:
        # The recorded reads are queued before the import: posix_fadvise calls beside an import holding the
        # GIL are slow.
        self.pages_queued.wait(PAGES_WAIT_S)
        try:
            import torch

            if self.device != "cpu" and torch.cuda.is_available():
                torch.empty(1, device="cuda" if self.device == "auto" else self.device)
        except Exception:  # noqa: BLE001 - reported by the pipeline, which tries again
            pass


start_torch = TorchStart


def torch_starting() -> bool:
    return any(t.name == TORCH_THREAD and t.is_alive() for t in threading.enumerate())


def torch_has_cuda() -> bool:
    """Whether the installed torch is built with CUDA (has libtorch_cuda), found without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    folders = spec.submodule_search_locations if spec else None
    return any((Path(folder) / "lib" / "libtorch_cuda.so").exists() for folder in folders or [])


def cuda_missing(device: str) -> bool:
    """Whether `device` asks for CUDA that the installed torch lacks (the run will be refused)."""
    return device.startswith("cuda") and not torch_has_cuda()


def cuda_device_count() -> int:
    if not torch_has_cuda():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def record_path(device: str) -> Path | None:
    """The start-up record for a run on `device`: "auto" is CUDA where torch has it and the driver loads."""
    cuda = device.startswith("cuda")
    if device == "auto" and torch_has_cuda():
        import ctypes

        try:
            ctypes.CDLL(CUDA_DRIVER)
            cuda = True
        except OSError:
            pass
    return startup_pages.record_path("cuda" if cuda else "cpu")
