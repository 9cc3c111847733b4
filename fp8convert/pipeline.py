"""The run: read the next batch while the current one is quantized and the previous one written.

Three threads with hand-offs of one batch each. The device holds at most the batch being read plus
the outputs of the batch being written (a batch is quantized only once the previous one is written),
so device memory stays under about 1.5x the largest batch; host memory is the readers' and the
writer's pinned chunks (CUDA) or the same buffers (CPU).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from .errors import FP8ConvertError
from .numerics import quantize_group
from .plan import Batch, Plan, TensorPlan
from .reader import BatchReader
from .writer import ShardWriter

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def tensor_view(buf: torch.Tensor, offset: int, t: TensorPlan) -> torch.Tensor:
    info = t.source
    raw = buf[offset:offset + info.nbytes]
    if info.dtype in TORCH_DTYPES:
        return raw.view(TORCH_DTYPES[info.dtype]).view(info.shape)
    return raw  # kept as bytes


def quantize_batch(batch: Batch, buf: torch.Tensor, offsets: dict[str, int], scheme: str
                   ) -> list[tuple[str, torch.Tensor]]:
    """Outputs (name, tensor) for every output tensor of the batch. Kept tensors are copied out of
    `buf` so it can be freed at once, unless the batch keeps everything: then they are views and
    `buf` lives until they are written, which costs no extra memory."""
    all_kept = not any(t.quantize for t in batch.tensors)
    outputs = []
    for atom in batch.atoms:
        if not atom[0].quantize:
            t = atom[0]
            raw = buf[offsets[t.name]:offsets[t.name] + t.source.nbytes]
            outputs.append((t.name, raw if all_kept else raw.clone()))
            continue
        weights = [tensor_view(buf, offsets[t.name], t) for t in atom]
        try:
            codes, scales = quantize_group(weights, scheme)
        except ValueError as e:
            bad = atom[e.args[0]].source
            raise FP8ConvertError(f"{bad.file}: tensor {bad.name} contains NaN or Inf; refusing to quantize it") from None
        for t, q, s in zip(atom, codes, scales):
            outputs += [(t.name, q), (t.scale_name, s)]
    return outputs


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


def run(plan: Plan, batches: list[Batch], reader: BatchReader, writer: ShardWriter, device: torch.device,
        progress, on_read=None) -> StageSeconds:
    seconds = StageSeconds()
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

    def read_loop():
        try:
            for batch in batches:
                while not read_slot.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                item = (batch, *reader.read([t.source for t in batch.tensors]))
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
            item = to_writer.get()
            if item is None:
                return
            try:
                batch, outputs = item
                del item
                while outputs:  # drop each output as soon as it is written: device memory is freed early
                    name, tensor = outputs.pop(0)
                    writer.write(name, tensor)
                    del tensor
                progress.advance(batch.in_bytes, batch.label)
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
            item = to_main.get()
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
        stop.set()
        to_writer.put(None)  # the writer finishes what it holds, then stops
        for th in threads:
            th.join()
