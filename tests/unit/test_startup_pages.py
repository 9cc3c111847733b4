"""torch's start-up pages: recorded from this process's page table, asked of the kernel by the next run."""

from __future__ import annotations

import json
import mmap
import os
import sys

import torch
from tiny_ckpt import llama_tensors, write_checkpoint

from fp8convert.run import warmup
from fp8convert.run.warmup import PAGE, mapped_library_pages, page_ranges, read_ahead, record_path


def test_close_pages_make_one_range_and_far_ones_another():
    pages = torch.tensor([3, 4, 5, 20, 60, 61])  # 20 is 15 pages after 5, 60 is 40 after 20
    assert page_ranges(pages) == [[3 * PAGE, 21 * PAGE], [60 * PAGE, 62 * PAGE]]
    assert page_ranges(torch.tensor([7])) == [[7 * PAGE, 8 * PAGE]]
    assert page_ranges(torch.tensor([], dtype=torch.int64)) == []


def test_the_record_holds_the_pages_a_mapped_library_touched_and_no_others(tmp_path):
    lib, data = tmp_path / "libfake.so.1", tmp_path / "weights.bin"
    for path in (lib, data):
        path.write_bytes(os.urandom(4096 * PAGE))
    with open(lib, "rb") as f, open(data, "rb") as g:
        lib_map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        data_map = mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ)
        try:
            lib_map[5 * PAGE], lib_map[3000 * PAGE], data_map[0]  # touched: faulted into the page table
            entries = {path: rest for path, *rest in mapped_library_pages()}
        finally:
            lib_map.close()
            data_map.close()
    assert str(data) not in entries  # not a library
    size, mtime_ns, ranges = entries[str(lib)]
    assert (size, mtime_ns) == (lib.stat().st_size, lib.stat().st_mtime_ns)

    def covered(page: int) -> bool:
        return any(start <= page * PAGE < end for start, end in ranges)

    # The kernel maps some neighbours of a touched page too (fault-around; a whole large folio of the
    # page cache, 2 MiB at most)
    assert covered(5) and covered(3000)
    assert not covered(1500) and not covered(4000)
    assert all(start % PAGE == 0 and end % PAGE == 0 and end <= size for start, end in ranges)


def test_read_ahead_asks_for_the_ranges_of_unchanged_files_only(tmp_path, monkeypatch):
    same, changed = tmp_path / "libsame.so", tmp_path / "libchanged.so"
    for path in (same, changed):
        path.write_bytes(bytes(64 * PAGE))
    entries = [
        [str(p), p.stat().st_size, p.stat().st_mtime_ns, [[0, PAGE], [8 * PAGE, 16 * PAGE]]] for p in (same, changed)
    ]
    entries.append([str(tmp_path / "libgone.so"), PAGE, 0, [[0, PAGE]]])
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"files": entries}))
    changed.write_bytes(bytes(65 * PAGE))  # after the record: stale
    asked = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    assert read_ahead(record).wait(30)
    assert sorted(asked) == [
        (str(same), 0, PAGE, os.POSIX_FADV_WILLNEED),
        (str(same), 8 * PAGE, 8 * PAGE, os.POSIX_FADV_WILLNEED),
    ]


def test_a_long_range_is_asked_for_in_pieces_the_kernel_reads_whole(tmp_path, monkeypatch):
    # One POSIX_FADV_WILLNEED reads at most the device's read-ahead size (128 KiB by default); the rest of
    # a longer range would be dropped.
    lib = tmp_path / "libbig.so"
    lib.write_bytes(bytes(1024 * PAGE))
    start, end = 3 * PAGE, 3 * PAGE + 2 * warmup.ASK_BYTES + 5 * PAGE
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"files": [[str(lib), lib.stat().st_size, lib.stat().st_mtime_ns, [[start, end]]]]}))
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append((offset, length)))
    assert read_ahead(record).wait(30)
    assert all(length <= warmup.ASK_BYTES for _, length in asked)
    covered = sorted(asked)
    assert covered[0][0] == start and sum(length for _, length in covered) == end - start
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))  # no gap, no overlap


def test_no_record_or_a_bad_one_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (_ for _ in ()).throw(AssertionError("asked")))
    bad = tmp_path / "bad.json"
    for text in ("not json", '{"files": 3}', '{"files": [["/x", "y"]]}', '{"other": []}'):
        bad.write_text(text)
        assert read_ahead(bad).wait(30)
    assert read_ahead(tmp_path / "none.json").wait(30)
    assert read_ahead(None).is_set()


def test_the_record_lives_in_the_users_cache_per_environment_and_device(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu, cuda = record_path("cpu"), record_path("cuda")
    assert cpu.parent == tmp_path / "fp8convert" and cpu != cuda
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert record_path("cpu") != cpu


def test_a_record_that_cannot_be_written_is_skipped(tmp_path):
    (tmp_path / "fp8convert").write_text("a file where the directory would go")
    warmup.record(tmp_path / "fp8convert" / "record.json")  # no error
    warmup.record(None)


def test_no_record_when_torch_was_loaded_before(tmp_path, monkeypatch):
    """The Python API in a process that imported torch itself: its pages are the caller's business."""
    import fp8convert

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False)
    assert not (tmp_path / "cache").exists()
