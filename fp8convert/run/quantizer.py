"""Quantize stage: one batch's outputs from its input buffer on the device. Same-shaped weights (a MoE
layer's experts, above all) are quantized as stacks, a few launches for hundreds of tensors; the reader lays
them out member by member, so a stack is a view of the input buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import FP8ConvertError
from ..options import FP4_SCHEMES, ScaleFormat
from ..plan.batches import Batch
from ..plan.plan import Action, TensorPlan
from ..safetensors_io import FLOAT_SOURCE_DTYPES, TensorInfo, torch_dtype
from . import fp4
from .fp4 import quantize_fp4_group
from .numerics import (
    NonFiniteWeight,
    all_finite,
    dequantize_to,
    finite_positive,
    powers_of_two,
    quantize_group,
    scale_as_stored,
)
from .reader import ALIGN, PendingRead

# Input bytes per launch chain: large enough to amortise launches, small enough that float32 temporaries
# stay a sliver of device memory.
STACK_BYTES = 64 << 20
STACKED = (Action.QUANTIZE, Action.REQUANTIZE, Action.DEQUANTIZE)  # computed a stack at a time
Output = tuple[str, torch.Tensor, int]  # name, tensor, byte offset in that output (a piece of a kept one)
# A weight whose largest values a power-of-two scale cannot write (numerics.POW2_OVERFLOW_AMAX)
POW2_OVERFLOW = (
    "holds values within 3% of float32's maximum (3.3e38 or more), which power-of-two scales would "
    "write as codes that read back as Inf; refusing it (--scheme tensor, channel or block with float "
    "scales can write them)"
)


def stack_chunks(batch: Batch) -> list[list[list[TensorPlan]]]:
    """Chunks of at most STACK_BYTES of alike scale groups, in the order their first members lie in the
    files, so a stack's inputs arrive together (experts are named 0, 1, 10, 100 in a file's order)."""
    groups: dict[str, list[TensorPlan]] = {}
    for t in batch.tensors:
        if t.action in STACKED:
            shares = t.group and t.action is not Action.DEQUANTIZE
            groups.setdefault(t.group if shares else f"tensor:{t.name}", []).append(t)
    families: dict[tuple, list[list[TensorPlan]]] = {}
    for group in sorted(groups.values(), key=file_position):
        families.setdefault(tuple((t.action, t.scheme, t.source.dtype, t.shape) for t in group), []).append(group)
    chunks = []
    for family in families.values():
        # a group's weight in a stack: its inputs, or FP8 weights' codes as four-byte values
        group_bytes = sum(t.in_bytes if t.action is Action.QUANTIZE else 4 * math.prod(t.shape) for t in family[0])
        step = max(1, STACK_BYTES // group_bytes)
        chunks += [family[i : i + step] for i in range(0, len(family), step)]
    return chunks


def file_position(group: list[TensorPlan]) -> tuple[str, int, int]:
    first = group[0]
    return first.source.file, first.source.offset, (first.cut.expert or 0) if first.cut else 0


def read_order(batch: Batch) -> list[TensorInfo]:
    """Each source tensor once: kept ones, then each chunk member by member, weights before their scales,
    so every stack of whole tensors is contiguous in the buffer."""
    order = [info for t in batch.tensors if t.action not in STACKED for info in t.inputs]
    for chunk in stack_chunks(batch):
        for member in range(len(chunk[0])):
            stack = [group[member] for group in chunk]
            order += [t.source for t in stack] + [info for t in stack for info in t.inputs[1:]]
    return list({info.name: info for info in order}.values())


@dataclass
class Inputs:
    """A batch's read buffer, and the source directory errors name."""

    buf: torch.Tensor
    offsets: dict[str, int]
    root: Path

    def raw(self, info: TensorInfo) -> torch.Tensor:
        return self.buf[self.offsets[info.name] : self.offsets[info.name] + info.nbytes]

    def view(self, info: TensorInfo) -> torch.Tensor:
        return self.raw(info).view(torch_dtype(info.dtype)).view(info.shape)

    def output(self, t: TensorPlan) -> torch.Tensor:
        w = self.view(t.source)
        return t.cut.apply(w) if t.cut else w

    def stack(self, tensors: list[TensorPlan]) -> torch.Tensor:
        """[N, out, in] of same-shaped outputs: a view when they lie back to back, or are consecutive experts
        cut alike from one source; else a copy."""
        first = tensors[0]
        if first.cut is None:
            start, size = self.offsets[first.source.name], first.source.nbytes
            if size % ALIGN == 0 and all(
                t.cut is None and self.offsets[t.source.name] == start + i * size for i, t in enumerate(tensors)
            ):
                whole = self.buf[start : start + size * len(tensors)].view(torch_dtype(first.source.dtype))
                return whole.view(len(tensors), *first.source.shape)
        elif all(
            t.source.name == first.source.name and t.cut == replace(first.cut, expert=first.cut.expert + i)
            for i, t in enumerate(tensors)
        ):
            e0 = first.cut.expert
            return first.cut.across_experts().apply(self.view(first.source)[e0 : e0 + len(tensors)])
        return torch.stack([self.output(t) for t in tensors])

    def where(self, t: TensorPlan) -> str:
        expert = f" (expert {t.cut.expert})" if t.cut and t.cut.expert is not None else ""
        return f"{self.root / t.source.file}: tensor {t.source.name}{expert}"

    def checked_scale(self, t: TensorPlan) -> torch.Tensor:
        scale = self.view(t.source_scale)
        if not finite_positive(scale):
            raise FP8ConvertError(
                f"{self.root / t.source_scale.file}: scale {t.source_scale.name} of FP8 weight "
                f"{t.source.name} is not finite and positive everywhere; refusing it"
            )
        return scale

    def carried_scale(self, t: TensorPlan) -> list[Output]:
        if not t.input_scale_name:
            return []
        info = t.inputs[-1]
        if not finite_positive(self.view(info)):
            raise FP8ConvertError(
                f"{self.root / info.file}: activation scale {info.name} is not finite and positive; refusing it"
            )
        return [(t.input_scale_name, self.raw(info), 0)]


def quantize_steps(
    batch: Batch,
    buf: torch.Tensor,
    offsets: dict[str, int],
    *,
    source_scheme: str = "",
    scale_format: str = "float",
    root: Path = Path(),
    pending: PendingRead | None = None,
) -> Iterator[list[Output]]:
    """The batch's outputs a step (one kept tensor, or one stack) at a time; kept and passed-through ones
    are views of `buf`. With `pending`, each step waits only for its own inputs, in the order they arrive."""
    src = Inputs(buf, offsets, Path(root))

    def dequantized(tensors: list[TensorPlan], dtype: torch.dtype) -> torch.Tensor:
        if source_scheme in FP4_SCHEMES:
            w = dequantized_fp4(tensors).to(dtype)
        else:
            scales = torch.stack([scale_as_stored(src.checked_scale(t), source_scheme) for t in tensors])
            w = dequantize_to(src.stack(tensors), scales, source_scheme, dtype)
        if not all_finite(w):
            t = next(t for t, values in zip(tensors, w) if not all_finite(values))
            raise FP8ConvertError(
                f"{src.where(t)} dequantizes to NaN or Inf in {str(dtype).removeprefix('torch.')} "
                f"(a NaN code, or values beyond the dtype's range); refusing it"
            )
        return w

    def dequantized_fp4(tensors: list[TensorPlan]) -> torch.Tensor:
        for t in tensors:
            global_scale = src.view(t.inputs[2]).float().reshape(1, 1) if len(t.inputs) > 2 else None
            if not finite_positive(fp4.divisors(source_scheme, src.view(t.source_scale), global_scale)):
                raise FP8ConvertError(
                    f"{src.root / t.source_scale.file}: scale {t.source_scale.name} (or its global scale) of FP4 "
                    f"weight {t.source.name} is not finite and positive everywhere; refusing it"
                )
        scales = torch.stack([src.view(t.source_scale) for t in tensors])
        globals_ = (
            torch.stack([src.view(t.inputs[2]).reshape(1) for t in tensors]) if len(tensors[0].inputs) > 2 else None
        )
        return fp4.dequantize(src.stack(tensors), scales, globals_, source_scheme)

    def passed_through(t: TensorPlan) -> list[Output]:
        """Into a ue8m0 output every scale must be a power of two: engines would not round them again."""
        scale = src.checked_scale(t)
        if scale_format == ScaleFormat.UE8M0 and not bool(powers_of_two(scale).all()):
            raise FP8ConvertError(
                f"{src.root / t.source_scale.file}: scale {t.source_scale.name} of FP8 weight "
                f"{t.source.name} is not a power of two everywhere, though the source's config declares "
                "scale_fmt ue8m0 (it cannot pass into a --scale-format ue8m0 output); refusing it"
            )
        if bool(src.raw(t.source).bitwise_and(0x7F).eq(0x7F).any()):  # e4m3fn's NaN: S.1111.111
            raise FP8ConvertError(f"{src.where(t)} holds NaN codes; refusing it")
        return [(name, src.raw(info), 0) for info, name in t.copies]

    def single(t: TensorPlan) -> list[Output]:
        if t.action is Action.PASS:
            return passed_through(t)
        values = src.output(t)
        checked = t.cut or t.name.endswith(".weight")
        if checked and t.source.dtype in FLOAT_SOURCE_DTYPES and not all_finite(values):
            raise FP8ConvertError(f"{src.where(t)} contains NaN or Inf; refusing to copy it")
        # a cut is a strided view: written as a contiguous copy
        return [(t.name, values.contiguous() if t.cut else src.raw(t.source), t.at)]

    def stacked(chunk: list[list[TensorPlan]]) -> list[Output]:
        action = chunk[0][0].action
        members = [[group[m] for group in chunk] for m in range(len(chunk[0]))]
        if action is Action.DEQUANTIZE:
            (tensors,) = members
            w = dequantized(tensors, torch_dtype(tensors[0].out_dtype))
            return [(t.name, w[n], 0) for n, t in enumerate(tensors)]
        if action is Action.REQUANTIZE:
            stacks = [dequantized(ts, torch.float32) for ts in members]
        else:
            stacks = [src.stack(ts) for ts in members]
        scheme = chunk[0][0].scheme  # a recipe's, else --scheme
        try:
            if scheme in FP4_SCHEMES:
                made = quantize_fp4_group(stacks, scheme)
            else:
                made = list(map(list, zip(*quantize_group(stacks, scheme, scale_format))))
        except NonFiniteWeight as e:
            raise FP8ConvertError(
                f"{src.where(members[e.member][e.index])} "
                + (POW2_OVERFLOW if e.overflows else "contains NaN or Inf; refusing to quantize it")
            ) from None
        return [  # per member: codes (FP8, or packed FP4), scales and (NVFP4) global scales, stacked
            out
            for tensors, stacks_made in zip(members, made)
            for n, t in enumerate(tensors)
            for out in [(name, made_n[n], 0) for name, made_n in zip(t.written_names, stacks_made)]
            + src.carried_scale(t)
        ]

    steps = [(list(t.inputs), functools.partial(single, t)) for t in batch.tensors if t.action not in STACKED]
    steps += [
        ([info for group in chunk for t in group for info in t.inputs], functools.partial(stacked, chunk))
        for chunk in stack_chunks(batch)
    ]
    if pending is not None:
        steps.sort(key=lambda step: pending.arrival(step[0]))
    for inputs, step in steps:
        if pending is not None:
            pending.wait(inputs)
        yield step()
