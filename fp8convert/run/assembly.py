"""A batch's outputs assembled into the byte runs they occupy in the output shards (plan/runs.py): each run
leaves the device in a few large copies and writes, not one per tensor (a MoE layer has hundreds)."""

from __future__ import annotations

import torch

from ..plan.runs import Run


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in memory order, as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(0).view(torch.uint8)


class BatchOutput:
    """One batch's run buffers, each handed over once its last piece is in. A run of one piece is that
    tensor's own bytes (no copy); a larger one gets a device buffer, each piece copied into its place."""

    def __init__(self, runs: list[Run], device: torch.device):
        self.runs, self.device = runs, device
        self.buffers: list[torch.Tensor | None] = [None] * len(runs)
        self.where = {(p.name, p.at): (i, p) for i, run in enumerate(runs) for p in run.pieces}
        self.pieces_left = [len(run.pieces) for run in runs]

    def put_all(self, outputs: list[tuple[str, torch.Tensor, int]]) -> list[tuple[Run, torch.Tensor]]:
        """Take outputs (name, tensor, byte offset in that output); return the runs they completed, with
        their bytes, once (the caller drops each after writing it). The copies go in one multi-tensor
        launch: a launch per output costs the main thread about 20 us, and a MoE layer has hundreds."""
        targets, sources, completed = [], [], []
        for name, tensor, at in outputs:
            i, piece = self.where[(name, at)]
            raw = raw_bytes(tensor)
            if raw.numel() != piece.nbytes:
                raise AssertionError(f"{name}: {raw.numel()} bytes at {at}, the plan says {piece.nbytes}")
            if len(self.runs[i].pieces) == 1:
                self.buffers[i] = raw
            else:
                if self.buffers[i] is None:
                    self.buffers[i] = torch.empty(self.runs[i].nbytes, dtype=torch.uint8, device=self.device)
                targets.append(self.buffers[i][piece.offset : piece.offset + piece.nbytes])
                sources.append(raw)
            self.pieces_left[i] -= 1
            if not self.pieces_left[i]:
                completed.append(i)
        if targets:
            torch._foreach_copy_(targets, sources)
        done = [(self.runs[i], self.buffers[i]) for i in completed]
        for i in completed:
            self.buffers[i] = None
        return done

    def check_complete(self) -> None:
        missing = sum(self.pieces_left)
        if missing:
            raise AssertionError(f"{missing} outputs of the batch were never produced")


def shares_storage(data: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether `data` is a view of `buf`'s memory (which must then live until `data` is written)."""
    return bool(data.numel()) and data.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
