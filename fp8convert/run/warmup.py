"""torch and CUDA loaded in the background.

Importing torch and creating a CUDA context take seconds (more with cold files). A thread does it while
the main thread goes on with what needs neither (preparing OUT, copying kept tensors, reading ahead),
and the pipeline's own `import torch` then finds it done, or waits for the rest. A run whose weights
the early quantizer may all write begins that thread only once the disk reads ahead of it (api.py).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import startup_pages

# Pinned host memory from malloc and cudaHostRegister, its pages touched by 8 threads, instead of one
# cudaHostAlloc call at a time: the readers' and the writer's 17 buffers of 32 MB are pinned at the start of
# every run, in its critical path. On an H200 the first batch's read (which pins the readers' buffers)
# took 0.11-0.15 s with this against 0.30-0.32 s without, and a fresh process's pipeline ran at 8.7-11.1
# GB/s against 7.9-8.8 (MoE 8; dense 16: 12.8-13.4 against 10.0-11.5; docs/benchmarks.md).
PINNED_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"

CUDA_DRIVER = "libcuda.so.1"  # the name torch's CUDA runtime loads the driver by
TORCH_THREAD, CUDA_THREAD = "fp8convert-torch", "fp8convert-cuda"

# The longest a run that needs no torch waits for the driver to say whether the GPU it was asked for is there.
CONTEXT_WAIT_S = 10.0

# The longest torch's import and the checkpoint's reads wait for the recorded start-up pages to be queued.
PAGES_WAIT_S = 3.0


def pin_by_registering() -> None:
    """Ask torch's pinned allocator for PINNED_ALLOC_CONF, unless the user configured the allocator
    (theirs stands) or torch is already loaded (it has read its configuration)."""
    if torch_loaded() or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = PINNED_ALLOC_CONF


def already_set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class TorchStart:
    """torch's start on `device`, in `thread` once `begin` has been called (start_torch's caller may
    defer it). `pages_queued` is set once the reads of the pages an earlier run recorded are queued (at
    once when there is no record, or nothing has begun); `record` is where this run records its own (None
    when torch was loaded before: an API caller's process maps much else)."""

    device: str
    record: Path | None
    pages_queued: threading.Event = field(default_factory=already_set)
    thread: threading.Thread | None = None
    context: threading.Thread | None = None  # open_primary_context's, when it was started
    context_made: threading.Event = field(default_factory=threading.Event)
    began_at: float | None = None  # time.monotonic() when `begin` was first called

    def begin(self) -> None:
        """Queue the recorded pages' reads, then import torch (and start CUDA) in a thread; once only."""
        if self.thread is not None:
            return
        self.began_at = time.monotonic()
        self.pages_queued = startup_pages.read_ahead(self.record)
        self.thread = threading.Thread(target=self._load, name=TORCH_THREAD, daemon=True)
        self.thread.start()

    def ready(self) -> bool:
        """Whether torch has begun and is ready (or failed: the pipeline then reports it)."""
        return self.thread is not None and not self.thread.is_alive()

    def device_known_good(self, device: str) -> bool:
        """Whether a run on `device` may end without torch (run/early.py wrote every weight): the CPU,
        auto, or a CUDA device whose primary context the driver made, which torch's resolve_device takes
        too. Else the run waits for torch, which refuses a device this machine does not have."""
        if device in ("cpu", "auto"):
            return True
        if self.context is None or not re.fullmatch(r"cuda(:\d+)?", device):
            return False
        self.context.join(CONTEXT_WAIT_S)
        return self.context_made.is_set()

    def join(self) -> None:
        """Until torch is ready, beginning its start if nothing has."""
        self.begin()
        self.thread.join()

    def record_pages(self) -> None:
        """Call after the run's quantizing: CUDA reads a kernel's code only when it first runs."""
        startup_pages.record(self.record)

    def _load(self) -> None:
        # The recorded reads are all queued (begin) before the import: a thousand-odd posix_fadvise calls
        # took 0.03-0.11 s alone and 0.3-0.5 s beside an import holding the GIL (2-core machine), and the
        # checkpoint's reads wait for them. On an H200 box, cold MoE 8 runs with this (and the copy-free prefetcher) began
        # reading the checkpoint 0.1-0.3 s sooner and ended 0.6-0.7 s sooner, though torch was ready
        # 1.2-1.5 s later (docs/benchmarks.md).
        self.pages_queued.wait(PAGES_WAIT_S)
        try:
            import torch
            if self.device != "cpu" and torch.cuda.is_available():
                torch.empty(1, device="cuda" if self.device == "auto" else self.device)
        except Exception:  # noqa: BLE001 - reported by the pipeline, which tries again
            pass


def open_primary_context(device: str, made: threading.Event | None = None) -> threading.Thread:
    """Start CUDA's driver and make `device`'s primary context, the one torch's CUDA runtime takes, from a
    thread of its own through the driver's C API while torch is still importing: torch then finds it
    made. On an H200 box, all cold, torch and CUDA were ready 4.8-5.2 s into a process with this against
    5.6-5.9 s without (CUDA ready 0.02 s after torch's import against 0.33-0.44 s). With no driver, no
    such device or a torch without CUDA nothing happens (and torch reports it, or runs on the CPU);
    `made` is set once the context is made."""
    number = device.partition(":")[2]
    ordinal = int(number) if number.isdigit() else 0  # "cuda" and "auto" are torch's device 0

    def run() -> None:
        cuda = started_driver()  # here, off the main thread's start-up
        if cuda is None:
            return
        import ctypes
        handle, context = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuDeviceGet(ctypes.byref(handle), ordinal) == 0:
            if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle) == 0:  # kept for torch: never released
                if made is not None:
                    made.set()

    thread = threading.Thread(target=run, name=CUDA_THREAD, daemon=True)
    thread.start()
    return thread


def cuda_device_count() -> int:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies): torch's count once it is
    loaded, else the driver's, without importing torch (seconds, which the early quantizer fills only
    if nothing imports it first). 0 where the installed torch lacks CUDA or there is no driver."""
    if torch_loaded():
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = started_driver()
    if cuda is None:
        return 0
    import ctypes
    count = ctypes.c_int()
    return count.value if cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0


def started_driver():
    """CUDA's driver library, initialised (cuInit), through ctypes; None where the installed torch lacks
    CUDA (a context or device count it cannot use would only mislead), or the driver is missing or fails."""
    if not torch_has_cuda():
        return None
    import ctypes
    try:
        cuda = ctypes.CDLL(CUDA_DRIVER)
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def torch_starting() -> bool:
    """Whether this process's threads that load torch or start CUDA (start_torch's) are still at it."""
    return any(t.name in (TORCH_THREAD, CUDA_THREAD) and t.is_alive() for t in threading.enumerate())


def cuda_missing(device: str) -> bool:
    """Whether `device` asks for CUDA that the installed torch lacks (a CPU build): the run is refused
    once torch is loaded, so nothing is worth starting before that."""
    return device.startswith("cuda") and not torch_has_cuda()


def torch_has_cuda() -> bool:
    """Whether the installed torch is built with CUDA (has libtorch_cuda), found without importing it."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    folders = spec.submodule_search_locations if spec else None
    return any((Path(folder) / "lib" / "libtorch_cuda.so").exists() for folder in folders or [])


def record_path(device: str) -> Path | None:
    """Where the start-up record of a run on `device` ("cpu", "auto", "cuda:1"...) lives: named after
    the device type the run uses ("auto" is the CPU where there is no CUDA driver to use)."""
    cuda = device.startswith("cuda") or (device == "auto" and cuda_driver_present())
    return startup_pages.record_path("cuda" if cuda else "cpu")


def cuda_driver_present() -> bool:
    """Whether the installed torch has CUDA and the driver library loads: what "auto" needs to choose
    CUDA, found without starting the driver (that takes a while, and open_primary_context's thread does it)."""
    if not torch_has_cuda():
        return False
    import ctypes
    try:
        ctypes.CDLL(CUDA_DRIVER)
    except OSError:
        return False
    return True


def torch_loaded() -> bool:
    """Whether this process has imported torch (an API caller's may have): then nothing waits for it."""
    return "torch" in sys.modules


def start_torch(device: str, begin: bool = True) -> TorchStart:
    """Import torch and, unless `device` is the CPU, start CUDA on it: now, or when the caller calls
    `begin` (api.py defers it while the early quantizer may write every weight). Failures are left for
    the pipeline to report in its own words, when it resolves the device. In a process without torch
    yet, the pages an earlier run's start-up read are read ahead (startup_pages), and a GPU's primary
    context is made now, beside whatever comes next (open_primary_context): a run that ends without torch
    needs it to know the device is there."""
    fresh = not torch_loaded()
    start = TorchStart(device, record_path(device) if fresh else None)
    if device != "cpu":
        pin_by_registering()
        if fresh:
            start.context = open_primary_context(device, start.context_made)
    if begin:
        start.begin()
    return start
