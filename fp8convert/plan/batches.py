"""Batches, the units cut to what the device holds at once; and runs, where in the shards their outputs go."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..safetensors_io import TensorInfo
from .plan import Action, Plan, TensorPlan, Unit, unique_inputs

Batch = Unit  # a unit, or a part of one: whole atoms, within the memory budget unless one atom alone is over it

KEPT_PIECE_BYTES = 256 << 20


def resident_bytes(tensors: list[TensorPlan]) -> int:
    """A batch's peak: its input, or its outputs when larger (dequantized weights are 2-4x their codes)."""
    return max(sum(info.nbytes for info in unique_inputs(tensors)), sum(t.out_bytes for t in tensors if t.computed))


def make_batches(units: list[Unit], max_resident: int) -> list[Batch]:
    """Units split between atoms to fit `max_resident`; large kept and fused expert tensors go in pieces."""
    piece_bytes = min(max_resident, KEPT_PIECE_BYTES)
    batches = []
    for unit in units:
        atoms: list[tuple[list[TensorPlan], bool]] = []  # (atom, whether it is a piece of one)
        for atom in unit.atoms():
            if atom[0].cut:
                pieces = expert_pieces(atom, max_resident)
            elif len(atom) == 1:
                pieces = [[piece] for piece in kept_pieces(atom[0], piece_bytes)]
            else:
                pieces = [atom]
            atoms += [(piece, len(pieces) > 1) for piece in pieces]
        if resident_bytes(unit.tensors) <= max_resident and not any(split for _, split in atoms):
            batches.append(Batch(unit.label, [t for atom, _ in atoms for t in atom]))
            continue
        parts: list[list[list[TensorPlan]]] = [[]]
        used, alone = 0, False
        for atom, split in atoms:
            size = resident_bytes(atom)
            if parts[-1] and (split or alone or used + size > max_resident):
                parts.append([])
                used = 0
            parts[-1].append(atom)
            used, alone = used + size, split
        batches += [
            Batch(f"{unit.label} (part {i + 1}/{len(parts)})", [t for atom in part for t in atom])
            for i, part in enumerate(parts)
        ]
    return batches


def first_axis_slice(info: TensorInfo, first: int, count: int) -> TensorInfo:
    """Rows [first, first + count) of a tensor with at least one dimension, as a piece of its file."""
    row = info.nbytes // max(info.shape[0], 1)
    return replace(info, offset=info.offset + first * row, nbytes=count * row, shape=(count, *info.shape[1:]))


def row_ranges(info: TensorInfo, max_bytes: int) -> list[tuple[int, TensorInfo]]:
    """(first row, piece) of `info` in ranges of whole rows of at most `max_bytes` (at least one row)."""
    rows = info.shape[0]
    step = max(1, max_bytes // (info.nbytes // rows))
    return [(r, first_axis_slice(info, r, min(step, rows - r))) for r in range(0, rows, step)]


def kept_pieces(t: TensorPlan, max_bytes: int) -> list[TensorPlan]:
    """A kept tensor over `max_bytes` as ranges of whole rows, so memory does not grow with the vocabulary."""
    info = t.source
    if t.action is not Action.KEEP or t.cut or info.nbytes <= max_bytes or not info.shape or info.shape[0] < 2:
        return [t]
    return [replace(t, at=piece.offset - info.offset, inputs=(piece,)) for _, piece in row_ranges(info, max_bytes)]


def expert_pieces(atom: list[TensorPlan], max_bytes: int) -> list[list[TensorPlan]]:
    """The outputs cut from one fused expert tensor, by ranges of whole experts of at most `max_bytes`."""
    info = atom[0].source
    if info.nbytes <= max_bytes:
        return [atom]
    return [
        [
            replace(t, inputs=(piece,), cut=replace(t.cut, expert=t.cut.expert - first))
            for t in atom
            if first <= t.cut.expert < first + piece.shape[0]
        ]
        for first, piece in row_ranges(info, max_bytes)
    ]


@dataclass(frozen=True)
class Run:
    """Bytes [at, at + nbytes) of output `name` go to shard `shard` from file offset `start` (header
    included); a kept tensor copied in pieces has one run per piece."""

    shard: int
    start: int
    nbytes: int
    name: str
    at: int


def output_runs(plan: Plan, tensors: list[TensorPlan]) -> list[Run]:
    runs = []
    for t in tensors:
        for name, _, _ in t.outputs():
            shard = plan.shards[plan.shard_of[name]]
            placed = shard.tensors[name]
            piece = t.action is Action.KEEP and t.cut is None  # a kept tensor, or a piece of one
            at, nbytes = (t.at, t.source.nbytes) if piece else (0, placed.nbytes)
            runs.append(Run(shard.index, len(shard.header) + placed.offset + at, nbytes, name, at))
    return sorted(runs, key=lambda run: (run.shard, run.start))
