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
from dataclasses import dataclass, field, replace

from . import __version__
from .formats import get_format
from .options import Options
from .rules import decide, is_linear_weight, module_of
from .safetensors_io import DTYPE_SIZES, OutputTensor, TensorInfo, layout_shard
from .source import Source

LAYER_PATTERN = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")
FP8 = "F8_E4M3"
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


@dataclass
class Batch:
    unit: Unit
    atoms: list[list[TensorPlan]]
    label: str

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for atom in self.atoms for t in atom]

    @property
    def in_bytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    @property
    def files(self) -> list[str]:
        """The source files this batch reads, sorted."""
        return sorted({t.source.file for t in self.tensors})


KEPT_PIECE_BYTES = 256 << 20


def make_batches(units: list[Unit], max_resident: int) -> list[Batch]:
    """Split units over the memory budget between atoms (a fused group is never split). A kept tensor
    larger than a piece is copied piece by piece, each piece a batch of its own."""
    piece_bytes = min(max_resident, KEPT_PIECE_BYTES)
    batches = []
    for unit in units:
        atoms: list[tuple[list[TensorPlan], bool]] = []  # (atom, whether it is a piece)
        for atom in unit.atoms():
            pieces = kept_pieces(atom[0], piece_bytes) if len(atom) == 1 else []
            if len(pieces) > 1:
                atoms += [([piece], True) for piece in pieces]
            else:
                atoms.append((atom, False))
        if unit.in_bytes <= max_resident and not any(split for _, split in atoms):
            batches.append(Batch(unit, unit.atoms(), unit.label))
            continue
        parts: list[list[list[TensorPlan]]] = [[]]
        used, alone = 0, False
        for atom, split in atoms:
            size = sum(t.source.nbytes for t in atom)
            if parts[-1] and (split or alone or used + size > max_resident):
                parts.append([])
                used = 0
            parts[-1].append(atom)
            used, alone = used + size, split
        batches += [Batch(unit, p, f"{unit.label} (part {i + 1}/{len(parts)})") for i, p in enumerate(parts)]
    return batches


def kept_pieces(t: TensorPlan, max_bytes: int) -> list[TensorPlan]:
    """A kept tensor over `max_bytes` as ranges of whole rows of at most that size (at least one row).
    Kept tensors are only checked for NaN/Inf and copied, so nothing needs one whole; in pieces, memory
    does not grow with the vocabulary (an embedding can be several GB)."""
    info = t.source
    if t.quantize or info.nbytes <= max_bytes or not info.shape or info.shape[0] < 2:
        return [t]
    row = info.nbytes // info.shape[0]
    step = max(1, max_bytes // row)
    return [replace(t, at=r * row, source=replace(info, offset=info.offset + r * row, nbytes=n * row,
                                                    shape=(n, *info.shape[1:])))
            for r in range(0, info.shape[0], step) for n in [min(step, info.shape[0] - r)]]


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
