"""Output formats: how quantized tensors are named and what quantization_config says. One module each."""
from __future__ import annotations

from types import ModuleType

from . import compressed_tensors, fp8

FORMATS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "fp8": fp8}


def get_format(name: str) -> ModuleType:
    return FORMATS[name]
