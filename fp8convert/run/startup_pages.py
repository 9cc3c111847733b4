"""torch's start-up reads, asked of the disk all at once.

A cold `import torch` and CUDA's start read about 0.3 GB of libraries and a thousand Python files, one page
fault at a time. A run that started torch records them in the user's cache (each mapped library's present
pages, and the files it imported); the next asks the kernel for all of them at once (POSIX_FADV_WILLNEED)
before the checkpoint's reads. Only a hint: a missing or stale record costs nothing but a cold import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import read_json_object

PAGE = os.sysconf("SC_PAGE_SIZE")
GAP_PAGES = 32  # pages touched closer than this are asked for as one range
THREADS = 8  # opening a thousand cold files one after another would itself take a while
# Linux reads at most max(read_ahead_kb, max_sectors_kb) of one POSIX_FADV_WILLNEED and drops the rest.
ASK_BYTES = 128 << 10
LIBRARY = re.compile(r"\.so(\.\d+)*$")  # libfoo.so, libfoo.so.13


def record_path(device_type: str) -> Path | None:
    """The record for this Python environment and device type in the user's cache; None without a home."""
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (KeyError, RuntimeError):
        return None
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return cache / "fp8convert" / f"startup-pages-{device_type}-{environment}.json"


def read_ahead(record: Path | None) -> threading.Event:
    """Ask the kernel, from a thread, to read what `record` lists of files unchanged since; the event is set
    once every read is queued."""
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
    """Write this process's record to `path` atomically (nothing on failure)."""
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
