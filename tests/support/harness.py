"""What the tests share besides fixtures: every output format with its schemes, the product's Python
API run on CPU, readers of the checkpoints it writes, and logits through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_models import KINDS

REPO_ROOT = Path(__file__).resolve().parents[2]

# Every output format with every scheme it has, and each tiny model kind with each of them.
FORMAT_SCHEMES = [
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("compressed-tensors", "block"),
    ("fp8", "tensor"),
    ("fp8", "block"),
    ("compressed-tensors", "mxfp8"),
]
FS_IDS = ["ct-tensor", "ct-channel", "ct-block", "fp8-tensor", "fp8-block", "ct-mxfp8"]
ALL_CASES = [pytest.param(k, f, s, id=f"{k}-{i}") for k in KINDS for (f, s), i in zip(FORMAT_SCHEMES, FS_IDS)]

# A fixed prompt of token ids (no tokenizer involved).
PROMPT_IDS = [1, 5, 17, 99, 200, 42, 7, 255, 3, 64, 128, 31, 77, 150]


def fp8convert_module():
    """The product, imported lazily so a missing package fails tests, not collection."""
    import fp8convert

    return fp8convert


def run_quantize(src, out, **kwargs):
    """Run the product's Python API on CPU. Returns its report."""
    kwargs.setdefault("device", "cpu")
    return fp8convert_module().quantize(str(src), str(out), **kwargs)


# ------------------------------------------------------------------ checkpoint readers


def read_safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path` (names must be unique)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} appears in more than one shard of {path}"
            out[k] = v
    return out


def read_json(path):
    return json.loads(Path(path).read_text())


def shard_headers(path) -> dict[str, dict]:
    """{shard file name: raw safetensors header (incl. __metadata__)} read without tensor data."""
    import struct

    heads = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            heads[f.name] = json.loads(fh.read(n))
    return heads


def load_causal_lm(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def model_logits(path_or_model) -> torch.Tensor:
    model = load_causal_lm(path_or_model) if isinstance(path_or_model, (str, Path)) else path_or_model
    ids = torch.tensor([PROMPT_IDS])
    return model(ids).logits.float()[0]
