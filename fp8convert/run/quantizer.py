"""Quantize stage: one batch's outputs from its input buffer on the device.

Same-shaped weights (a MoE layer's experts, above all) are quantized as stacks, a few launches for
hundreds of tensors, instead of one launch chain each. The reader lays out each family of
same-shaped groups member by member, so a stack is a plain view of the input buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FP8ConvertError
from ..plan.batches import Batch
from ..plan.plan import TensorPlan
from ..safetensors_io import FLOAT_SOURCE_DTYPES, torch_dtype
from .numerics import NonFiniteWeight, quantize_group
from .reader import ALIGN

STACK_BYTES = 64 << 20  # input bytes per launch chain: large enough to amortise launches, small
                        # enough that float32 temporaries stay a sliver of device memory


@dataclass
class Family:
    """Groups (atoms) whose members have the same dtypes and shapes, e.g. every expert's gate/up."""

    atoms: list[list[TensorPlan]]

    def chunks(self) -> list[list[list[TensorPlan]]]:
        per_atom = sum(t.source.nbytes for t in self.atoms[0])
        step = max(1, STACK_BYTES // per_atom)
        return [self.atoms[i:i + step] for i in range(0, len(self.atoms), step)]


def families(batch: Batch) -> list[Family]:
    by_signature: dict[tuple, Family] = {}
    for atom in batch.atoms:
        if atom[0].quantize:
            signature = tuple((t.source.dtype, t.source.shape) for t in atom)
            by_signature.setdefault(signature, Family([])).atoms.append(atom)
    return list(by_signature.values())


def read_order(batch: Batch) -> list[TensorPlan]:
    """Kept tensors, then each stack chunk member by member, so every stack is contiguous."""
    order = [t for atom in batch.atoms if not atom[0].quantize for t in atom]
    for family in families(batch):
        for chunk in family.chunks():
            for member in range(len(chunk[0])):
                order += [atom[member] for atom in chunk]
    return order


def stack_view(buf: torch.Tensor, offsets: dict[str, int], tensors: list[TensorPlan]) -> torch.Tensor:
    """[N, out, in] view of same-shaped tensors laid out back to back, or a copy if they are not."""
    first = tensors[0].source
    start, size = offsets[first.name], first.nbytes
    dtype = torch_dtype(first.dtype)
    if size % ALIGN == 0 and all(offsets[t.name] == start + i * size for i, t in enumerate(tensors)):
        return buf[start:start + size * len(tensors)].view(dtype).view(len(tensors), *first.shape)
    return torch.stack([buf[offsets[t.name]:offsets[t.name] + size].view(dtype).view(first.shape) for t in tensors])


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf. min and max propagate NaN and show an Inf: one fast reduction, no temporary the
    size of the tensor (isfinite would make one, and is several times slower on a CPU)."""
    if not values.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def quantize_batch(batch: Batch, buf: torch.Tensor, offsets: dict[str, int], scheme: str,
                   cpu_path: bool | None = None) -> list[tuple[str, torch.Tensor, int]]:
    """Outputs (name, tensor, byte offset in that output tensor) for the batch: whole tensors at 0, a
    piece of a kept tensor where it goes. Kept tensors are views of `buf` (the caller copies them into
    the output runs, or writes them from `buf` itself). `cpu_path`: see numerics.use_cpu_path."""
    outputs = []
    for atom in batch.atoms:
        if not atom[0].quantize:
            t = atom[0]
            raw = buf[offsets[t.name]:offsets[t.name] + t.source.nbytes]
            if t.name.endswith(".weight") and t.source.dtype in FLOAT_SOURCE_DTYPES and not all_finite(
                    raw.view(torch_dtype(t.source.dtype))):
                raise FP8ConvertError(f"{t.source.file}: tensor {t.name} contains NaN or Inf; refusing to copy it")
            outputs.append((t.name, raw, t.at))
    for family in families(batch):
        for chunk in family.chunks():
            members = [[atom[m] for atom in chunk] for m in range(len(chunk[0]))]
            try:
                codes, scales = quantize_group([stack_view(buf, offsets, ts) for ts in members], scheme, cpu_path)
            except NonFiniteWeight as e:
                bad = members[e.member][e.index].source
                raise FP8ConvertError(f"{bad.file}: tensor {bad.name} contains NaN or Inf; "
                                      "refusing to quantize it") from None
            for tensors, q, s in zip(members, codes, scales):
                for n, t in enumerate(tensors):
                    outputs += [(t.name, q[n], 0), (t.scale_name, s[n], 0)]
    return outputs
