"""The run: a reader thread starts each batch's reads, the main thread quantizes each stack as its bytes
land, a writer thread writes each output's bytes at its place in the shards. Hand-offs hold one batch each:
the device holds at most the batch being read plus the outputs of the batch being written.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from ..plan.batches import Batch, Run, make_batches, output_runs
from ..plan.plan import Plan, Unit
from .device import budget_for, cpu_threads_for_quantizing, io_threads, resolve_device
from .progress import Progress
from .quantizer import quantize_steps, read_order
from .reader import BatchReader, PendingRead
from .writer import ShardWriter

# Batches read and not yet quantized, and batches quantized ahead of the writer.
READ_AHEAD = 1
WRITE_AHEAD = 1
END = object()  # the last item of a batch's feed of runs to the writer
# Every wait between the threads wakes this often to check the run's stop event, so a thread ends even when
# an interrupt landed inside a queue operation and a notification was lost.
POLL_S = 0.1
STOPPED = object()  # what get_unless_stopped returns once the run stopped with nothing to take


def get_unless_stopped(handoff: queue.Queue, stop: threading.Event):
    while True:
        with contextlib.suppress(queue.Empty):
            return handoff.get(timeout=POLL_S)
        if stop.is_set():
            return STOPPED


class BatchOutput:
    """A batch's output runs, each handed over with its bytes (the output tensor's own memory, no copy)."""

    def __init__(self, runs: list[Run]):
        self.left = {(run.name, run.at): run for run in runs}

    def put_all(self, outputs: list[tuple[str, torch.Tensor, int]]) -> list[tuple[Run, torch.Tensor]]:
        done = []
        for name, tensor, at in outputs:
            run = self.left.pop((name, at))
            raw = (tensor.contiguous().view(-1) if tensor.numel() else tensor.reshape(0)).view(torch.uint8)
            if raw.numel() != run.nbytes:
                raise AssertionError(f"{name}: {raw.numel()} bytes at {at}, the plan says {run.nbytes}")
            done.append((run, raw))
        return done

    def check_complete(self) -> None:
        if self.left:
            raise AssertionError(f"{len(self.left)} outputs of the batch were never produced")


def convert(
    plan: Plan,
    units: list[Unit],
    writer: ShardWriter,
    device: str,
    max_resident: int | None,
    fetcher,
    progress: Progress,
    *,
    on_read: Callable[[int], None] = lambda nbytes: None,
    started: float | None = None,
) -> tuple[dict, str, int | None]:
    """(stage seconds, device, peak device bytes or None). `fetcher` brings streamed source shards;
    `on_read(nbytes)` is told after each batch is read."""
    started = time.monotonic() if started is None else started
    dev = resolve_device(device)
    torch.empty(1, device=dev)  # start CUDA now, so its cost shows in "startup", not in the first batch
    torch_ready = time.monotonic()
    budget = budget_for(dev, max_resident)
    batches = make_batches(units, budget)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    readers, writers = io_threads(dev.type)
    writer.threads = writers
    try:
        with (
            BatchReader(plan.source.root, dev, threads=readers) as reader,
            cpu_threads_for_quantizing() if dev.type == "cpu" else contextlib.nullcontext(),
        ):
            seconds = Pipeline(plan, batches, reader, writer, progress, fetcher, on_read).run()
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget  # the CLI suggests a smaller --max-resident than this
        raise
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    seconds = {
        "torch_ready_at": round(torch_ready - started, 3),
        **{k: round(v, 3) for k, v in seconds.items()},
        "pipeline": round(time.monotonic() - torch_ready, 3),
    }
    return seconds, str(dev), peak


def last_use(uses_left: Counter, files: list[str]) -> list[str]:
    """Count one more use of each file; the files no later batch uses (a streamed source deletes them)."""
    uses_left.subtract(files)
    return [f for f in files if not uses_left[f]]


class Pipeline:
    def __init__(
        self, plan: Plan, batches: list[Batch], reader: BatchReader, writer: ShardWriter, progress, fetcher, on_read
    ):
        self.plan, self.batches, self.reader, self.writer = plan, batches, reader, writer
        self.device = reader.device
        self.progress, self.fetcher, self.on_read = progress, fetcher, on_read
        self.seconds = {"wait_read": 0.0, "quantize": 0.0, "wait_write": 0.0}
        self.reads_left = Counter(f for batch in batches for f in batch.files)  # the reader's count
        self.writes_left = self.reads_left.copy()  # the writer's count
        self.to_main: queue.Queue = queue.Queue()
        self.to_writer: queue.Queue = queue.Queue()
        self.read_slot = threading.Semaphore(READ_AHEAD)
        self.write_slot = threading.Semaphore(WRITE_AHEAD)
        self.stop = threading.Event()
        self.writer_error: BaseException | None = None

    def run(self) -> dict[str, float]:
        threads = [
            threading.Thread(target=loop, name=f"fp8convert-{name}", daemon=True)
            for loop, name in ((self._read_loop, "reader"), (self._write_loop, "writer"))
        ]
        for th in threads:
            th.start()
        try:
            while (item := self._next_read()) is not None:
                batch, pending, runs = item
                del item  # the buffer must be freed as soon as the batch is quantized
                self._quantize(batch, pending, runs)
                del pending
                self.read_slot.release()
            for _ in range(WRITE_AHEAD):  # every batch is written
                self._wait_for_writer()
            return self.seconds
        finally:
            # the other threads see `stop` within POLL_S; the writer finishes the tensor it is writing first
            self.stop.set()
            self.to_writer.put(None)
            for th in threads:
                th.join()

    def _next_read(self):
        """(batch, PendingRead, output runs) of the next batch whose reads have started; None after the last."""
        t0 = time.monotonic()
        # a writer failure (which sets `stop`) must not leave us waiting for a reader that is waiting for us
        item = get_unless_stopped(self.to_main, self.stop)
        self.seconds["wait_read"] += time.monotonic() - t0
        if item is STOPPED:
            self._raise_writer_error()
        if isinstance(item, BaseException):  # the reader's failure
            raise item
        return item

    def _quantize(self, batch: Batch, pending: PendingRead, runs: list[Run]) -> None:
        self._wait_for_writer()
        feed: queue.Queue = queue.Queue()  # (run, bytes, CUDA event after which they are ready); END last
        self.to_writer.put((batch, feed))
        t0 = time.monotonic()
        assembled = BatchOutput(runs)
        keep_buf = False  # whether a run's bytes are a view of the read buffer (which then lives until written)
        buf_ptr = pending.buf.untyped_storage().data_ptr()
        for outputs in quantize_steps(
            batch,
            pending.buf,
            pending.offsets,
            scale_format=self.plan.options.scale_format,
            source_scheme=self.plan.source_scheme,
            root=self.reader.root,
            pending=pending,
        ):
            self._raise_writer_error()
            completed = assembled.put_all(outputs)
            ready = None
            if self.device.type == "cuda":  # the writer's stream waits for this point of ours
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            for run, data in completed:
                keep_buf = keep_buf or (bool(data.numel()) and data.untyped_storage().data_ptr() == buf_ptr)
                feed.put((run, data, ready))
            del completed, outputs  # the writer drops each run once written: nothing else may hold it
        assembled.check_complete()
        pending.wait_all()  # (every step waited for its inputs: this only raises what a read left behind)
        if self.device.type == "cuda":
            # The next batch's reads (on other streams) may reuse this buffer's memory once it is freed.
            torch.cuda.current_stream(self.device).synchronize()
        feed.put(END)
        self.seconds["wait_read"] += pending.waited
        self.seconds["quantize"] += time.monotonic() - t0 - pending.waited
        if not keep_buf:  # else buf lives until those bytes are written
            self.reader.recycle(pending.buf)

    def _wait_for_writer(self) -> None:
        t0 = time.monotonic()
        self.write_slot.acquire()
        self.seconds["wait_write"] += time.monotonic() - t0
        self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        if self.writer_error is not None:
            raise self.writer_error

    def _read_loop(self) -> None:
        try:
            for batch in self.batches:
                # Worked out before waiting for room, so while the batch before is quantized.
                order = read_order(batch)
                runs = output_runs(self.plan, batch.tensors)
                while not self.read_slot.acquire(timeout=POLL_S):
                    if self.stop.is_set():
                        return
                self.fetcher.need(batch.files)
                pending = self.reader.start(order)
                if self.stop.is_set():
                    return
                self.to_main.put((batch, pending, runs))
                pending.wait_all()  # (a failed read is raised by the main thread's wait too)
                del pending
                self.fetcher.done_reading(last_use(self.reads_left, batch.files))
                self.on_read(batch.in_bytes)
            self.to_main.put(None)
        except BaseException as e:  # handed to the main thread, which raises it
            self.to_main.put(e)

    def _write_loop(self) -> None:
        try:
            if self.device.type == "cuda":
                self.writer.pin_ring()
        except BaseException as e:  # the run stops; the main thread raises it at its next wait
            self.writer_error = e
            self.stop.set()
            return
        while True:
            item = get_unless_stopped(self.to_writer, self.stop)
            # STOPPED: the run ended with nothing left; None or `stop`: a failure or an interrupt
            if item is STOPPED or item is None or self.stop.is_set():
                return
            try:
                batch, feed = item
                del item
                # a batch's runs as they come, each dropped once written
                while (item := get_unless_stopped(feed, self.stop)) is not END:
                    if item is STOPPED:
                        return
                    run, data, ready = item
                    del item
                    self.writer.write(run, data, ready=ready)
                    del data
                self.progress.advance(batch.in_bytes, batch.label)
                finished = last_use(self.writes_left, batch.files)  # source files no later batch reads
                if finished:
                    self.reader.forget(finished)
                    self.fetcher.release(finished)
            except BaseException as e:
                self.writer_error = e
                self.stop.set()
            finally:
                self.write_slot.release()
