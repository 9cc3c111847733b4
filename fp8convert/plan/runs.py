"""Output runs: the contiguous byte ranges of the output shards that a batch's outputs fill, each filled in
one buffer and written with a few large writes."""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Action, Plan, TensorPlan


@dataclass(frozen=True)
class Piece:
    """Bytes [at, at + nbytes) of output tensor `name`, at `offset` in their run."""

    name: str
    at: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Run:
    """Bytes contiguous in one output shard: `nbytes` from file offset `start` (header included)."""

    shard: int
    start: int
    nbytes: int
    pieces: tuple[Piece, ...]


# A merged run stops growing at this size: a run is written once all of its outputs are computed, so
# runs of a few tens of MB leave for the disk while the rest of the batch is still being quantized.
RUN_BYTES = 64 << 20


def output_runs(plan: Plan, tensors: list[TensorPlan], merge: bool = True, max_bytes: int = RUN_BYTES) -> list[Run]:
    """The ranges `tensors`' outputs fill, in file order, each of at most `max_bytes` unless one output alone
    is larger; with `merge` False, one run per output (piece)."""
    spans = []  # (shard, file offset, name, at, nbytes)
    for t in tensors:
        for name, _, _ in t.outputs():
            shard = plan.shards[plan.shard_of[name]]
            placed = shard.tensors[name]
            piece = t.action is Action.KEEP and t.cut is None  # a kept tensor, or a piece of one
            at, nbytes = (t.at, t.source.nbytes) if piece else (0, placed.nbytes)
            spans.append((shard.index, len(shard.header) + placed.offset + at, name, at, nbytes))
    spans.sort()
    open_runs: list[list] = []  # [shard, start, nbytes, pieces], the last one still growing
    for shard, start, name, at, nbytes in spans:
        last = open_runs[-1] if open_runs else None
        if merge and last and last[0] == shard and last[1] + last[2] == start and last[2] + nbytes <= max_bytes:
            last[3].append(Piece(name, at, nbytes, last[2]))
            last[2] += nbytes
        else:
            open_runs.append([shard, start, nbytes, [Piece(name, at, nbytes, 0)]])
    return [Run(shard, start, nbytes, tuple(pieces)) for shard, start, nbytes, pieces in open_runs]
