"""Cuts: where one expert's one member lies, in nn.Linear orientation [out, in], inside a fused MoE tensor.
Every step is a view, so the outputs cut from one source tensor share one read of it."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Cut:
    expert: int | None = None  # index on the source's first axis (all experts of a layer)
    transpose: bool = False  # the source stores [in, out] (used as x @ W): transpose to [out, in]
    part: int = 0  # which of `parts` members share the output axis (gate 0, up 1)
    parts: int = 1
    interleaved: bool = False  # members alternate row by row (gpt-oss) instead of being concatenated

    def apply(self, w):
        """This cut of `w`, the whole source tensor, as a view; with `expert` None the expert axis is kept."""
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
        """The same cut for every expert at once (the expert axis kept)."""
        return replace(self, expert=None)

    def describe(self, source: str) -> str:
        """Where the output comes from, in Python slicing terms, e.g. `x.gate_up_proj[3].T (part 2 of 2)`."""
        text = source + (f"[{self.expert}]" if self.expert is not None else "")
        text += ".T" if self.transpose else ""
        if self.parts > 1:
            text += f"[{self.part}::{self.parts}]" if self.interleaved else f" (part {self.part + 1} of {self.parts})"
        return text
