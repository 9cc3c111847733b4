"""Shared fixtures: tiny source checkpoints built once per session, cached conversions, readers.

No test touches the network: every model is generated from a config by `tiny_models.make_model`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# Belt and braces: nothing here may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Hub requests that fail on the network are retried (source/hub_calls.py); the tests' fake Hub answers
# at once, so the waits between attempts need not be a second.
os.environ.setdefault("FP8CONVERT_HUB_RETRY_WAIT", "0.01")
# The tiny models' fused layers (k/v of 32 rows) end mid-block, so vLLM cannot load their block-FP8
# outputs and quantize refuses them; the tests convert them anyway (tests/unit/test_vllm_loadability.py
# checks the refusal).
os.environ.setdefault("FP8CONVERT_WRITE_UNLOADABLE", "1")
# Runs that start torch themselves (the CLI in a child process) record its start-up pages in the user's
# cache (run/startup_pages.py): the tests' go to a cache of their own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fp8convert-tests-cache-")

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
# Helpers (tiny_models, reference) are imported by name whatever pytest's import mode is.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tiny_models import KINDS, make_gpt_oss_like, make_model  # noqa: E402

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


def _quiet_transformers():
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - best effort only
        pass


_quiet_transformers()


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


# ------------------------------------------------------------------ session fixtures


@pytest.fixture(scope="session")
def source_model(tmp_path_factory):
    """source_model(kind, dtype=torch.bfloat16) -> Path of a tiny checkpoint, built once."""
    cache: dict = {}

    def get(kind: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        key = (kind, dtype)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"src-{kind}-{str(dtype).rsplit('.', 1)[-1]}")
            cache[key] = make_model(kind, d / "model", dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def source_tensors(source_model):
    cache: dict = {}

    def get(kind: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        key = (kind, dtype)
        if key not in cache:
            cache[key] = read_safetensors_dir(source_model(kind, dtype))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, source_model):
    """converted(kind, fmt, scheme, dtype=bf16, **options) -> output dir; each combination runs once.

    A conversion that raised is re-raised for every test that asks for it."""
    cache: dict = {}

    def get(kind: str, fmt: str, scheme: str, dtype: torch.dtype = torch.bfloat16, **options) -> Path:
        key = (kind, fmt, scheme, dtype, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in cache:
            src = source_model(kind, dtype)
            out = tmp_path_factory.mktemp(f"out-{kind}-{fmt}-{scheme}") / "out"
            try:
                run_quantize(src, out, scheme=scheme, format=fmt, **options)
                cache[key] = out
            except Exception as e:  # remember the failure: don't redo it for every test
                cache[key] = e
        res = cache[key]
        if isinstance(res, Exception):
            raise res
        return res

    return get


@pytest.fixture(scope="session")
def zoo_source(tmp_path_factory):
    """zoo_source(arch) -> Path of the tiny tests/zoo.py checkpoint of `arch`, built once per session."""
    import zoo

    cache: dict = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = zoo.make(arch, tmp_path_factory.mktemp(f"zoo-{arch}") / "model")
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def zoo_converted(tmp_path_factory, zoo_source):
    """zoo_converted(arch, fmt, scheme) -> (output dir, report); each combination converts once. A
    refusal is re-raised for every test that asks for it."""
    cache: dict = {}

    def get(arch: str, fmt: str, scheme: str):
        key = (arch, fmt, scheme)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"zoo-out-{arch}-{fmt}-{scheme}") / "out"
            try:
                cache[key] = (out, run_quantize(zoo_source(arch), out, scheme=scheme, format=fmt))
            except Exception as e:
                cache[key] = e
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    return get


@pytest.fixture(scope="session")
def unknown_fused_experts(tmp_path_factory) -> Path:
    """gpt-oss's fused 3-D experts under a model_type the registry does not know."""
    return make_gpt_oss_like(tmp_path_factory.mktemp("mystery") / "model", model_type="mystery_moe")


@pytest.fixture(scope="session")
def source_logits(source_model):
    """source_logits(kind) -> float32 logits of the source model on PROMPT_IDS."""
    cache: dict = {}

    def get(kind: str) -> torch.Tensor:
        if kind not in cache:
            cache[kind] = model_logits(source_model(kind))
        return cache[kind]

    return get


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
