"""The page-cache prefetcher: it reads the spans in order, never more than its window ahead of the
reader, into the page cache without copying them (or by pread where it cannot)."""
from __future__ import annotations

import errno
import os
import threading
import time

from fp8convert.run.prefetch import Prefetcher
from fp8convert.safetensors_io import TensorInfo

CHUNK = 1 << 16


def source(tmp_path, chunks: int) -> list[TensorInfo]:
    (tmp_path / "a.safetensors").write_bytes(bytes(chunks * CHUNK))
    return [TensorInfo(f"t{i}", "U8", (CHUNK,), "a.safetensors", i * CHUNK, CHUNK) for i in range(chunks)]


class Recorder:
    """Stands in for the prefetcher's pread: records each read and how many ran at once."""

    def __init__(self, seconds: float):
        self.seconds, self.lock = seconds, threading.Lock()
        self.running, self.offsets, self.concurrency = 0, [], []

    def __call__(self, fd: int, offset: int, length: int) -> None:
        with self.lock:
            self.running += 1
            self.offsets.append(offset)
            self.concurrency.append(self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_never_more_than_the_window_ahead_of_the_reader(tmp_path, monkeypatch):
    recorder = Recorder(0.0)
    prefetcher = Prefetcher(tmp_path, source(tmp_path, 20), window_bytes=3 * CHUNK, threads=2, chunk_bytes=CHUNK)
    monkeypatch.setattr(prefetcher, "_read", recorder)
    with prefetcher:
        wait_until(lambda: len(recorder.offsets) == 3)
        time.sleep(0.2)
        assert len(recorder.offsets) == 3
        prefetcher.advance(2 * CHUNK)
        wait_until(lambda: len(recorder.offsets) == 5)
        time.sleep(0.2)
        assert len(recorder.offsets) == 5
    assert sorted(recorder.offsets) == [i * CHUNK for i in range(5)]


def covered(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) calls as the merged byte ranges they cover."""
    ranges: list[list[int]] = []
    for offset, length in sorted(calls):
        if ranges and ranges[-1][1] >= offset:
            ranges[-1][1] = max(ranges[-1][1], offset + length)
        else:
            ranges.append([offset, offset + length])
    return [tuple(r) for r in ranges]


def run_to_the_end(tmp_path, chunks: int) -> None:
    prefetcher = Prefetcher(tmp_path, source(tmp_path, chunks), window_bytes=1 << 30, threads=2, chunk_bytes=4 * CHUNK)
    with prefetcher:
        prefetcher.thread.join(timeout=10)  # the dispatcher ends once every read is done
        assert not prefetcher.thread.is_alive()


def test_pages_are_pulled_into_the_cache_without_a_copy(tmp_path, monkeypatch):
    """Every byte goes through sendfile (into /dev/null), none through a pread into a buffer."""
    sent, real_sendfile = [], os.sendfile
    lock = threading.Lock()

    def sendfile(out_fd, in_fd, offset, count):
        assert os.readlink(f"/proc/self/fd/{out_fd}") == os.devnull
        n = real_sendfile(out_fd, in_fd, offset, min(count, CHUNK))  # short sends happen: they must be resumed
        with lock:
            sent.append((offset, n))
        return n

    def preadv(*args):
        raise AssertionError("a pread copied bytes that sendfile could pull")

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "preadv", preadv)
    run_to_the_end(tmp_path, 10)
    assert covered(sent) == [(0, 10 * CHUNK)]


def test_where_sendfile_is_refused_the_prefetcher_preads(tmp_path, monkeypatch):
    read = []

    def sendfile(out_fd, in_fd, offset, count):
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")  # macOS: sendfile needs a socket

    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        read.append((offset, n))
        return n

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "preadv", preadv)
    run_to_the_end(tmp_path, 10)
    assert covered(read) == [(0, 10 * CHUNK)]
