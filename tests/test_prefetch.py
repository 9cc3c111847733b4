"""The page-cache prefetcher: it reads the spans in order, never more than its window ahead of the
reader."""
from __future__ import annotations

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
