"""Lets PyPI's torchvision import in the engine venv, on the engine child's and vLLM's own subprocesses'
path (engine_harness puts this folder on PYTHONPATH).

PyPI's torchvision wheel is built for CUDA torch: its C++ ops library links libtorch_cuda and does not
load with torch's CPU build. torchvision then imports without its ops, except that it registers fake
(meta) kernels for `torchvision::nms` and `qnms` unconditionally, which fails where the ops were never
defined. Defining their schemas here (no kernel: calling them still fails) lets it import, which is all
vLLM's multimodal model files need of it for text prompts: transformers' image processors import
torchvision.transforms. Where the ops library does load (a CPU build of torchvision), nothing changes.
"""

import glob
import importlib.util
import os

_SPEC = importlib.util.find_spec("torchvision")
if _SPEC is not None and _SPEC.submodule_search_locations:
    import torch

    try:
        for _lib in glob.glob(os.path.join(_SPEC.submodule_search_locations[0], "_C*.so")):
            torch.ops.load_library(_lib)
    except OSError:
        for _op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
