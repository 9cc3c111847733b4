"""The plan's records: every output tensor's name, dtype, shape, shard and byte offset, and how it is made,
fixed before any data is read, so shards stream into known headers and workers can split the work."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace

from ..formats import CONFIGS
from ..options import Options
from ..safetensors_io import DTYPE_SIZES, FP8, OutputTensor, TensorInfo, layout_shard
from ..source.checkpoint import Source
from .family import Architecture

LAYER_PATTERN = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")


class Action(enum.Enum):
    KEEP = "keep"  # the source bytes (or a cut of them) unchanged
    QUANTIZE = "quantize"  # FP8 or FP4 codes and their scales from a high-precision weight
    DEQUANTIZE = "dequantize"  # a high-precision weight from FP8 codes and scale: float32(q) * scale, cast once
    REQUANTIZE = "requantize"  # FP8 codes and scales, as QUANTIZE makes them, from an FP8 weight's float32 values
    PASS = "pass"  # an FP8 weight's codes and scale as they are: the output's scheme is the source's


COMPUTED = (Action.QUANTIZE, Action.REQUANTIZE, Action.DEQUANTIZE)


@dataclass(frozen=True)
class Cut:
    """One expert's one member, as nn.Linear [out, in], inside a fused MoE tensor. Every step is a view, so
    the outputs cut from one source tensor share one read of it."""

    expert: int | None = None  # index on the source's first axis (all experts of a layer)
    transpose: bool = False  # the source stores [in, out] (used as x @ W): transpose to [out, in]
    part: int = 0  # which of `parts` members share the output axis (gate 0, up 1)
    parts: int = 1
    interleaved: bool = False  # members alternate row by row (gpt-oss) instead of being concatenated

    def apply(self, w):
        if self.expert is not None:
            w = w[self.expert]
        if self.transpose:
            w = w.transpose(-1, -2)
        if self.parts > 1:
            if self.interleaved:
                w = w[..., self.part :: self.parts, :]
            else:
                rows = w.shape[-2] // self.parts
                w = w[..., self.part * rows : (self.part + 1) * rows, :]
        return w

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(source_shape[1:] if self.expert is not None else source_shape)
        if self.transpose:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        shape[-2] //= self.parts
        return tuple(shape)

    def across_experts(self) -> Cut:
        return replace(self, expert=None)

    def describe(self, source: str) -> str:
        """Where the output comes from, in Python slicing terms, e.g. `x.gate_up_proj[3].T (part 2 of 2)`."""
        text = source + (f"[{self.expert}]" if self.expert is not None else "")
        text += ".T" if self.transpose else ""
        if self.parts > 1:
            text += f"[{self.part}::{self.parts}]" if self.interleaved else f" (part {self.part + 1} of {self.parts})"
        return text


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor (and its scale, when quantized) and how it is made from the source."""

    name: str  # the output tensor's name
    inputs: tuple[TensorInfo, ...]  # the weight, then (FP8 sources) its scale, then a static activation scale
    action: Action
    reason: str | None  # why it stays in high precision (None when quantized)
    group: str | None  # fused group: members share one scale in the tensor scheme, one global scale in NVFP4
    scale_name: str | None = None
    scale_shape: tuple[int, ...] | None = None
    cut: Cut | None = None  # the part of the source it is (fused experts); None: all of it
    at: int = 0  # for a piece of a kept tensor (kept_pieces): where it starts in it
    out_dtype: str | None = None  # DEQUANTIZE: the high-precision dtype written
    input_scale_name: str | None = None  # a static activation scale (the last input) copied to this name
    scale_dtype: str = "F32"  # U8 for MX E8M0 bytes, F8_E4M3 for NVFP4's; PASS: the source scale's own dtype
    packed: bool = False  # FP4: `name` is X.weight_packed, two 4-bit values a byte
    global_scale_name: str | None = None  # NVFP4: the float32 scale shared by the fused set
    scheme: str | None = None  # the scheme it is quantized in (a recipe's, else --scheme)

    @property
    def source(self) -> TensorInfo:
        return self.inputs[0]

    @property
    def source_packed(self) -> bool:
        return self.source.dtype == "U8" and self.source.name.endswith(".weight_packed")

    @property
    def source_scale(self) -> TensorInfo | None:
        return self.inputs[1] if self.source.dtype == FP8 or self.source_packed else None

    @property
    def quantize(self) -> bool:
        """The output is FP8 (or FP4)."""
        return self.action in (Action.QUANTIZE, Action.REQUANTIZE, Action.PASS)

    @property
    def computed(self) -> bool:
        """The output is computed on the device (not a plain copy of source bytes)."""
        return self.action in COMPUTED or self.cut is not None

    @property
    def copies(self) -> list[tuple[TensorInfo, str]]:
        """(source tensor, output name) of each plain byte copy."""
        if self.action is Action.KEEP and self.cut is None:
            return [(self.source, self.name)]
        if self.action is Action.PASS:
            return list(zip(self.inputs, [self.name, self.scale_name, self.input_scale_name]))
        if self.input_scale_name:  # a requantized weight's static activation scale
            return [(self.inputs[-1], self.input_scale_name)]
        return []

    @property
    def shape(self) -> tuple[int, ...]:
        if self.source_packed:
            return (self.source.shape[0], self.source.shape[1] * 2)
        return self.cut.shape(self.source.shape) if self.cut else self.source.shape

    @property
    def in_bytes(self) -> int:
        if not self.cut:
            return sum(info.nbytes for info in self.inputs)
        return math.prod(self.shape) * DTYPE_SIZES[self.source.dtype]

    @property
    def dtype(self) -> str:
        if self.action is Action.KEEP:
            return self.source.dtype
        if self.action is Action.DEQUANTIZE:
            return self.out_dtype
        return "U8" if self.packed else FP8

    @property
    def written_names(self) -> list[str]:
        """A quantized weight's outputs in the order the quantizer makes them."""
        return [self.name, self.scale_name] + ([self.global_scale_name] if self.global_scale_name else [])

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every output tensor."""
        outputs = [(self.name, self.dtype, (self.shape[0], self.shape[1] // 2) if self.packed else self.shape)]
        if self.quantize:
            outputs.append((self.scale_name, self.scale_dtype, self.scale_shape))
        if self.global_scale_name:
            outputs.append((self.global_scale_name, "F32", (1,)))
        if self.input_scale_name:  # per tensor, shaped as the format shapes a per-tensor scale ([] or [1])
            outputs.append((self.input_scale_name, self.inputs[-1].dtype, self.scale_shape))
        return outputs

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for _, dtype, shape in self.outputs())


def unique_inputs(tensors: list[TensorPlan]) -> list[TensorInfo]:
    """The source tensors `tensors` read, each once (outputs cut from one source share it)."""
    return list({info.name: info for t in tensors for info in t.inputs}.values())


@dataclass
class Unit:
    """At most one decoder layer: the granularity of shard breaks and of the work split; a batch is one too."""

    label: str
    tensors: list[TensorPlan]

    @property
    def in_bytes(self) -> int:
        return sum(info.nbytes for info in unique_inputs(self.tensors))

    @property
    def out_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)

    @property
    def files(self) -> list[str]:
        return sorted({info.file for t in self.tensors for info in t.inputs})

    def atoms(self) -> list[list[TensorPlan]]:
        """Pieces that must never be split: every output cut from one source tensor (so it is read
        once), a quantized fused group (one scale), or a single tensor."""
        atoms: dict[tuple[str, str], list[TensorPlan]] = {}
        for t in self.tensors:
            shares_scale = t.group and t.action in (Action.QUANTIZE, Action.REQUANTIZE)
            key = ("cut", t.source.name) if t.cut else ("group", t.group) if shares_scale else ("tensor", t.name)
            atoms.setdefault(key, []).append(t)
        return list(atoms.values())


@dataclass
class Shard:
    index: int
    name: str
    units: list[int]  # indices of units with tensors in this shard
    header: bytes  # complete header, length prefix included
    tensors: dict[str, OutputTensor]  # placement within the data buffer

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors.values())


@dataclass
class Plan:
    source: Source
    options: Options
    units: list[Unit]
    shards: list[Shard]
    shard_of: dict[str, int]  # output tensor name -> shard index
    ignore_list: list[str]  # linear modules left unquantized, as engines match them
    notes: list[str]
    fingerprint: str
    architecture: Architecture | None  # the registry's family; None: generic rules only
    # what the user asked for that did not happen as asked, and where engines will not load the output
    warnings: list[str]
    scheme_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a recipe's other schemes and their modules

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for u in self.units for t in u.tensors]

    @property
    def out_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def source_scheme(self) -> str:
        """An FP8 source's scheme (how its scales are laid out); "" for a high-precision source."""
        return self.source.quant.scheme if self.source.quant else ""

    @property
    def static_activations(self) -> bool:
        """Static activation scales are carried (FP8 source with them, tensor scheme out)."""
        return any(t.input_scale_name for t in self.tensors)

    def quantization_config(self) -> dict | None:
        """The output's quantization_config; None for a dequantized output."""
        o = self.options
        if o.dequantize:
            return None
        ignore, groups = tuple(self.ignore_list), self.scheme_groups
        return CONFIGS[o.format](o.scheme, ignore, o.scale_format, self.static_activations, groups=groups).to_dict()

    def units_in(self, shards: set[int], written: dict[int, set[int]] | None = None) -> list[Unit]:
        """The units cut down to the tensors whose outputs land in `shards`, less those `written` says are
        written. An atom's outputs share one shard, so workers owning disjoint shards read no tensor twice."""
        units, written = [], written or {}
        for ui, unit in enumerate(self.units):
            wanted = {shard for shard in shards if ui not in written.get(shard, ())}
            kept = [t for t in unit.tensors if self.shard_of[t.name] in wanted]
            if kept:
                units.append(unit if len(kept) == len(unit.tensors) else Unit(unit.label, kept))
        return units


def natural_key(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def group_into_units(tensors: list[TensorPlan]) -> list[Unit]:
    """One unit per decoder layer, one per tensor outside the layers."""
    by_label: dict[str, list[TensorPlan]] = {}
    for t in tensors:
        m = LAYER_PATTERN.match(t.name)
        by_label.setdefault(m.group(1) if m else t.name, []).append(t)
    return [
        Unit(lbl, sorted(by_label[lbl], key=lambda t: natural_key(t.name))) for lbl in sorted(by_label, key=natural_key)
    ]


def lay_out_shards(units: list[Unit], max_shard_size: int) -> tuple[list[Shard], dict[str, int]]:
    """The shards with complete headers, and each output's shard. Shards break between units, and in a unit
    larger than a shard between its atoms."""
    layout: list[list[tuple[int, list[TensorPlan]]]] = [[]]
    used = 0
    for ui, unit in enumerate(units):
        for piece in [unit.tensors] if unit.out_bytes <= max_shard_size else unit.atoms():
            size = sum(t.out_bytes for t in piece)
            if used and used + size > max_shard_size:
                layout.append([])
                used = 0
            layout[-1].append((ui, piece))
            used += size
    layout = [pieces for pieces in layout if pieces]
    shards, shard_of = [], {}
    for index, pieces in enumerate(layout):
        name = f"model-{index + 1:05d}-of-{len(layout):05d}.safetensors"
        header, placed = layout_shard([out for _, atom in pieces for t in atom for out in t.outputs()])
        shards.append(Shard(index, name, sorted({ui for ui, _ in pieces}), header, placed))
        shard_of.update({n: index for n in placed})
    return shards, shard_of
