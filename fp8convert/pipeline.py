"""The run: read the next batch while the previous one is written; quantize in between.

Three threads with hand-offs of one batch each. Quantizing is fast next to the disk (on a GPU), so
the disk is what stays busy: reads of batch i+1 overlap writes of batch i, and the page-cache
prefetcher keeps reading ahead of both. The device holds at most the batch being read plus
the outputs of the batch being written (a batch is quantized only once the previous one is written),
so device memory stays under about 1.5x the largest batch. On CUDA, host memory is only the readers'
and the writer's fixed pinned chunks; on the CPU the batches themselves live there.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from .plan import Batch, Plan
from .quantizer import quantize_batch, read_order
from .reader import BatchReader
from .writer import ShardWriter


@dataclass
class StageSeconds:
    """Where the main thread's time went: waiting for reads, quantizing, waiting for writes."""

    wait_read: float = 0.0
    quantize: float = 0.0
    wait_write: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 3) for k, v in vars(self).items()}


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def last_use(uses_left: Counter, files: list[str]) -> list[str]:
    """Count one more use of each file; the files no later batch uses."""
    uses_left.subtract(files)
    return [f for f in files if not uses_left[f]]


def run(plan: Plan, batches: list[Batch], reader: BatchReader, writer: ShardWriter, device: torch.device,
        progress, on_read=None, fetcher=None) -> StageSeconds:
    """`on_read(nbytes)` is told after each batch is read; `fetcher` (streamed sources) is asked for a
    batch's files before they are read and told when no later batch needs them."""
    seconds = StageSeconds()
    readers_left = Counter(f for batch in batches for f in batch.files)
    reads_left = readers_left.copy()  # the reader's count; readers_left is the writer's
    scheme = plan.options.scheme
    to_main: queue.Queue = queue.Queue(maxsize=1)
    to_writer: queue.Queue = queue.Queue(maxsize=1)
    read_slot = threading.Semaphore(1)    # one batch being read into device memory at a time
    write_slot = threading.Semaphore(1)   # quantize only once the previous batch is written
    stop = threading.Event()
    writer_error: list[BaseException] = []

    def hand_to_main(item) -> bool:
        while not stop.is_set():
            try:
                to_main.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next_from_reader():
        while True:  # a writer failure must not leave us waiting for a reader that is waiting for us
            try:
                return to_main.get(timeout=0.1)
            except queue.Empty:
                if writer_error:
                    raise writer_error[0]

    def read_loop():
        try:
            for batch in batches:
                while not read_slot.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if fetcher:
                    fetcher.need(batch.files)
                item = (batch, *reader.read([t.source for t in read_order(batch)]))
                if fetcher:
                    fetcher.done_reading(last_use(reads_left, batch.files))
                if on_read:
                    on_read(batch.in_bytes)
                if stop.is_set() or not hand_to_main(item):
                    return
                del item
            hand_to_main(None)
        except BaseException as e:  # handed to the main thread, which raises it
            hand_to_main(_Failed(e))

    def write_loop():
        while True:
            try:
                item = to_writer.get(timeout=0.1)
            except queue.Empty:
                if stop.is_set():  # the run ended (or was interrupted) and nothing is left to write
                    return
                continue
            if item is None or stop.is_set():  # stop is set early only by a failure or an interrupt
                return
            try:
                batch, outputs = item
                del item
                while outputs:  # drop each output as soon as it is written: device memory is freed early
                    name, tensor, at = outputs.pop(0)
                    writer.write(name, tensor, at)
                    del tensor
                progress.advance(batch.in_bytes, batch.label)
                if fetcher:  # source shards no later batch reads can go
                    finished = last_use(readers_left, batch.files)
                    if finished:
                        reader.forget(finished)
                        fetcher.release(finished)
            except BaseException as e:
                writer_error.append(e)
                stop.set()
            finally:
                write_slot.release()

    threads = [threading.Thread(target=read_loop, name="fp8convert-reader", daemon=True),
               threading.Thread(target=write_loop, name="fp8convert-writer", daemon=True)]
    for th in threads:
        th.start()
    try:
        while True:
            t0 = time.monotonic()
            item = next_from_reader()
            seconds.wait_read += time.monotonic() - t0
            if item is None:
                break
            if isinstance(item, _Failed):
                raise item.error
            batch, buf, offsets = item
            del item  # the buffer must be freed as soon as the batch is quantized
            t0 = time.monotonic()
            write_slot.acquire()
            t1 = time.monotonic()
            if writer_error:
                raise writer_error[0]
            outputs = quantize_batch(batch, buf, offsets, scheme)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # outputs ready before another stream reads them
            seconds.wait_write += t1 - t0
            seconds.quantize += time.monotonic() - t1
            if any(t.quantize for t in batch.tensors):  # else the outputs are views of buf
                reader.recycle(buf)
            del buf
            read_slot.release()
            to_writer.put((batch, outputs))
        t0 = time.monotonic()
        write_slot.acquire()  # the last batch is written
        seconds.wait_write += time.monotonic() - t0
        if writer_error:
            raise writer_error[0]
        return seconds
    finally:
        # Every wait in the other threads times out and checks `stop`, so they end even if an interrupt
        # landed inside a queue operation and a notification was lost; the writer finishes the tensor
        # it is writing and then stops (a partial shard is rewritten by the next run).
        stop.set()
        with contextlib.suppress(queue.Full):
            to_writer.put_nowait(None)
        for th in threads:
            th.join()
