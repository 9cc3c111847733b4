"""fp8convert: offline BF16 -> FP8 (e4m3) checkpoint conversion with memory that does not grow with the model.

The pipeline runs source/ -> plan/ -> run/ -> output/; api.py is the Python API, and cli/ a thin layer over it.
"""

import importlib

from ._version import __version__
from .errors import FP8ConvertError

# The API's names, imported on first use: the program (__main__.py) imports this package before it can
# catch Ctrl-C, so the package itself imports next to nothing.
API = ("FinalizeReport", "Report", "dequantize", "finalize_output", "make_plan", "quantize")
_LAZY = dict.fromkeys(API, "api") | {"Settings": "options"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FP8ConvertError", "Settings", "__version__", *API]
