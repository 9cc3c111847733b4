"""What the tests share besides fixtures: every output format with its schemes, the product's Python
API run on CPU, readers of the checkpoints it writes, and logits through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import KINDS
from zoo import MORE_ARCHS, ZOO_ARCHS

REPO_ROOT = Path(__file__).resolve().parents[2]

# Every output format with every scheme it has.
FORMAT_SCHEMES = [
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("compressed-tensors", "block"),
    ("fp8", "tensor"),
    ("fp8", "block"),
    ("compressed-tensors", "mxfp8"),
]
FS_IDS = ["ct-tensor", "ct-channel", "ct-block", "fp8-tensor", "fp8-block", "ct-mxfp8"]


def in_turn(subjects, combos, per_subject: int = 1) -> dict:
    """The combinations each subject (an architecture, a model kind, a source) gets in the fast loop: the
    next ones for the next subject, so the fast loop still meets every subject and every combination."""
    return {
        s: [combos[(n * per_subject + k) % len(combos)] for k in range(per_subject)] for n, s in enumerate(subjects)
    }


def cases_in_turn(subjects, combos, ids, per_subject: int = 1) -> list:
    """pytest params for every subject in every combination (`subject-id`); all but in_turn's are
    marked slow (all of them with per_subject=0)."""
    fast = in_turn(subjects, combos, per_subject)
    return [
        pytest.param(s, *c, id=f"{s}-{i}", marks=() if c in fast[s] else pytest.mark.slow)
        for s in subjects
        for c, i in zip(combos, ids)
    ]


# Each tiny model kind with each format and scheme; the fast loop takes two for each kind.
ALL_CASES = cases_in_turn(KINDS, FORMAT_SCHEMES, FS_IDS, per_subject=2)

# The zoo's architectures in every combination (MORE_ARCHS in two), converted once each by conftest.py's
# zoo_converted for every test that takes these cases.
ZOO_CASES = cases_in_turn(ZOO_ARCHS, FORMAT_SCHEMES, FS_IDS)
MORE_COMBOS = [("compressed-tensors", "tensor"), ("fp8", "block")]
MORE_ZOO_CASES = cases_in_turn(MORE_ARCHS, MORE_COMBOS, ["ct-tensor", "fp8-block"])

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


def tamper(out: Path, name: str, change) -> None:
    """Rewrite the shard holding tensor `name` with `change` applied to it."""
    from safetensors.torch import load_file, save_file

    for shard in Path(out).glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name] = change(tensors[name].clone())
            save_file(tensors, shard, metadata={"format": "pt"})
            return
    raise AssertionError(name)


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
