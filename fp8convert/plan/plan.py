"""The plan: a pure, deterministic function of (headers, config.json, options).

It fixes every output tensor's name, dtype, shape, shard and byte offset before any data is read, so
the writer streams into shards whose headers are already known, workers can split the work, and a
rerun can tell whether an existing partial output came from the same plan (its fingerprint).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field

from .._version import __version__
from ..formats import get_format
from ..options import Options
from ..safetensors_io import DTYPE_SIZES, FP8, OutputTensor, TensorInfo, layout_shard
from ..source.checkpoint import Source
from .rules import decide, is_linear_weight, module_of

LAYER_PATTERN = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")
SCALE_DTYPE = "F32"


@dataclass(frozen=True)
class TensorPlan:
    """One source tensor and what becomes of it."""

    source: TensorInfo
    quantize: bool
    reason: str | None                    # why it stays in high precision (None when quantized)
    group: str | None                     # fused group: members share one scale in the tensor scheme
    scale_name: str | None = None
    scale_shape: tuple[int, ...] | None = None
    at: int = 0                           # for a piece of a kept tensor (kept_pieces): where it starts in it

    @property
    def name(self) -> str:
        return self.source.name

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every output tensor this source tensor produces."""
        if not self.quantize:
            return [(self.name, self.source.dtype, self.source.shape)]
        return [(self.name, FP8, self.source.shape), (self.scale_name, SCALE_DTYPE, self.scale_shape)]

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for _, dtype, shape in self.outputs())


@dataclass
class Unit:
    """At most one decoder layer: the granularity of shard breaks and of the work split."""

    label: str
    tensors: list[TensorPlan]

    @property
    def in_bytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    @property
    def out_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)

    def atoms(self) -> list[list[TensorPlan]]:
        """Pieces that must never be split: a fused group, or a single tensor."""
        groups: dict[str, list[TensorPlan]] = {}
        atoms: list[list[TensorPlan]] = []
        for t in self.tensors:
            if t.group and t.quantize:
                if t.group not in groups:
                    groups[t.group] = []
                    atoms.append(groups[t.group])
                groups[t.group].append(t)
            else:
                atoms.append([t])
        return atoms


@dataclass
class Shard:
    index: int
    name: str
    units: list[int]                      # indices of units with tensors in this shard
    header: bytes                         # complete header, length prefix included
    tensors: dict[str, OutputTensor]      # placement within the data buffer

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors.values())


@dataclass
class Plan:
    source: Source
    options: Options
    units: list[Unit]
    shards: list[Shard]
    shard_of: dict[str, int]              # output tensor name -> shard index
    ignore_list: list[str]                # linear modules left unquantized, as engines match them
    notes: list[str] = field(default_factory=list)
    fingerprint: str = ""

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for u in self.units for t in u.tensors]

    @property
    def out_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def quantization_config(self) -> dict:
        return get_format(self.options.format).quantization_config(self.options.scheme, self.ignore_list)


def natural_key(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def group_into_units(tensors: list[TensorPlan]) -> list[Unit]:
    """One unit per decoder layer; each tensor outside the layers (embeddings, final norm, head) is a
    unit of its own, so no unit is larger than a layer or a single tensor. Natural name order."""
    by_label: dict[str, list[TensorPlan]] = {}
    for t in tensors:
        m = LAYER_PATTERN.match(t.name)
        by_label.setdefault(m.group(1) if m else t.name, []).append(t)
    return [Unit(lbl, sorted(by_label[lbl], key=lambda t: natural_key(t.name)))
            for lbl in sorted(by_label, key=natural_key)]


def assign_shards(units: list[Unit], max_shard_size: int) -> list[list[tuple[int, list[TensorPlan]]]]:
    """Fill shards in unit order, breaking between units; a unit larger than a shard breaks between atoms."""
    shards: list[list[tuple[int, list[TensorPlan]]]] = [[]]
    used = 0
    for ui, unit in enumerate(units):
        pieces = [unit.tensors] if unit.out_bytes <= max_shard_size else unit.atoms()
        for piece in pieces:
            size = sum(t.out_bytes for t in piece)
            if used and used + size > max_shard_size:
                shards.append([])
                used = 0
            shards[-1].append((ui, piece))
            used += size
    return [s for s in shards if s]


def fingerprint(source: Source, options: Options) -> str:
    """Identifies the output: same fingerprint, same bytes. Covers tool version, options and layout."""
    blob = json.dumps({
        "tool": __version__,
        "options": [options.scheme, options.format, list(options.ignore), options.max_shard_size],
        "tensors": [[t.name, t.dtype, list(t.shape), t.file, t.offset] for t in source.tensors],
        "config": source.config,
    }, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_plan(source: Source, options: Options) -> Plan:
    fmt = get_format(options.format)
    decisions, notes = decide(source.tensors, options.ignore)
    plans = []
    for info in source.tensors:
        d = decisions[info.name]
        if d.quantize:
            plans.append(TensorPlan(info, True, None, d.group, fmt.scale_name(info.name, options.scheme),
                                    fmt.scale_shape(info.shape, options.scheme)))
        else:
            plans.append(TensorPlan(info, False, d.reason, d.group))
    if not any(t.quantize for t in plans):
        notes.append("no tensor is quantized: every weight is kept in high precision")
    units = group_into_units(plans)

    shards, shard_of = [], {}
    layout = assign_shards(units, options.max_shard_size)
    count = len(layout)
    for index, pieces in enumerate(layout):
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        entries = [out for _, atom in pieces for t in atom for out in t.outputs()]
        header, placed = layout_shard(entries)
        shards.append(Shard(index, name, sorted({ui for ui, _ in pieces}), header, placed))
        shard_of.update({n: index for n in placed})

    ignore = sorted({module_of(t.name) for t in plans if not t.quantize and is_linear_weight(t.source, t.reason)},
                    key=natural_key)
    if "lm_head" not in ignore:  # tied heads have no tensor; transformers only skips what the list names
        ignore.insert(0, "lm_head")
    if source.config.get("torch_dtype", source.config.get("dtype")) == "float32":
        notes.append("the model's dtype is float32: serving engines run FP8 kernels with bfloat16/float16 "
                     "activations; consider serving with --dtype bfloat16")
    return Plan(source, options, units, shards, shard_of, ignore, notes, fingerprint(source, options))
