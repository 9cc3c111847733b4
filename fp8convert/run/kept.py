"""Kept tensors copied byte for byte, without torch, while torch is still loading.

Tensors that stay in high precision (embeddings, heads, norms, routers...) need no device: a thread
reads them, checks their bit patterns for NaN/Inf with numpy, and writes them to their planned place.
So are an FP8 source's weights that pass through (codes without NaN, scales finite and positive, and
powers of two into a --scale-format ue8m0 output).
It starts with the run, so the disk writes while torch and CUDA load (seconds), and the device never
holds them (an embedding can be gigabytes). Streamed sources, whose shards arrive only as the pipeline
asks for them, leave kept tensors to the pipeline.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import FP8ConvertError
from ..plan.plan import Action, Plan, TensorPlan
from ..plan.runs import Run, output_runs
from ..safetensors_io import FLOAT_SOURCE_DTYPES, FP8, SourceFiles, TensorInfo, pread_into
from .writer import ShardWriter

CHUNK_BYTES = 16 << 20
# An IEEE float is NaN or Inf exactly when every exponent bit is set.
EXPONENT_BITS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000)}


def has_non_finite(raw: np.ndarray, dtype: str) -> bool:
    """Whether the bytes `raw` (uint8, whole elements) of a float tensor hold a NaN or an Inf."""
    kind, mask = EXPONENT_BITS[dtype]
    return bool(np.any(np.bitwise_and(raw.view(kind), kind(mask)) == mask))


def finite_positive(raw: np.ndarray, dtype: str) -> bool:
    """Whether every float in `raw` (uint8, whole elements) is finite and > 0: no exponent of all ones,
    no sign bit, no zero."""
    kind, mask = EXPONENT_BITS[dtype]
    bits = raw.view(kind)
    sign = kind(1 << (8 * bits.itemsize - 1))
    return not (np.any(np.bitwise_and(bits, kind(mask)) == mask) or np.any(np.bitwise_and(bits, sign)) or
                np.any(bits == 0))


def powers_of_two(raw: np.ndarray, dtype: str) -> bool:
    """Whether every float in `raw` (uint8, whole elements) is 2^e: a frexp significand of exactly 1/2
    (float32 holds every F16 and BF16 value exactly, subnormal ones included)."""
    if dtype == "F32":
        values = raw.view(np.float32)
    elif dtype == "F16":
        values = raw.view(np.float16).astype(np.float32)
    else:  # BF16: the top half of a float32
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return bool(np.all(np.frexp(values)[0] == 0.5))


def problem(t: TensorPlan, info: TensorInfo, raw: np.ndarray, scale_format: str = "float") -> str | None:
    """What is wrong with these bytes of `info`, copied for `t`, or None. `scale_format` "ue8m0": a
    passed weight scale must be a power of two (quantizer.passed_through checks the same)."""
    if info.dtype == FP8:
        return "holds NaN codes" if np.any(np.bitwise_and(raw, 0x7F) == 0x7F) else None  # e4m3fn NaN: S.1111.111
    if t.action is Action.PASS:  # its scale, or its static activation scale
        if not finite_positive(raw, info.dtype):
            return "is a scale that is not finite and positive"
        if scale_format == "ue8m0" and info is t.source_scale and not powers_of_two(raw, info.dtype):
            return ("is a scale that is not a power of two everywhere, though the source's config declares scale_fmt "
                    "ue8m0 (it cannot pass into a --scale-format ue8m0 output)")
        return None
    if must_be_finite(t) and has_non_finite(raw, info.dtype):
        return "contains NaN or Inf"
    return None


def must_be_finite(t: TensorPlan) -> bool:
    """Kept float weights are checked (a NaN norm is as broken as a NaN linear); buffers and integer
    tensors are copied as they are."""
    return t.name.endswith(".weight") and t.source.dtype in FLOAT_SOURCE_DTYPES


class KeptCopier:
    """Copies `tensors` (kept or passed-through ones) into their shards on a thread of its own. A context manager: leaving
    it stops the thread after the chunk in hand. `check()` raises the copier's error, if it had one;
    `finish()` waits for the copy and raises it too."""

    def __init__(self, plan: Plan, tensors: list[TensorPlan], writer: ShardWriter,
                 on_copied: Callable[[int], None] = lambda nbytes: None):
        self.plan, self.tensors, self.writer, self.on_copied = plan, tensors, writer, on_copied
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._copy_all, name="fp8convert-kept", daemon=True)

    def __enter__(self) -> "KeptCopier":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        self.thread.join()
        self.check()

    def _copy_all(self) -> None:
        root = Path(self.plan.source.root)
        try:
            with SourceFiles(root) as files:
                for t in self.tensors:
                    runs = {run.pieces[0].name: run for run in output_runs(self.plan, [t], merge=False)}
                    for info, name in t.copies:
                        if self.stop.is_set():
                            return
                        self._copy(t, info, runs[name], files.fd(info.file), root)
        except BaseException as e:  # raised in the main thread by check() or finish()
            self.error = e

    def _copy(self, t: TensorPlan, info: TensorInfo, run: Run, fd: int, root: Path) -> None:
        """Copy `info`'s bytes into `run` chunk by chunk, checked; errors name the file under `root`."""
        buf = np.empty(min(CHUNK_BYTES, max(info.nbytes, 1)), dtype=np.uint8)
        for start in range(0, info.nbytes, CHUNK_BYTES):
            if self.stop.is_set():
                return
            n = min(CHUNK_BYTES, info.nbytes - start)
            pread_into(fd, memoryview(buf[:n]), info.offset + start, str(root / info.file))
            wrong = problem(t, info, buf[:n], self.plan.options.scale_format)
            if wrong:
                raise FP8ConvertError(f"{root / info.file}: tensor {info.name} {wrong}; refusing to copy it")
            self.writer.write(Run(run.shard, run.start + start, n, ()), buf[:n], in_this_thread=True)
            self.on_copied(n)
        if not info.nbytes:
            self.writer.write(run, buf[:0], in_this_thread=True)
