"""fp8convert: offline BF16 -> FP8 (e4m3) checkpoint conversion with memory that does not grow with the model."""
__version__ = "0.1.0"

# The API imports no torch at import time (the heavy stage modules load on first conversion). It must
# be imported here, after its submodules, so that `fp8convert.plan` is the function, not the module.
from .api import FinalizeReport, Report, finalize_output, plan, quantize  # noqa: E402
from .errors import FP8ConvertError  # noqa: E402

__all__ = ["FP8ConvertError", "FinalizeReport", "Report", "finalize_output", "plan", "quantize", "__version__"]
