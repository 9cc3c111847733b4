"""fp8convert: offline BF16 -> FP8 (e4m3) checkpoint conversion with memory that does not grow with the model.

The package is the pipeline: source/ (what the checkpoint holds) -> plan/ (what becomes of each tensor,
where each byte goes) -> run/ (read, quantize, write) -> output/ (manifest, finalize, card), with
formats/ for the output formats, cluster/ for several processes, and api.py, the Python API the cli/
is a thin layer over.
"""
from ._version import __version__
from .api import FinalizeReport, Report, dequantize, finalize_output, make_plan, quantize
from .errors import FP8ConvertError
from .options import Settings

__all__ = ["FP8ConvertError", "FinalizeReport", "Report", "Settings", "dequantize", "finalize_output", "make_plan",
           "quantize", "__version__"]
