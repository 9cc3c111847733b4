"""Quantize stage: one batch's outputs from its input buffer on the device.

Same-shaped weights (a MoE layer's experts, above all) are quantized as stacks, a few launches for
hundreds of tensors, instead of one launch chain each. The reader lays out each family of
same-shaped groups member by member, so a stack is a plain view of the input buffer; the experts
cut from one fused tensor are a strided view of it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import FP8ConvertError
from ..plan.batches import Batch
from ..plan.plan import TensorPlan, unique_inputs
from ..safetensors_io import FLOAT_SOURCE_DTYPES, TensorInfo, torch_dtype
from .numerics import NonFiniteWeight, quantize_group
from .reader import ALIGN

STACK_BYTES = 64 << 20  # input bytes per launch chain: large enough to amortise launches, small
                        # enough that float32 temporaries stay a sliver of device memory


@dataclass
class Family:
    """Scale groups whose members have the same dtypes and shapes, e.g. every expert's gate/up pair."""

    groups: list[list[TensorPlan]]

    def chunks(self) -> list[list[list[TensorPlan]]]:
        per_group = sum(t.in_bytes for t in self.groups[0])
        step = max(1, STACK_BYTES // per_group)
        return [self.groups[i:i + step] for i in range(0, len(self.groups), step)]


def scale_groups(batch: Batch) -> list[list[TensorPlan]]:
    """The batch's quantized outputs by scale group: a fused group's members (one scale in the tensor
    scheme), or one output alone."""
    groups: dict[str, list[TensorPlan]] = {}
    for t in batch.tensors:
        if t.quantize:
            groups.setdefault(t.group or f"tensor:{t.name}", []).append(t)
    return list(groups.values())


def families(batch: Batch) -> list[Family]:
    by_signature: dict[tuple, Family] = {}
    for group in scale_groups(batch):
        signature = tuple((t.source.dtype, t.shape) for t in group)
        by_signature.setdefault(signature, Family([])).groups.append(group)
    return list(by_signature.values())


def read_order(batch: Batch) -> list[TensorInfo]:
    """The source tensors to read: kept ones, then each stack chunk member by member, so every stack
    of whole tensors is contiguous in the buffer (a source cut into many outputs is read once)."""
    order = [t for t in batch.tensors if not t.quantize]
    for family in families(batch):
        for chunk in family.chunks():
            for member in range(len(chunk[0])):
                order += [group[member] for group in chunk]
    return unique_inputs(order)


def source_view(buf: torch.Tensor, offsets: dict[str, int], info: TensorInfo) -> torch.Tensor:
    start = offsets[info.name]
    return buf[start:start + info.nbytes].view(torch_dtype(info.dtype)).view(info.shape)


def stack_view(buf: torch.Tensor, offsets: dict[str, int], tensors: list[TensorPlan]) -> torch.Tensor:
    """[N, out, in] of same-shaped outputs: a view of the read buffer when they lie back to back, or
    are consecutive experts cut alike from one source; else a copy."""
    first = tensors[0]
    if first.cut is None:
        start, size = offsets[first.source.name], first.source.nbytes
        if size % ALIGN == 0 and all(t.cut is None and offsets[t.source.name] == start + i * size
                                     for i, t in enumerate(tensors)):
            return buf[start:start + size * len(tensors)].view(torch_dtype(first.source.dtype)).view(
                len(tensors), *first.source.shape)
    elif all(t.source.name == first.source.name and t.cut == replace(first.cut, expert=first.cut.expert + i)
             for i, t in enumerate(tensors)):
        e0 = first.cut.expert
        return first.cut.across_experts().apply(source_view(buf, offsets, first.source)[e0:e0 + len(tensors)])
    return torch.stack([output_view(buf, offsets, t) for t in tensors])


def output_view(buf: torch.Tensor, offsets: dict[str, int], t: TensorPlan) -> torch.Tensor:
    """One output's values as a view of the read buffer (its cut of the source, or all of it)."""
    w = source_view(buf, offsets, t.source)
    return t.cut.apply(w) if t.cut else w


def where(t: TensorPlan) -> str:
    """The source tensor (and expert) an output comes from, for error messages."""
    expert = f" (expert {t.cut.expert})" if t.cut and t.cut.expert is not None else ""
    return f"{t.source.file}: tensor {t.source.name}{expert}"


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf. min and max propagate NaN and show an Inf: one fast reduction, no temporary the
    size of the tensor (isfinite would make one, and is several times slower on a CPU)."""
    if not values.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def quantize_batch(batch: Batch, buf: torch.Tensor, offsets: dict[str, int], scheme: str,
                   cpu_path: bool | None = None, scale_format: str = "float") -> list[tuple[str, torch.Tensor, int]]:
    """Outputs (name, tensor, byte offset in that output tensor) for the batch: whole tensors at 0, a
    piece of a kept tensor where it goes. Kept tensors are views of `buf` (the caller copies them into
    the output runs, or writes them from `buf` itself). `cpu_path`: see numerics.use_cpu_path;
    `scale_format`: see numerics.quantize_group."""
    outputs = []
    for t in batch.tensors:
        if t.quantize:
            continue
        if t.cut:  # a cut is a strided view: written as a contiguous copy
            values = output_view(buf, offsets, t)
            if t.source.dtype in FLOAT_SOURCE_DTYPES and not all_finite(values):
                raise FP8ConvertError(f"{where(t)} contains NaN or Inf; refusing to copy it")
            outputs.append((t.name, values.contiguous(), t.at))
            continue
        raw = buf[offsets[t.source.name]:offsets[t.source.name] + t.source.nbytes]
        if t.name.endswith(".weight") and t.source.dtype in FLOAT_SOURCE_DTYPES and not all_finite(
                raw.view(torch_dtype(t.source.dtype))):
            raise FP8ConvertError(f"{where(t)} contains NaN or Inf; refusing to copy it")
        outputs.append((t.name, raw, t.at))
    for family in families(batch):
        for chunk in family.chunks():
            members = [[group[m] for group in chunk] for m in range(len(chunk[0]))]
            try:
                codes, scales = quantize_group([stack_view(buf, offsets, ts) for ts in members], scheme, cpu_path,
                                               scale_format)
            except NonFiniteWeight as e:
                raise FP8ConvertError(f"{where(members[e.member][e.index])} contains NaN or Inf; "
                                      "refusing to quantize it") from None
            for tensors, q, s in zip(members, codes, scales):
                for n, t in enumerate(tensors):
                    outputs += [(t.name, q[n], 0), (t.scale_name, s[n], 0)]
    return outputs
