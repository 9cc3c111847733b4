"""fp8convert: offline BF16 -> FP8 (e4m3) checkpoint conversion with memory that does not grow with the model."""
__version__ = "0.1.0"

from .errors import FP8ConvertError  # noqa: E402

__all__ = ["FP8ConvertError", "Report", "plan", "quantize", "__version__"]


def __getattr__(name):
    # The API is imported on first use so that `import fp8convert` (and the CLI) stay light.
    if name in ("Report", "plan", "quantize"):
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'fp8convert' has no attribute {name!r}")
