"""Shared fixtures: tiny source checkpoints built once per session, cached conversions, readers.

The tests are in unit/ (functions of one module, in-process), integration/ (conversions end to end,
the CLI in child processes, transformers, the fake Hub, Slurm) and gpu/ (the CUDA path); support/
holds what they import (tiny models, the reference implementation, the fake Hub, shared checks).
No test touches the network: every model is generated from a config by `tiny_models.make_model`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Belt and braces: nothing here may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Hub requests that fail on the network are retried (source/hub.py); the tests' fake Hub answers
# at once, so the waits between attempts need not be a second.
os.environ.setdefault("FP8CONVERT_HUB_RETRY_WAIT", "0.01")
# The tiny models' fused layers (k/v of 32 rows) end mid-block, so vLLM cannot load their block-FP8
# outputs and quantize refuses them; the tests convert them anyway (tests/unit/test_vllm_loadability.py
# checks the refusal).
os.environ.setdefault("FP8CONVERT_WRITE_UNLOADABLE", "1")
# Runs that start torch themselves (the CLI in a child process) record its start-up pages in the user's
# cache (run/warmup.py): the tests' go to a cache of their own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fp8convert-tests-cache-")

import pytest
import torch

SUPPORT_DIR = Path(__file__).resolve().parent / "support"
REPO_ROOT = SUPPORT_DIR.parents[1]
# The helpers in support/ (tiny_models, reference, ...) are imported by name from any test folder,
# whatever the working directory or pytest's import mode.
if str(SUPPORT_DIR) not in sys.path:
    sys.path.insert(0, str(SUPPORT_DIR))
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from harness import model_logits, read_safetensors_dir, run_quantize  # noqa: E402
from tiny_models import make_gpt_oss_like, make_model  # noqa: E402


def _quiet_transformers():
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - best effort only
        pass


_quiet_transformers()


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
    """zoo_source(arch) -> Path of the tiny tests/support/zoo.py checkpoint of `arch`, built once per session."""
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
