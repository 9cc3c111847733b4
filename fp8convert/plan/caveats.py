"""Warnings about where a planned output will not load, each with a code that other code acts on.

Code that acts on a warning (the model card's transformers verdict, the tests) reads its Caveat, never
its wording.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Caveat(enum.Enum):
    """What a warning means for the consumers."""

    TRANSFORMERS_CANNOT_LOAD = "transformers-cannot-load"
    TRANSFORMERS_MISREADS = "transformers-misreads"  # loads, but some weights dequantize wrongly
    VLLM_CANNOT_LOAD = "vllm-cannot-load"
    VLLM_TP_LIMITS = "vllm-tp-limits"  # loads at some tensor-parallel sizes only


@dataclass(frozen=True)
class PlanWarning:
    caveat: Caveat
    text: str
