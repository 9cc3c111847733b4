"""Pull the source's bytes into the page cache ahead of the reader, in its order: cold reads are the
bottleneck, so this starts before torch is imported and keeps at most `window` bytes ahead of what the
reader consumed. Only a hint: a reader that overtakes it reads from the disk itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..options import AUTO
from ..safetensors_io import TensorInfo


def usable_cores() -> int:
    """The CPUs this process may run on (a Slurm job's or a container's share, as `taskset` sets it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on macOS or Windows
        return os.cpu_count() or 1


def io_share(cores: int) -> int:
    """Threads for I/O that costs CPU time (a CPU run's readers, the prefetcher): a quarter, 1 to 4."""
    return min(4, max(1, cores // 4))


def default_threads() -> int:
    return io_share(usable_cores())


WINDOW_CAP = 32 << 30  # the default window's largest
FALLBACK_WINDOW = 8 << 30  # where the available memory cannot be read (off Linux)


def default_window(workers: int = 1, available: int | None = None) -> int:
    """--prefetch auto: half the memory available, shared by this machine's `workers`, at most WINDOW_CAP."""
    available = available_memory() if available is None else available
    if available is None:
        return FALLBACK_WINDOW
    return min(WINDOW_CAP, available // (2 * max(1, workers)))


def window_for(prefetch: int | str, workers: int = 1) -> int:
    return default_window(workers) if prefetch == AUTO else prefetch


# Where each cgroup version keeps a cgroup's memory limit, its use, and (in memory.stat) the inactive file
# pages the kernel reclaims first: v2's unified tree, v1's memory controller.
CGROUP_MEMORY = {
    "v2": ("", "memory.max", "memory.current", ("inactive_file",)),
    "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")),
}


def available_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroups: Path = Path("/sys/fs/cgroup"),
    own_cgroup: Path = Path("/proc/self/cgroup"),
) -> int | None:
    """MemAvailable, or less where a cgroup caps memory: its limit less its use plus the inactive file pages
    the kernel reclaims first (a job that just downloaded the checkpoint holds it in its cache)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # "123456 kB"
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:
        lines = own_cgroup.read_text().splitlines()
    except OSError:
        return available
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if number == "0" and not controllers else "v1" if "memory" in controllers.split(",") else ""
        if version:
            available = min(available, cgroup_headroom(cgroups, version, path))
    return available


def cgroup_headroom(cgroups: Path, version: str, path: str) -> int:
    """The least headroom of the cgroup at `path` and each one above it (the mount's root at least)."""
    mount, limit_file, usage_file, inactive_keys = CGROUP_MEMORY[version]
    root = cgroups / mount
    group, headroom = root / path.strip().lstrip("/"), 1 << 62
    while True:
        try:
            limit = (group / limit_file).read_text().strip()
            if limit != "max":  # v1 says "no limit" with a number near 2^63, which limits nothing
                used = int((group / usage_file).read_text()) - reclaimable(group / "memory.stat", inactive_keys)
                headroom = min(headroom, max(0, int(limit) - used))
        except (OSError, ValueError):
            pass
        if group == root or root not in group.parents:
            return headroom
        group = group.parent


def reclaimable(stat: Path, keys: tuple[str, ...]) -> int:
    try:
        values = dict(line.split(" ", 1) for line in stat.read_text().splitlines() if " " in line)
        return next(int(values[key]) for key in keys if key in values)
    except (OSError, ValueError, StopIteration):
        return 0


class Prefetcher:
    def __init__(
        self, root: Path, tensors: list[TensorInfo], window_bytes: int, threads: int = 8, chunk_bytes: int = 16 << 20
    ):
        self.root, self.window, self.chunk, self.threads = Path(root), window_bytes, chunk_bytes, threads
        self.spans: list[list] = []  # [file, start, end] in reading order, adjacent ranges of one file merged
        for t in tensors:
            if self.spans and self.spans[-1][0] == t.file and self.spans[-1][2] == t.offset:
                self.spans[-1][2] += t.nbytes
            else:
                self.spans.append([t.file, t.offset, t.offset + t.nbytes])
        self.consumed, self.landed = 0, 0  # landed: bytes whose reads have returned, in the page cache
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._dispatch, name="fp8convert-prefetch", daemon=True)
        self.local = threading.local()
        self.sink: int | None = None

    def __enter__(self) -> Prefetcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def advance(self, nbytes: int) -> None:
        with self.cond:
            self.consumed += nbytes
            self.cond.notify_all()

    def stop(self, wait: bool = True) -> None:
        """Dispatch no more reads; with `wait`, also wait for those in flight (at most two per thread)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if wait:
            self.thread.join()

    def _dispatch(self) -> None:
        fds: dict[str, int] = {}
        with contextlib.suppress(OSError):  # one /dev/null for every chunk's sendfile
            self.sink = os.open(os.devnull, os.O_WRONLY) if hasattr(os, "sendfile") else None
        in_flight = threading.BoundedSemaphore(self.threads * 2)
        dispatched = 0
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="fp8convert-prefetch") as pool:
                for file, start, end in self.spans:
                    if file not in fds:
                        fds[file] = os.open(self.root / file, os.O_RDONLY)
                    for offset in range(start, end, self.chunk):
                        length = min(self.chunk, end - offset)
                        with self.cond:
                            self.cond.wait_for(lambda: self.stopped or dispatched - self.consumed < self.window)  # noqa: B023 (called here)
                            if self.stopped:
                                return
                        in_flight.acquire()
                        pool.submit(self._read, fds[file], offset, length).add_done_callback(
                            lambda _: in_flight.release()
                        )
                        dispatched += length
        except OSError:
            return  # the reader will report the problem with the file itself
        finally:
            for fd in [*fds.values(), *([self.sink] if self.sink is not None else [])]:
                os.close(fd)

    def _read(self, fd: int, offset: int, length: int) -> None:
        """sendfile into /dev/null costs a fraction of a pread's CPU time, which a CPU run's quantizing needs."""
        if self.stopped:
            return
        try:
            if self.sink is None or not pull_into_cache(self.sink, fd, offset, length):
                if not hasattr(self.local, "scratch"):
                    self.local.scratch = bytearray(self.chunk)
                os.preadv(fd, [memoryview(self.local.scratch)[:length]], offset)
        except OSError:
            return
        with self.cond:
            self.landed += length


def pull_into_cache(sink: int, fd: int, offset: int, length: int) -> bool:
    """False where sendfile cannot (macOS)."""
    try:
        while length > 0:
            sent = os.sendfile(sink, fd, offset, length)
            if not sent:  # end of file
                break
            offset, length = offset + sent, length - sent
        return True
    except OSError:
        return False
