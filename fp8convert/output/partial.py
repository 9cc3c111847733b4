"""Which units of a partial shard are already written, so that a rerun continues inside the shard.

Beside each partial shard OUT/.fp8convert/NAME.partial, NAME.units has a line per unit whose bytes are
fsynced: its label and a CRC-32 of its bytes (a line cut short by a kill is no line). A rerun trusts a
unit only when the file has the planned size and header and the unit's bytes still give its checksum.
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from queue import SimpleQueue

from ..files import fsync_dir, write_atomic
from ..plan.batches import output_runs
from ..plan.plan import Plan, Shard

RECORD_SUFFIX = ".units"
READ_BYTES = 8 << 20


def partial_path(work_dir: Path, shard: Shard) -> Path:
    return Path(work_dir) / (shard.name + ".partial")


def record_path(work_dir: Path, shard: Shard) -> Path:
    return Path(work_dir) / (shard.name + RECORD_SUFFIX)


def unit_spans(plan: Plan, shard: Shard) -> dict[int, list[tuple[int, int]]]:
    """Per unit with outputs in `shard`: its byte ranges in the shard's file, in file order, adjacent ones
    merged (a unit has a range per dtype size: wider dtypes come first in a shard)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for ui in shard.units:
        merged = spans[ui] = []
        for run in output_runs(plan, plan.units[ui].tensors):
            if run.shard != shard.index:
                continue
            if merged and merged[-1][1] == run.start:
                merged[-1] = (merged[-1][0], run.start + run.nbytes)
            else:
                merged.append((run.start, run.start + run.nbytes))
    return spans


def written_bytes(plan: Plan, written: dict[int, set[int]]) -> int:
    return sum(
        end - start
        for index, units in written.items()
        for ui, spans in unit_spans(plan, plan.shards[index]).items()
        if ui in units
        for start, end in spans
    )


def checksum(fd: int, ranges: list[tuple[int, int]]) -> int:
    crc = 0
    for start, end in ranges:
        for at in range(start, end, READ_BYTES):
            data = os.pread(fd, min(READ_BYTES, end - at), at)
            if not data:
                raise OSError(f"{end - at} bytes short")
            crc = zlib.crc32(data, crc)
    return crc


def written_units(plan: Plan, work_dir: Path, shard: Shard) -> set[int]:
    """The units of `shard` that an earlier run recorded as written in its partial file and whose bytes
    there are still the recorded ones; the record is rewritten to hold only those (none: removed)."""
    record = record_path(work_dir, shard)
    try:
        lines = record.read_text(errors="replace").split("\n")[:-1]  # the last one is cut short or empty
    except FileNotFoundError:
        return set()
    spans = unit_spans(plan, shard)
    by_label = {plan.units[ui].label: ui for ui in spans}
    kept: dict[int, str] = {}
    try:
        with open(partial_path(work_dir, shard), "rb") as f:
            fd = f.fileno()
            if os.fstat(fd).st_size == shard.size and os.pread(fd, len(shard.header), 0) == shard.header:
                for line in lines:
                    label, _, crc = line.rpartition(" ")
                    ui = by_label.get(label)
                    if ui is not None and crc == f"{checksum(fd, spans[ui]):08x}":
                        kept[ui] = line
    except OSError:
        kept = {}
    if not kept:
        record.unlink(missing_ok=True)
    elif len(kept) < len(lines):
        write_atomic(record, "".join(line + "\n" for line in kept.values()).encode())
    return set(kept)


class UnitRecorder:
    """Adds a unit's line to its shard's record once the writer has every byte of it in the file, in a
    thread of its own (reading back and fsyncing take time). Failures only lose lines: the rerun writes
    those units again."""

    def __init__(self, plan: Plan, work_dir: Path, spans: dict[int, dict[int, list[tuple[int, int]]]]):
        """`spans`: unit_spans of the shards this run writes."""
        self.plan, self.work_dir, self.spans = plan, Path(work_dir), spans
        self.queue: SimpleQueue = SimpleQueue()
        self.lock = threading.Lock()  # a line is never added once its shard is finished
        self.finished: set[int] = set()
        self.thread = threading.Thread(target=self._run, name="fp8convert-record", daemon=True)

    def unit_written(self, shard: int, unit: int, fd: int) -> None:
        """Every byte of `unit` in `shard` is in the file open as `fd` (duplicated here: the writer may
        close it before the line is written)."""
        self.queue.put((shard, unit, os.dup(fd)))

    def shard_finished(self, shard: int) -> None:
        with self.lock:
            self.finished.add(shard)
            record_path(self.work_dir, self.plan.shards[shard]).unlink(missing_ok=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        """Takes what is queued at once, so that the units one reading-back left waiting share one fsync."""
        stop = False
        while not stop:
            batch = [self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get())
            stop = None in batch
            by_shard: dict[int, list[tuple[int, int]]] = {}
            for shard, unit, fd in filter(None, batch):
                by_shard.setdefault(shard, []).append((unit, fd))
            for shard, units in by_shard.items():
                try:
                    if shard not in self.finished:
                        self._record(self.plan.shards[shard], units)
                except OSError:
                    pass
                finally:
                    for _, fd in units:
                        os.close(fd)

    def _record(self, shard: Shard, units: list[tuple[int, int]]) -> None:
        lines = [f"{self.plan.units[ui].label} {checksum(fd, self.spans[shard.index][ui]):08x}\n" for ui, fd in units]
        getattr(os, "fdatasync", os.fsync)(units[0][1])  # the units' bytes are on disk before the lines that say so
        path = record_path(self.work_dir, shard)
        with self.lock:
            if shard.index in self.finished:
                return
            new = not path.exists()
            with open(path, "ab") as f:
                f.write("".join(lines).encode())
                f.flush()
                os.fsync(f.fileno())
            if new:
                fsync_dir(self.work_dir)
