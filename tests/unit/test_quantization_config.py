"""quantization_config is parsed and written in one place per format: what the writer puts in config.json
reads back as the same record, for every scheme and option fp8convert writes."""

from __future__ import annotations

import json

import pytest

from fp8convert.errors import FP8ConvertError
from fp8convert.formats import CONFIGS, read_quantization_config

WRITTEN = [("compressed-tensors", scheme, "float", False) for scheme in ("tensor", "channel", "block", "mxfp8")] + [
    ("compressed-tensors", "tensor", "float", True),
    ("compressed-tensors", "block", "ue8m0", False),
    ("fp8", "tensor", "float", False),
    ("fp8", "tensor", "float", True),
    ("fp8", "block", "float", False),
    ("fp8", "block", "ue8m0", False),
]


@pytest.mark.parametrize("fmt,scheme,scale_format,static", WRITTEN)
def test_what_is_written_reads_back_as_the_same_record(fmt, scheme, scale_format, static):
    written = CONFIGS[fmt](scheme, ("lm_head", "re:.*gate$"), scale_format, static)
    qc = json.loads(json.dumps(written.to_dict()))  # as config.json holds it
    read = read_quantization_config({"quantization_config": qc}, "out/config.json")
    assert (read.format, read.scheme, read.ignore, read.scale_format, read.static_activations, read.unkept) == (
        fmt,
        scheme,
        ("lm_head", "re:.*gate$"),
        scale_format,
        static,
        (),
    )
    assert type(read).from_dict(qc, "src/config.json", source=scheme != "mxfp8").scheme == scheme


def test_an_output_lists_what_a_source_is_refused_for():
    qc = CONFIGS["compressed-tensors"]("tensor").to_dict() | {"kv_cache_scheme": {"num_bits": 8}}
    read = read_quantization_config({"quantization_config": qc}, "out/config.json")
    assert read.unkept == ("declares a kv_cache_scheme, but fp8convert writes no KV-cache scales",)
    with pytest.raises(
        FP8ConvertError, match=r"^src/config.json: kv_cache_scheme is set: .* not supported in a source"
    ):
        CONFIGS["compressed-tensors"].from_dict(qc, "src/config.json", source=True)
