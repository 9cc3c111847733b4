"""Quantize stage: one batch's outputs from its input buffer on the device.

Same-shaped weights (a MoE layer's experts, above all) are quantized as stacks, a few launches for
hundreds of tensors, instead of one launch chain each. The reader lays out each family of
same-shaped groups member by member, so a stack is a plain view of the input buffer; the experts
cut from one fused tensor are a strided view of it.

An FP8 source's weights are dequantized (float32(q) * scale, then one rounding), requantized from
those float32 values, or passed through as they are: codes and scales copied, after the checks every
read FP8 weight passes (no NaN code, every scale finite and positive).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import POW2_OVERFLOW, FP8ConvertError
from ..plan.batches import Batch
from ..plan.plan import Action, TensorPlan
from ..safetensors_io import FLOAT_SOURCE_DTYPES, TensorInfo, torch_dtype
from .numerics import NonFiniteWeight, dequantize_to, powers_of_two, quantize_group, scale_as_stored
from .reader import ALIGN, PendingRead

STACK_BYTES = 64 << 20  # input bytes per launch chain: large enough to amortise launches, small
# enough that float32 temporaries stay a sliver of device memory


STACKED = (Action.QUANTIZE, Action.REQUANTIZE, Action.DEQUANTIZE)  # computed a stack of same-shaped weights at a time


@dataclass
class Family:
    """Groups whose members have the same action, dtypes and shapes, e.g. every expert's gate/up pair:
    computed a stack at a time."""

    groups: list[list[TensorPlan]]

    def chunks(self) -> list[list[list[TensorPlan]]]:
        step = max(1, STACK_BYTES // sum(work_bytes(t) for t in self.groups[0]))
        return [self.groups[i : i + step] for i in range(0, len(self.groups), step)]


def work_bytes(t: TensorPlan) -> int:
    """What one output weighs in a stack: its input, or for an FP8 source's weight its codes as four-byte
    values (float32 to requantize; bfloat16 outputs and int32 table indices to dequantize)."""
    return t.in_bytes if t.action is Action.QUANTIZE else 4 * math.prod(t.shape)


def scale_groups(batch: Batch) -> list[list[TensorPlan]]:
    """The batch's computed outputs by scale group: a fused group's members quantized or requantized
    here (one scale in the tensor scheme), or one output alone (dequantized weights among them)."""
    groups: dict[str, list[TensorPlan]] = {}
    for t in batch.tensors:
        if t.action in STACKED:
            shares = t.group and t.action is not Action.DEQUANTIZE
            groups.setdefault(t.group if shares else f"tensor:{t.name}", []).append(t)
    return list(groups.values())


def families(batch: Batch) -> list[Family]:
    """The batch's families, each's groups in the order their first members lie in the source files: a
    stack's inputs then arrive together (experts are named 0, 1, 10, 100 in a file's order of names)."""
    by_signature: dict[tuple, Family] = {}
    for group in sorted(scale_groups(batch), key=file_position):
        signature = tuple((t.action, t.source.dtype, t.shape) for t in group)
        by_signature.setdefault(signature, Family([])).groups.append(group)
    return list(by_signature.values())


def file_position(group: list[TensorPlan]) -> tuple[str, int, int]:
    first = group[0]
    return first.source.file, first.source.offset, (first.cut.expert or 0) if first.cut else 0


def read_order(batch: Batch) -> list[TensorInfo]:
    """The source tensors to read: kept ones, then each stack chunk member by member, its weights
    before their scales, so every stack of whole tensors is contiguous in the buffer (a source cut into
    many outputs is read once)."""
    order = [info for t in batch.tensors if t.action not in STACKED for info in t.inputs]
    for family in families(batch):
        for chunk in family.chunks():
            for member in range(len(chunk[0])):
                stack = [group[member] for group in chunk]
                order += [t.source for t in stack] + [info for t in stack for info in t.inputs[1:]]
    return list({info.name: info for info in order}.values())  # each once: outputs cut from one source share it


def source_view(buf: torch.Tensor, offsets: dict[str, int], info: TensorInfo) -> torch.Tensor:
    start = offsets[info.name]
    return buf[start : start + info.nbytes].view(torch_dtype(info.dtype)).view(info.shape)


def stack_view(buf: torch.Tensor, offsets: dict[str, int], tensors: list[TensorPlan]) -> torch.Tensor:
    """[N, out, in] of same-shaped outputs: a view of the read buffer when they lie back to back, or
    are consecutive experts cut alike from one source; else a copy."""
    first = tensors[0]
    if first.cut is None:
        start, size = offsets[first.source.name], first.source.nbytes
        if size % ALIGN == 0 and all(
            t.cut is None and offsets[t.source.name] == start + i * size for i, t in enumerate(tensors)
        ):
            return (
                buf[start : start + size * len(tensors)]
                .view(torch_dtype(first.source.dtype))
                .view(len(tensors), *first.source.shape)
            )
    elif all(
        t.source.name == first.source.name and t.cut == replace(first.cut, expert=first.cut.expert + i)
        for i, t in enumerate(tensors)
    ):
        e0 = first.cut.expert
        return first.cut.across_experts().apply(source_view(buf, offsets, first.source)[e0 : e0 + len(tensors)])
    return torch.stack([output_view(buf, offsets, t) for t in tensors])


def dequantized(
    buf: torch.Tensor,
    offsets: dict[str, int],
    tensors: list[TensorPlan],
    source_scheme: str,
    dtype: torch.dtype,
    cpu_path: bool | None = None,
    root: Path = Path(),
) -> torch.Tensor:
    """FP8 source weights' values [N, out, in], (float32(q) * scale).to(dtype), their scales checked
    first. A NaN code, or a value `dtype` cannot hold (float16 tops out at 65504), is refused."""
    scales = [source_view(buf, offsets, t.source_scale) for t in tensors]
    for t, scale in zip(tensors, scales):
        check_scale(scale, t, root)
    stacked = torch.stack([scale_as_stored(s, source_scheme) for s in scales])
    w = dequantize_to(stack_view(buf, offsets, tensors), stacked, source_scheme, dtype, cpu_path)
    if not all_finite(w):
        t = next(t for t, values in zip(tensors, w) if not all_finite(values))
        raise FP8ConvertError(
            f"{where(t, root)} dequantizes to NaN or Inf in {str(dtype).removeprefix('torch.')} "
            f"(a NaN code, or values beyond the dtype's range); refusing it"
        )
    return w


def output_view(buf: torch.Tensor, offsets: dict[str, int], t: TensorPlan) -> torch.Tensor:
    """One output's values as a view of the read buffer (its cut of the source, or all of it)."""
    w = source_view(buf, offsets, t.source)
    return t.cut.apply(w) if t.cut else w


def finite_positive(values: torch.Tensor) -> bool:
    return bool((torch.isfinite(values) & (values > 0)).all())


def check_scale(scale: torch.Tensor, t: TensorPlan, root: Path = Path()) -> None:
    if not finite_positive(scale):
        raise FP8ConvertError(
            f"{root / t.source_scale.file}: scale {t.source_scale.name} of FP8 weight "
            f"{t.source.name} is not finite and positive everywhere; refusing it"
        )


def passed_through(
    buf: torch.Tensor, offsets: dict[str, int], t: TensorPlan, scale_format: str = "float", root: Path = Path()
) -> list[tuple[str, torch.Tensor, int]]:
    """A passed-through weight's outputs: its codes, scale (and activation scale) as they are, checked
    as kept.problem checks them where the copier copies them. Into a ue8m0 output (the source declares
    scale_fmt ue8m0) every scale must be a power of two: the output's config says so, and engines would
    not round them again."""
    scale = source_view(buf, offsets, t.source_scale)
    check_scale(scale, t, root)
    if scale_format == "ue8m0" and not bool(powers_of_two(scale).all()):
        raise FP8ConvertError(
            f"{root / t.source_scale.file}: scale {t.source_scale.name} of FP8 weight "
            f"{t.source.name} is not a power of two everywhere, though the source's config declares "
            "scale_fmt ue8m0 (it cannot pass into a --scale-format ue8m0 output); refusing it"
        )
    if bool(raw_source(buf, offsets, t.source).bitwise_and(0x7F).eq(0x7F).any()):  # e4m3fn's NaN: S.1111.111
        raise FP8ConvertError(f"{where(t, root)} holds NaN codes; refusing it")
    return [(name, raw_source(buf, offsets, info), 0) for info, name in t.copies]


def carried_scale(
    buf: torch.Tensor, offsets: dict[str, int], t: TensorPlan, root: Path = Path()
) -> list[tuple[str, torch.Tensor, int]]:
    """A static activation scale copied as it is (checked finite and positive)."""
    if not t.input_scale_name:
        return []
    info = t.inputs[-1]
    if not finite_positive(source_view(buf, offsets, info)):
        raise FP8ConvertError(
            f"{root / info.file}: activation scale {info.name} is not finite and positive; refusing it"
        )
    return [(t.input_scale_name, raw_source(buf, offsets, info), 0)]


def raw_source(buf: torch.Tensor, offsets: dict[str, int], info: TensorInfo) -> torch.Tensor:
    return buf[offsets[info.name] : offsets[info.name] + info.nbytes]


def where(t: TensorPlan, root: Path = Path()) -> str:
    """The source tensor (and expert) an output comes from, for error messages; the shard file under
    `root`, the source's directory."""
    expert = f" (expert {t.cut.expert})" if t.cut and t.cut.expert is not None else ""
    return f"{root / t.source.file}: tensor {t.source.name}{expert}"


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf. min and max propagate NaN and show an Inf: one fast reduction, no temporary the
    size of the tensor (isfinite would make one, and is several times slower on a CPU)."""
    if not values.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def quantize_batch(
    batch: Batch,
    buf: torch.Tensor,
    offsets: dict[str, int],
    scheme: str,
    cpu_path: bool | None = None,
    source_scheme: str = "",
    scale_format: str = "float",
    root: Path = Path(),
) -> list[tuple[str, torch.Tensor, int]]:
    """Outputs (name, tensor, byte offset in that output tensor) for the batch: whole tensors at 0, a
    piece of a kept tensor where it goes. Kept and passed-through tensors are views of `buf` (the caller
    copies them into the output runs, or writes them from `buf` itself). `cpu_path`: see
    numerics.use_cpu_path. `source_scheme`: an FP8 source's scheme. `scale_format`: see
    numerics.quantize_group. `root`: the source's directory, which errors name with the shard file."""
    return [
        out
        for outputs in quantize_steps(batch, buf, offsets, scheme, cpu_path, source_scheme, scale_format, root)
        for out in outputs
    ]


def quantize_steps(
    batch: Batch,
    buf: torch.Tensor,
    offsets: dict[str, int],
    scheme: str,
    cpu_path: bool | None = None,
    source_scheme: str = "",
    scale_format: str = "float",
    root: Path = Path(),
    pending: PendingRead | None = None,
) -> Iterator[list[tuple[str, torch.Tensor, int]]]:
    """quantize_batch's outputs, one step at a time (one kept tensor, or one stack of same-shaped
    weights). `pending`: the batch's reads, still in flight: each step waits only for its own inputs, and
    the steps go in the order their inputs arrive, so quantizing overlaps reading."""

    def single(t: TensorPlan) -> list[tuple[str, torch.Tensor, int]]:
        if t.action is Action.PASS:
            return passed_through(buf, offsets, t, scale_format, root)
        if t.cut:  # a cut is a strided view: written as a contiguous copy
            values = output_view(buf, offsets, t)
            if t.source.dtype in FLOAT_SOURCE_DTYPES and not all_finite(values):
                raise FP8ConvertError(f"{where(t, root)} contains NaN or Inf; refusing to copy it")
            return [(t.name, values.contiguous(), t.at)]
        raw = raw_source(buf, offsets, t.source)
        if (
            t.name.endswith(".weight")
            and t.source.dtype in FLOAT_SOURCE_DTYPES
            and not all_finite(raw.view(torch_dtype(t.source.dtype)))
        ):
            raise FP8ConvertError(f"{where(t, root)} contains NaN or Inf; refusing to copy it")
        return [(t.name, raw, t.at)]

    def stacked(chunk: list[list[TensorPlan]]) -> list[tuple[str, torch.Tensor, int]]:
        action = chunk[0][0].action
        members = [[group[m] for group in chunk] for m in range(len(chunk[0]))]
        if action is Action.DEQUANTIZE:
            (tensors,) = members
            w = dequantized(buf, offsets, tensors, source_scheme, torch_dtype(tensors[0].out_dtype), cpu_path, root)
            return [(t.name, w[n], 0) for n, t in enumerate(tensors)]
        if action is Action.REQUANTIZE:
            stacks = [dequantized(buf, offsets, ts, source_scheme, torch.float32, cpu_path, root) for ts in members]
        else:
            stacks = [stack_view(buf, offsets, ts) for ts in members]
        try:
            codes, scales = quantize_group(stacks, scheme, cpu_path, scale_format)
        except NonFiniteWeight as e:
            raise FP8ConvertError(
                f"{where(members[e.member][e.index], root)} "
                + (POW2_OVERFLOW if e.overflows else "contains NaN or Inf; refusing to quantize it")
            ) from None
        return [
            out
            for tensors, q, s in zip(members, codes, scales)
            for n, t in enumerate(tensors)
            for out in [(t.name, q[n], 0), (t.scale_name, s[n], 0)] + carried_scale(buf, offsets, t, root)
        ]

    steps = [(list(t.inputs), functools.partial(single, t)) for t in batch.tensors if t.action not in STACKED]
    steps += [
        ([info for group in chunk for t in group for info in t.inputs], functools.partial(stacked, chunk))
        for family in families(batch)
        for chunk in family.chunks()
    ]
    if pending is not None:
        steps.sort(key=lambda step: pending.arrival(step[0]))
    for inputs, step in steps:
        if pending is not None:
            pending.wait(inputs)
        yield step()
