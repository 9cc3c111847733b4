"""torch imported (and CUDA started) in a background thread while the main thread prepares OUT and reads
ahead, and torch's start-up reads asked of the disk all at once.

A cold `import torch` and CUDA's start read about 0.3 GB of libraries and a thousand Python files, one page
fault at a time. A run that started torch records them in the user's cache (each mapped library's present
pages, and the files it imported); the next asks the kernel for all of them at once (POSIX_FADV_WILLNEED)
before the checkpoint's reads. Only a hint: a missing or stale record costs nothing but a cold import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import read_json_object

# Pinned host memory from malloc and cudaHostRegister by 8 threads, not one cudaHostAlloc at a time: the
# readers' and the writer's buffers are pinned in every run's critical path.
PINNED_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
TORCH_THREAD = "fp8convert-torch"
CUDA_DRIVER = "libcuda.so.1"  # the name torch's CUDA runtime loads the driver by
PAGES_WAIT_S = 3.0  # the longest torch's import and the checkpoint's reads wait for the start-up pages to be queued
PAGE = os.sysconf("SC_PAGE_SIZE")
GAP_PAGES = 32  # pages touched closer than this are asked for as one range
THREADS = 8  # opening a thousand cold files one after another would itself take a while
# Linux reads at most max(read_ahead_kb, max_sectors_kb) of one POSIX_FADV_WILLNEED and drops the rest.
ASK_BYTES = 128 << 10
LIBRARY = re.compile(r"\.so(\.\d+)*$")  # libfoo.so, libfoo.so.13


def pin_by_registering() -> None:
    """PINNED_ALLOC_CONF, unless the user configured the allocator or torch has read its configuration."""
    if "torch" in sys.modules or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = PINNED_ALLOC_CONF


class TorchStart:
    """Import torch, and start CUDA unless on the CPU, in a thread once an earlier run's pages are queued."""

    def __init__(self, device: str):
        self.device = device
        self.record_file = None if "torch" in sys.modules else record_path(device)  # torch loaded before: no record
        if device != "cpu":
            pin_by_registering()
        self.pages_queued = read_ahead(self.record_file)
        self.thread = threading.Thread(target=self._load, name=TORCH_THREAD, daemon=True)
        self.thread.start()
        self.join = self.thread.join

    def record_pages(self) -> None:
        """Call after the run's quantizing: CUDA reads a kernel's code only when it first runs."""
        record(self.record_file)

    def _load(self) -> None:
        # queued first: posix_fadvise calls beside an import holding the GIL are slow
        self.pages_queued.wait(PAGES_WAIT_S)
        try:
            import torch

            if self.device != "cpu" and torch.cuda.is_available():
                torch.empty(1, device="cuda" if self.device == "auto" else self.device)
        except Exception:  # noqa: BLE001 - reported by the pipeline, which tries again
            pass


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


def cuda_device_count() -> int:
    if not torch_has_cuda():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def record_path(device: str) -> Path | None:
    """The start-up record for this Python environment and a run on `device` ("auto": CUDA where torch has
    it and the driver loads) in the user's cache; None without a home."""
    cuda = device.startswith("cuda")
    if device == "auto" and torch_has_cuda():
        import ctypes

        try:
            ctypes.CDLL(CUDA_DRIVER)
            cuda = True
        except OSError:
            pass
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (KeyError, RuntimeError):
        return None
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return cache / "fp8convert" / f"startup-pages-{'cuda' if cuda else 'cpu'}-{environment}.json"


def read_ahead(record: Path | None) -> threading.Event:
    """From a thread, ask the kernel for what `record` lists of files unchanged since; set once all is queued."""
    queued = threading.Event()
    entries = read_json_object(record).get("files") if record else None
    if not entries or not isinstance(entries, list) or not hasattr(os, "posix_fadvise"):  # (not on macOS)
        queued.set()
        return queued

    def run() -> None:
        try:
            with ThreadPoolExecutor(THREADS, thread_name_prefix="fp8convert-pages") as pool:
                pool.map(_ask_for, entries)
        finally:
            queued.set()

    threading.Thread(target=run, name="fp8convert-pages", daemon=True).start()
    return queued


def _ask_for(entry: list) -> None:
    try:
        path, size, mtime_ns, ranges = entry
        fd = os.open(path, os.O_RDONLY)
    except (OSError, TypeError, ValueError):
        return
    try:
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):  # else it changed since: the record is stale for it
            for start, end in ranges:
                for piece in range(start, end, ASK_BYTES):
                    os.posix_fadvise(fd, piece, min(ASK_BYTES, end - piece), os.POSIX_FADV_WILLNEED)
    except (OSError, TypeError, ValueError):
        pass
    finally:
        os.close(fd)


def record(path: Path | None) -> None:
    if path is None:
        return
    try:
        files = mapped_library_pages() + imported_files()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"files": files}))
        os.replace(tmp, path)
    except OSError:
        pass


def mapped_library_pages() -> list[list]:
    """[path, size, mtime_ns, [[start, end], ...]]: each mapped library's present pages as byte ranges."""
    import torch  # scans the page table fast: torch's CUDA libraries map a million pages

    pages: dict[str, list[torch.Tensor]] = {}
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or not LIBRARY.search(fields[5]):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            entries = torch.frombuffer(bytearray(pagemap.read((end - start) // PAGE * 8)), dtype=torch.int64)
            present = (entries < 0).nonzero().flatten()  # bit 63 of an entry: the page is present
            if present.numel():
                pages.setdefault(fields[5], []).append(present + int(fields[2], 16) // PAGE)
    files = []
    for path, found in pages.items():
        try:
            st = os.stat(path)
        except OSError:
            continue
        files.append([path, st.st_size, st.st_mtime_ns, page_ranges(torch.cat(found).unique())])
    return files


def page_ranges(pages) -> list[list[int]]:
    """Sorted page numbers (a 1-D tensor) as byte ranges [start, end), joined below GAP_PAGES apart."""
    if not pages.numel():
        return []
    breaks = ((pages[1:] - pages[:-1]) >= GAP_PAGES).nonzero().flatten() + 1
    firsts = pages[[0, *breaks.tolist()]]
    lasts = pages[[*(breaks - 1).tolist(), pages.numel() - 1]]
    return [[first * PAGE, (last + 1) * PAGE] for first, last in zip(firsts.tolist(), lasts.tolist())]


def imported_files() -> list[list]:
    """[path, size, mtime_ns, [[0, size]]] for each module imported (its bytecode, if any: what was read)."""
    files = []
    for module in list(sys.modules.values()):
        for path in (getattr(module, "__cached__", None), getattr(module, "__file__", None)):
            if isinstance(path, str) and not LIBRARY.search(path):  # libraries are mapped: recorded above
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                files.append([path, st.st_size, st.st_mtime_ns, [[0, st.st_size]]])
                break
    return files
