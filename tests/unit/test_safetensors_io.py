"""safetensors headers: a tensor named twice is refused, not silently the last entry."""

from __future__ import annotations

import pytest

from fp8convert.errors import FP8ConvertError
from fp8convert.safetensors_io import parse_header


def test_a_tensor_named_twice_is_an_error_naming_it():
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    with pytest.raises(FP8ConvertError, match=r"^x\.safetensors: tensor a\.weight is named twice in the header$"):
        parse_header(f'{{"a.weight": {entry}, "a.weight": {entry}}}'.encode(), "x.safetensors", 8, None)
