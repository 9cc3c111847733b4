"""What the user asked for, validated once, before anything is read."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import FP8ConvertError

SCHEMES = ("tensor", "channel", "block")
FORMATS = ("compressed-tensors", "fp8")
BLOCK = 128  # block scheme: 128x128 weight blocks, one scale each

def parse_size(value: int | str, what: str = "size") -> int:
    """'5GB' -> 5_000_000_000 (decimal, as transformers' max_shard_size); '2GiB' is binary; ints pass."""
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(I?)B?\s*", str(value).upper())
        if not m or (m.group(3) and not m.group(2)):
            raise FP8ConvertError(f"{what}: cannot read {value!r} as a size (examples: 500MB, 5GB, 2GiB)")
        power = " KMGT".index(m.group(2) or " ")
        size = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    if size <= 0:
        raise FP8ConvertError(f"{what} must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class Options:
    scheme: str = "tensor"
    format: str = "compressed-tensors"
    ignore: tuple[str, ...] = field(default_factory=tuple)
    max_shard_size: int = 5 * 10**9

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise FP8ConvertError(f"--scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.format not in FORMATS:
            raise FP8ConvertError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.format == "fp8" and self.scheme == "channel":
            raise FP8ConvertError("--format fp8 has no per-channel scheme; use --scheme tensor or block, "
                                  "or --format compressed-tensors --scheme channel")
        object.__setattr__(self, "ignore", tuple(self.ignore))
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size, "--max-shard-size"))
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as e:
                    raise FP8ConvertError(f"--ignore {pattern!r}: bad regular expression ({e})") from e
