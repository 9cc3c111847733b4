#!/usr/bin/env python3
"""What this machine's I/O gives one process, for reading fp8convert's numbers against.

In 32 MB pieces, with 1..N threads:
  memory copy    from each thread's buffer into one large buffer already in memory: the host's own
                 bandwidth, which page-cache reads and tmpfs writes share;
  pread          a file already in the page cache (read once first), into reusable buffers;
  pwrite         into one file, sparse (ftruncate) or with its blocks reserved first (fallocate) and each
                 piece's writeback started as fp8convert's writer does, and into one file per thread;
  O_DIRECT       (--direct) pwrites into one reserved file, bypassing the page cache;
  H2D / D2H      (--cuda) copies between pinned host buffers and the GPU, one stream per thread.
Writes go to OUT_DIR (tmpfs for the pipeline's ceiling, a disk directory for a disk); on a disk each
write line also gives the fsync that follows. GB/s are of the bytes moved, before the fsync.

    python3 scripts/io_limits.py SOME_SHARD.safetensors /dev/shm --cuda
    python3 scripts/io_limits.py SOME_SHARD.safetensors /var/tmp/io --threads 1,4 --direct
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8convert.run.writer import start_writeback  # noqa: E402

CHUNK = 32 << 20
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def buffers(n: int, cuda: bool) -> list[memoryview]:
    """Page-aligned buffers (O_DIRECT needs that): anonymous mmaps, or pinned tensors with --cuda."""
    if cuda:
        import torch

        return [memoryview(torch.full((CHUNK,), 7, dtype=torch.uint8).pin_memory().numpy()) for _ in range(n)]
    bufs = []
    for _ in range(n):
        m = mmap.mmap(-1, CHUNK)
        m.write(b"\x07" * CHUNK)
        bufs.append(memoryview(m))
    return bufs


def in_threads(n: int, jobs: list, work, cuda: bool) -> float:
    """Run work(buffer, *job) over the jobs with n threads, each owning one buffer; seconds taken."""
    bufs, lock, todo = buffers(n, cuda), threading.Lock(), iter(jobs)

    def worker(k: int) -> None:
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            work(bufs[k], *job)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(worker, range(n)))
    return time.perf_counter() - t0


def line(what: str, n: int, nbytes: int, seconds: float, extra: str = "") -> None:
    print(f"{what:<34} {n:2d} threads: {nbytes / seconds / 1e9:6.2f} GB/s ({seconds:.2f} s{extra})", flush=True)


def reserve(fd: int, size: int) -> None:
    if libc.fallocate(fd, 0, 0, size) != 0:
        raise OSError(ctypes.get_errno(), "fallocate failed")


def pwrite_then_writeback(fd: int, buf, offset: int) -> None:
    """A piece as fp8convert's writer writes it: pwrite, then its writeback started."""
    os.pwrite(fd, buf, offset)
    start_writeback(fd, offset, buf.nbytes)


def memory_copy_test(n: int, size: int, cuda: bool) -> None:
    target = mmap.mmap(-1, size)
    zeros = b"\x00" * CHUNK
    for _ in range(size // CHUNK):  # its pages faulted in first: only the copies are timed
        target.write(zeros)
    base = ctypes.addressof(ctypes.c_char.from_buffer(target))
    jobs = [(offset,) for offset in range(0, size, CHUNK)]

    def copy(buf, offset: int) -> None:
        ctypes.memmove(base + offset, ctypes.addressof(ctypes.c_char.from_buffer(buf)), CHUNK)  # GIL released

    line("memory copy", n, size, in_threads(n, jobs, copy, cuda))
    target.close()


def write_test(
    out: Path,
    what: str,
    n: int,
    files: int,
    size: int,
    reserved: bool,
    cuda: bool,
    direct: bool = False,
) -> None:
    per_file = size // files // CHUNK * CHUNK
    paths = [out / f"io_limits.{i}" for i in range(files)]
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fds = [os.open(p, flags, 0o644) for p in paths]
    try:
        for fd in fds:
            reserve(fd, per_file) if reserved else os.ftruncate(fd, per_file)
        jobs = [(fds[i % files], (i // files) * CHUNK) for i in range(files * (per_file // CHUNK))]
        write = (lambda fd, buf, offset: os.pwrite(fd, buf, offset)) if direct else pwrite_then_writeback
        seconds = in_threads(n, jobs, lambda buf, fd, offset: write(fd, buf, offset), cuda)
        t0 = time.perf_counter()
        for fd in fds:
            os.fsync(fd)
        line(what, n, per_file * files, seconds, f", then fsync {time.perf_counter() - t0:.2f} s")
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            p.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a file to read from the page cache (1 GB or more)")
    ap.add_argument("out", type=Path, help="where the writes go")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--gb", type=float, default=4.0, help="bytes written per test (default 4 GB)")
    ap.add_argument("--cuda", action="store_true", help="pinned buffers, and the H2D / D2H copies")
    ap.add_argument("--direct", action="store_true", help="also O_DIRECT writes into one reserved file")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    size = int(args.gb * 1e9) // CHUNK * CHUNK
    args.out.mkdir(parents=True, exist_ok=True)

    src_size = os.path.getsize(args.src) // CHUNK * CHUNK
    with open(args.src, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    fd = os.open(args.src, os.O_RDONLY)
    for n in threads:
        memory_copy_test(n, size, args.cuda)
    for n in threads:
        jobs = [(offset,) for offset in range(0, src_size, CHUNK)]
        line("pread, page cache", n, src_size, in_threads(n, jobs, lambda b, o: os.preadv(fd, [b], o), args.cuda))
    os.close(fd)
    for n in threads:
        write_test(args.out, "pwrite, 1 file, sparse", n, 1, size, False, args.cuda)
        write_test(args.out, "pwrite, 1 file, reserved", n, 1, size, True, args.cuda)
        write_test(args.out, f"pwrite, {n} files, sparse", n, n, size, False, args.cuda)
        if args.direct:
            write_test(args.out, "O_DIRECT pwrite, 1 file, reserved", n, 1, size, True, args.cuda, direct=True)
    if args.cuda:
        import torch

        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        for n in threads:
            streams = [torch.cuda.Stream() for _ in range(n)]
            pinned = [torch.empty(CHUNK, dtype=torch.uint8).pin_memory() for _ in range(n)]
            for what, to_device in (("H2D, pinned, sync per 32 MB", True), ("D2H, pinned, sync per 32 MB", False)):

                def copy(k: int, n=n, streams=streams, pinned=pinned, to_device=to_device) -> None:
                    for offset in range(k * CHUNK, size, n * CHUNK):
                        with torch.cuda.stream(streams[k]):
                            dst, src = (
                                (device[offset : offset + CHUNK], pinned[k])
                                if to_device
                                else (pinned[k], device[offset : offset + CHUNK])
                            )
                            dst.copy_(src, non_blocking=True)
                        streams[k].synchronize()

                t0 = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    list(pool.map(copy, range(n)))
                line(what, n, size, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
