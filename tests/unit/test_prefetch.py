"""The page-cache prefetcher: it reads the spans in order, never more than its window ahead of the
reader, into the page cache without copying them (or by pread where it cannot); the window's default
follows the memory the process may use."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
from tiny_ckpt import llama_tensors, write_checkpoint

import fp8convert
from fp8convert.cluster.workers import WorkerSpec
from fp8convert.errors import FP8ConvertError
from fp8convert.options import AUTO, Settings
from fp8convert.run import prefetch
from fp8convert.run.prefetch import WINDOW_CAP, Prefetcher, available_memory, default_window
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


def run_to_the_end(tmp_path, chunks: int) -> Prefetcher:
    prefetcher = Prefetcher(tmp_path, source(tmp_path, chunks), window_bytes=1 << 30, threads=2, chunk_bytes=4 * CHUNK)
    with prefetcher:
        prefetcher.thread.join(timeout=10)  # the dispatcher ends once every read is done
        assert not prefetcher.thread.is_alive()
    return prefetcher


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
    assert run_to_the_end(tmp_path, 10).landed == 10 * CHUNK
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
    assert run_to_the_end(tmp_path, 10).landed == 10 * CHUNK
    assert covered(read) == [(0, 10 * CHUNK)]


def test_what_has_landed_stays_one_window_ahead_of_what_the_run_consumed(tmp_path):
    prefetcher = Prefetcher(tmp_path, source(tmp_path, 10), window_bytes=4 * CHUNK, threads=2, chunk_bytes=CHUNK)

    def ahead():  # bytes whose reads have returned and that nothing has consumed yet
        with prefetcher.cond:
            return prefetcher.landed - prefetcher.consumed

    assert ahead() == 0
    with prefetcher:
        wait_until(lambda: ahead() == 4 * CHUNK)  # the window is full: nothing more is read
        prefetcher.advance(3 * CHUNK)
        assert ahead() <= 4 * CHUNK
        wait_until(lambda: ahead() == 4 * CHUNK)  # three more chunks read
        prefetcher.advance(7 * CHUNK)
        wait_until(lambda: prefetcher.landed == 10 * CHUNK)
        assert ahead() == 0


def test_a_read_that_fails_lands_nothing(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "sendfile", fail)
    monkeypatch.setattr(os, "preadv", fail)
    prefetcher = run_to_the_end(tmp_path, 3)
    assert prefetcher.landed == 0


GiB = 1 << 30


def fake_system(tmp_path, available_kib: int, groups: dict[str, tuple], own: str = "/job/step"):
    """A /proc/meminfo, /proc/self/cgroup and cgroup v2 tree: `groups` maps a path under the root to its
    (memory.max, memory.current) or (memory.max, memory.current, inactive file bytes in memory.stat)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kib} kB\n")
    (tmp_path / "self-cgroup").write_text(f"0::{own}\n")
    root = tmp_path / "cgroup"
    for path, (limit, current, *inactive) in groups.items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "memory.max").write_text(limit + "\n")
        (root / path / "memory.current").write_text(f"{current}\n")
        if inactive:
            stat = f"anon 1000\nfile 99\ninactive_file {inactive[0]}\nactive_file 5\n"
            (root / path / "memory.stat").write_text(stat)
    return dict(meminfo=tmp_path / "meminfo", cgroups=root, own_cgroup=tmp_path / "self-cgroup")


def test_available_memory_is_memavailable_or_the_tightest_cgroup_headroom(tmp_path):
    unlimited = fake_system(tmp_path / "a", 10 * 1024 * 1024, {"job": ("max", 5 * GiB), "job/step": ("max", GiB)})
    assert available_memory(**unlimited) == 10 * GiB
    # the job's limit (8 GiB, 5 used) is tighter than the step's (20 GiB, 1 used) and than MemAvailable
    capped = fake_system(
        tmp_path / "b",
        10 * 1024 * 1024,
        {"": ("max", 0), "job": (str(8 * GiB), 5 * GiB), "job/step": (str(20 * GiB), GiB)},
    )
    assert available_memory(**capped) == 3 * GiB
    over = fake_system(tmp_path / "c", 10 * 1024 * 1024, {"job/step": (str(GiB), 2 * GiB)})
    assert available_memory(**over) == 0
    # a job that has just downloaded its checkpoint: 7 of its 8 GiB are inactive file pages, reclaimed first
    cached = fake_system(tmp_path / "e", 10 * 1024 * 1024, {"job": (str(8 * GiB), 8 * GiB, 7 * GiB)})
    assert available_memory(**cached) == 7 * GiB
    no_cgroup = fake_system(tmp_path / "d", 4 * 1024 * 1024, {}, own="/gone")
    assert available_memory(**no_cgroup) == 4 * GiB
    assert available_memory(meminfo=tmp_path / "missing", cgroups=tmp_path, own_cgroup=tmp_path / "x") is None


def test_available_memory_reads_cgroup_v1s_memory_controller(tmp_path):
    """Hybrid hosts: the memory limit lives in v1's memory controller; v1 says "no limit" with a number
    near 2^63; where the process's path is not mounted (inside a container), the mount's root counts."""
    (tmp_path / "meminfo").write_text("MemAvailable:   10485760 kB\n")  # 10 GiB
    (tmp_path / "self-cgroup").write_text("12:pids:/x\n4:cpu,memory:/slurm/job1\n0::/\n")
    v1 = tmp_path / "cgroup" / "memory"
    for path, limit, usage, inactive in [("", 9223372036854771712, GiB, 0), ("slurm/job1", 6 * GiB, 5 * GiB, 2 * GiB)]:
        (v1 / path).mkdir(parents=True, exist_ok=True)
        (v1 / path / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (v1 / path / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (v1 / path / "memory.stat").write_text(f"cache 5\ninactive_file 1\ntotal_inactive_file {inactive}\n")
    where = dict(meminfo=tmp_path / "meminfo", cgroups=tmp_path / "cgroup", own_cgroup=tmp_path / "self-cgroup")
    assert available_memory(**where) == 3 * GiB  # 6 GiB less 5 used, 2 of them inactive file pages
    (tmp_path / "self-cgroup").write_text("4:memory:/kubepods/pod7\n")  # a path this mount does not show
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    assert available_memory(**where) == 3 * GiB  # the mount's root: 4 GiB less 1 used


def test_the_default_window_is_half_the_available_memory_shared_by_workers_and_capped():
    assert default_window(1, available=24 * GiB) == 12 * GiB
    assert default_window(3, available=24 * GiB) == 4 * GiB
    assert default_window(1, available=512 * GiB) == WINDOW_CAP == 32 * GiB
    assert default_window(1, available=0) == 0  # nothing to spare: no read-ahead at all


def test_prefetch_option_reads_auto_sizes_and_zero():
    assert Settings().prefetch == AUTO
    assert Settings(prefetch="AUTO").prefetch == AUTO
    assert Settings(prefetch="0").prefetch == 0
    assert Settings(prefetch="1GiB").prefetch == GiB
    with pytest.raises(FP8ConvertError, match="^prefetch: cannot read .lots."):
        Settings(prefetch="lots")


@pytest.mark.parametrize(
    "overrides,window",
    [
        ({}, 3 * GiB),
        ({"worker": "0/2"}, 3 * GiB // 2),
        ({"prefetch": "5MiB"}, 5 << 20),
        ({"worker": WorkerSpec(0, 4, "slurm-array", on_this_machine=1)}, 3 * GiB),  # its own allocation
        ({"worker": WorkerSpec(0, 32, "slurm", on_this_machine=2)}, 3 * GiB // 2),
    ],
)  # two srun tasks on this node
def test_a_conversion_reads_ahead_by_the_window_it_was_given_or_the_default(tmp_path, monkeypatch, overrides, window):
    monkeypatch.setattr(prefetch, "available_memory", lambda: 6 * GiB)
    windows, real_init = [], Prefetcher.__init__

    def init(self, root, tensors, window_bytes, *args, **kwargs):
        windows.append(window_bytes)
        real_init(self, root, tensors, window_bytes, *args, **kwargs)

    monkeypatch.setattr(Prefetcher, "__init__", init)
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False, **overrides)
    assert windows and set(windows) == {window}
