"""The one exception every bad input becomes: a single line that names the file or tensor."""


class FP8ConvertError(Exception):
    """A user-facing failure. `str(err)` is one line; the CLI prints it and exits non-zero."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class PlanMismatchError(FP8ConvertError):
    """The output directory holds work from a different plan (or different files)."""


# What both quantizers (run/quantizer.py, run/numpy_quantize.py) say of a weight whose largest values a
# power-of-two scale cannot write (numerics.POW2_OVERFLOW_AMAX), after the tensor's name
POW2_OVERFLOW = (
    "holds values within 3% of float32's maximum (3.3e38 or more), which power-of-two scales would "
    "write as codes that read back as Inf; refusing it (--scheme tensor, channel or block with float "
    "scales can write them)"
)


class UsageError(FP8ConvertError):
    """An option that is wrong in itself (a misspelt value, options that do not go together): the
    command line is wrong, whatever the checkpoint and the machine."""

    exit_code = 2
