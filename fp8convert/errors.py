"""The one exception every bad input becomes: a single line that names the file or tensor."""


class FP8ConvertError(Exception):
    """`str(err)` is one line; the CLI prints it and exits non-zero."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def first_line(error: BaseException) -> str:
    """An outside error's own words for a one-line message: its first line, or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class PlanMismatchError(FP8ConvertError):
    """The output directory holds work from a different plan (or different files)."""


class UsageError(FP8ConvertError):
    """An option wrong in itself (a misspelt value, options that do not go together), whatever the checkpoint."""

    exit_code = 2
