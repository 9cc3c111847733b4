"""The shard writer's files: every shard created and its blocks reserved at the start of the run, a
full disk reported before the work, the same bytes where a file system cannot reserve, and no stray
partial file for a shard already written."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest
from tiny_ckpt import tree_bytes, write_checkpoint

import fp8convert
from fp8convert.cli import main
from fp8convert.plan.batches import output_runs
from fp8convert.run import writer as writer_module
from fp8convert.run.writer import ShardWriter

SHARD_SIZE = "40KB"  # the tiny checkpoint then makes several output shards


def reserved(path: Path, size: int) -> os.stat_result:
    """A new file at `path`, reserved at `size` bytes; its stat."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        writer_module.reserve(fd, size)
        return os.fstat(fd)
    finally:
        os.close(fd)


def reserves_blocks(directory: Path) -> bool:
    """Whether this file system allocates blocks ahead with fallocate (ext4, xfs and tmpfs do)."""
    st = reserved(directory / "probe", 1 << 20)
    (directory / "probe").unlink()
    return st.st_blocks * 512 >= 1 << 20


def failing_fallocate(error: int):
    """Stands in for libc's fallocate: fails with `error`, as the C call reports it."""

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(error)
        return -1

    return fallocate


def test_reserve_allocates_every_block(tmp_path):
    if not reserves_blocks(tmp_path):
        pytest.skip("this file system does not allocate ahead")
    st = reserved(tmp_path / "f", 5 << 20)
    assert st.st_size == 5 << 20 and st.st_blocks * 512 >= 5 << 20


def test_reserve_leaves_a_sparse_file_where_the_file_system_cannot(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "_fallocate", failing_fallocate(errno.EOPNOTSUPP))
    st = reserved(tmp_path / "f", 5 << 20)
    assert st.st_size == 5 << 20 and st.st_blocks * 512 < 1 << 20


def test_reserve_raises_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "_fallocate", failing_fallocate(errno.ENOSPC))
    with pytest.raises(OSError) as caught:
        reserved(tmp_path / "f", 5 << 20)
    assert caught.value.errno == errno.ENOSPC


def test_every_shard_is_created_and_reserved_at_the_start(tmp_path):
    src = write_checkpoint(tmp_path / "src")
    plan = fp8convert.make_plan(src, max_shard_size=SHARD_SIZE)
    assert len(plan.shards) >= 3
    work = tmp_path / "out" / "work"
    work.mkdir(parents=True)
    with ShardWriter(plan, tmp_path / "out", work, skip_shards={1}) as writer:
        writer.allocator.join()  # nothing was written: the allocator alone made the files
        partials = sorted(p.name for p in work.iterdir())
        for shard in plan.shards:
            if shard.index == 1:
                continue
            path = writer.partial_path(shard.index)
            st = path.stat()
            assert st.st_size == shard.size
            assert path.read_bytes()[: len(shard.header)] == shard.header
            if reserves_blocks(tmp_path):
                assert st.st_blocks * 512 >= shard.size - len(shard.header)
    assert partials == sorted(s.name + ".partial" for s in plan.shards if s.index != 1)  # not the skipped one


def test_a_shard_written_before_the_allocator_reaches_it_is_not_created_again(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    plan = fp8convert.make_plan(src, max_shard_size=SHARD_SIZE)
    work = tmp_path / "out" / "work"
    work.mkdir(parents=True)
    monkeypatch.setattr(writer_module, "PREALLOCATE", False)  # the allocator runs by hand below
    first = plan.shards[0]
    with ShardWriter(plan, tmp_path / "out", work, skip_shards=set()) as writer:
        tensors = [t for t in plan.tensors if plan.shard_of[t.name] == first.index]
        for run in output_runs(plan, tensors):
            writer.write(run, bytes(run.nbytes))
        assert (tmp_path / "out" / first.name).exists() and not writer.partial_path(0).exists()
        writer._create_all()
        assert not writer.partial_path(0).exists()
        assert writer.partial_path(1).exists()


def test_a_full_disk_while_reserving_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """The allocator meets the full disk; the run stops at its next write with the disk-full line
    (the partial shard named, the bytes still needed), and no shard is finished."""
    src = write_checkpoint(tmp_path / "src")

    def full(fd, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module, "reserve", full)
    out = tmp_path / "out"
    rc = main(["quantize", str(src), str(out), "-q", "--device", "cpu", "--max-shard-size", SHARD_SIZE])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert ".safetensors.partial: no space left on the device" in err and "more is needed" in err, err
    assert not list(out.glob("*.safetensors"))


@pytest.mark.parametrize("preallocate, fallocate_works", [(False, True), (True, False)])
def test_same_bytes_with_and_without_reserved_blocks(tmp_path, monkeypatch, preallocate, fallocate_works):
    src = write_checkpoint(tmp_path / "src")
    reference = tmp_path / "reference"
    assert main(["quantize", str(src), str(reference), "-q", "--device", "cpu", "--max-shard-size", SHARD_SIZE]) == 0
    monkeypatch.setattr(writer_module, "PREALLOCATE", preallocate)
    if not fallocate_works:
        monkeypatch.setattr(writer_module, "_fallocate", None)
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "-q", "--device", "cpu", "--max-shard-size", SHARD_SIZE]) == 0
    assert tree_bytes(out) == tree_bytes(reference)


def test_eight_writer_threads_write_the_bytes_of_one(tmp_path, monkeypatch):
    """The GPU's pool of 8 writer threads, each run at its own offset of a shard: the bytes of a single thread."""
    from fp8convert.run import pipeline

    src = write_checkpoint(tmp_path / "src")
    reference = tmp_path / "reference"
    monkeypatch.setattr(pipeline, "io_threads", lambda kind: (1, 1))
    assert main(["quantize", str(src), str(reference), "-q", "--device", "cpu", "--max-shard-size", SHARD_SIZE]) == 0
    monkeypatch.setattr(pipeline, "io_threads", lambda kind: (1, 8))
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "-q", "--device", "cpu", "--max-shard-size", SHARD_SIZE]) == 0
    assert tree_bytes(out) == tree_bytes(reference)


@pytest.mark.parametrize("chunk,expected", [(1 << 10, 9), (64 << 20, 1)])
def test_the_ring_is_pinned_up_front_but_never_beyond_the_bytes_left(tmp_path, monkeypatch, chunk, expected):
    """8 writer threads get a ring of 9 pinned buffers, unless fewer hold everything left to write."""
    import torch

    plain_empty = torch.empty
    pinned = []

    def empty(*args, pin_memory=False, **kwargs):  # this machine may have nothing to pin with
        pinned.append(pin_memory)
        return plain_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(writer_module, "PREALLOCATE", False)
    plan = fp8convert.make_plan(write_checkpoint(tmp_path / "src"), max_shard_size=SHARD_SIZE)
    with ShardWriter(plan, tmp_path / "out", tmp_path, skip_shards=set(), chunk_bytes=chunk, threads=8) as writer:
        assert sum(writer.remaining.values()) > 9 << 10
        writer.pin_ring()
        assert len(writer.ring) == len(pinned) == expected and all(pinned)
        assert all(buf.numel() == chunk for buf, _ in writer.ring)


def writeback_calls(monkeypatch, descriptors: list | None = None) -> list:
    """Stands in for sync_file_range: records (inode, offset, bytes) of every writeback started, and each
    call's file descriptor in `descriptors`."""
    calls = []

    def sync_file_range(fd, offset, nbytes, flags):
        calls.append((os.fstat(fd).st_ino, offset, nbytes))
        if descriptors is not None:
            descriptors.append(fd)
        return 0

    monkeypatch.setattr(writer_module, "_sync_file_range", sync_file_range)
    return calls


def test_the_writer_sends_each_write_to_the_disk_as_it_is_written(tmp_path, monkeypatch):
    calls = writeback_calls(monkeypatch)
    src = write_checkpoint(tmp_path / "src")
    plan = fp8convert.make_plan(src, max_shard_size=SHARD_SIZE)
    work = tmp_path / "out" / "work"
    work.mkdir(parents=True)
    monkeypatch.setattr(writer_module, "PREALLOCATE", False)
    first = plan.shards[0]
    with ShardWriter(plan, tmp_path / "out", work, skip_shards=set()) as writer:
        run = output_runs(plan, [t for t in plan.tensors if plan.shard_of[t.name] == first.index])[0]
        writer.write(run, bytes(run.nbytes))
        inode = os.fstat(writer.fds[first.index]).st_ino
    assert (inode, 0, len(first.header)) in calls and (inode, run.start, run.nbytes) in calls
