"""How sizes and counts are written for people: '2.49 GB', '1 tensor', '2GiB' as an option value."""

from __future__ import annotations

BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def format_size(nbytes: int | float) -> str:
    """Bytes for reading, in decimal units as the model card and `inspect` print them: '2.49 GB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"


def size_text(nbytes: int) -> str:
    """A size as a user types it for an option, exactly (options.parse_size reads it back to `nbytes`):
    5000000000 -> '5GB', 2147483648 -> '2GiB', 1500000000 -> '1500MB'; plain bytes when no unit divides."""
    candidates = [f"{nbytes // size}{unit}" for unit, size in (*DECIMAL_UNITS, *BINARY_UNITS) if nbytes % size == 0]
    return min(candidates, key=len, default=str(nbytes))


def size_option(nbytes: int) -> str:
    """A size to suggest for an option, rounded down to whole MiB ('512MiB', '2GiB')."""
    return size_text(max(1, nbytes >> 20) << 20)


def plural(count: int, word: str, words: str | None = None) -> str:
    """'1 tensor', '3 tensors', '0 shards' ('words' for irregular plurals)."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


def listed(names: list[str]) -> str:
    """'a, b, c and 4 more'."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more
