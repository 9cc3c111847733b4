"""Tensor parallelism: which quantized dims vLLM 0.33 splits at a TP size, and where its rules fail.

Column-parallel linears split their output dim, row-parallel ones their input dim, and the split must
divide (distributed/utils.py `divide`); k/v with fewer heads than ranks are replicated per head. 128x128
blocks want every per-rank size a multiple of 128 once TP > 1 (`validate_fp8_block_shape`). MoE experts
split their intermediate size: compressed-tensors' block MoE wants multiples of 128 even at TP 1, the fp8
format's falls back to gcd(128, per-rank size, hidden) blocks of at least 32 (`refine_fp8_moe_block_shape`).
MXFP8 wants per-rank input sizes (row-parallel, experts' intermediate) in multiples of 32 (its scale groups),
FP4 in multiples of its groups (16 for NVFP4, 32 for MXFP4).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..options import BLOCK, FP4_SCHEMES, GROUP_SIZE, Format, Scheme
from .family import Caveat, PlanWarning, config_value
from .rules import experts_of, module_of

ROW_PARALLEL = set("o_proj down_proj out_proj w2 c_proj dense_4h_to_h fc2 wo linear_2".split())
REPLICATED = set(
    "q_a_proj kv_a_proj_with_mqa fc1_latent_proj fc2_latent_proj eh_proj per_layer_input_gate "
    "per_layer_projection".split()
)
KV_LEAVES = {"k_proj", "v_proj"}
MIN_REFINED_BLOCK = 32  # the smallest block vLLM's fp8 MoE refinement accepts


@dataclass(frozen=True)
class Split:
    """A dim vLLM divides among tensor-parallel ranks."""

    modules: str  # which modules, layer numbers as '*' (e.g. model.layers.*.self_attn.o_proj)
    axis: str  # "output", "input" or "expert intermediate"
    size: int
    heads: int | None = None  # k/v: number of KV heads (fewer than ranks: replicated per head)


def split_of(name: str, shape: tuple[int, int], config: dict) -> Split | None:
    """How vLLM splits one quantized 2-D weight, or None when it replicates it."""
    module = module_of(name)
    leaf = module.rsplit(".", 1)[-1]
    modules = re.sub(r"\.\d+\.", ".*.", module)
    out, inp = shape
    if experts_of(name):
        experts = re.sub(r"\.experts\.\*\.[^.]+$", ".experts", modules)
        return Split(experts, "expert intermediate", inp if leaf in ("down_proj", "w2") else out)
    if leaf in REPLICATED:
        return None
    if leaf in ROW_PARALLEL:
        return Split(modules, "input", inp)
    heads = config_value(config, "num_key_value_heads") if leaf in KV_LEAVES else None
    return Split(modules, "output", out, heads if isinstance(heads, int) else None)


def per_rank(split: Split, tp: int) -> int | None:
    """The per-rank size at TP `tp`, or None when vLLM cannot divide the dim."""
    if split.heads and split.heads < tp:
        return split.size // split.heads if split.size % split.heads == 0 else None
    return split.size // tp if split.size % tp == 0 else None


DOES_NOT_DIVIDE = "does not divide evenly"
NOT_BLOCKS = f"per-rank size not a multiple of {BLOCK}"
NOT_REFINED = f"per-rank size has no common block of {MIN_REFINED_BLOCK} or more with 128 and the hidden size"
NOT_GROUPS = "per-rank size not a multiple of {} ({} groups)"


def problem(split: Split, tp: int, fmt: str, scheme: str, hidden: int) -> str | None:
    """Why vLLM cannot load this split at TP `tp` (None: it can)."""
    size = per_rank(split, tp)
    if size is None:
        return DOES_NOT_DIVIDE
    if group := GROUP_SIZE.get(scheme):  # the split input dim of row-parallel layers and experts' down_proj
        kind = "MXFP8" if scheme == Scheme.MXFP8 else "FP4"
        return NOT_GROUPS.format(group, kind) if split.axis != "output" and size % group else None
    if scheme != Scheme.BLOCK or size % BLOCK == 0:
        return None
    experts = split.axis == "expert intermediate"
    if experts and fmt == Format.FP8:
        return None if math.gcd(BLOCK, size, hidden) >= MIN_REFINED_BLOCK else NOT_REFINED
    return NOT_BLOCKS if experts or tp > 1 else None


def tp_warnings(quantized: list, config: dict, fmt: str, scheme: str, sizes: tuple[int, ...]) -> list[PlanWarning]:
    """One warning per kind of split dim (of the quantized TensorPlans) that fails at some of `sizes`, or
    loads there only with vLLM's smaller fallback blocks, with the sizes that work and what to choose instead."""
    hidden = config_value(config, "hidden_size", "d_model") or BLOCK
    splits = {s for t in quantized if len(t.shape) == 2 and (s := split_of(t.name, t.shape, config))}
    # splits of sibling modules with the same dim, as one split of their parent -> the leaves
    merged: dict[Split, list[str]] = {}
    for s in sorted(splits, key=lambda s: (s.modules, s.axis, s.size)):
        parent, _, leaf = s.modules.rpartition(".") if s.axis != "expert intermediate" else (s.modules, "", "")
        merged.setdefault(Split(parent, s.axis, s.size, s.heads), []).append(leaf)
    warnings = []
    for split, leaves in merged.items():
        modules = split.modules + (f".{'/'.join(leaves)}" if any(leaves) else "")
        failing = {tp: why for tp in sizes if (why := problem(split, tp, fmt, scheme, hidden))}
        ok = [tp for tp in sizes if tp not in failing]
        experts = split.axis == "expert intermediate"
        refined = [tp for tp in ok if scheme == Scheme.BLOCK and experts and per_rank(split, tp) % BLOCK]
        if not failing and not refined:
            continue
        reasons = []
        for why in sorted(set(failing.values())):
            tps = [tp for tp in failing if failing[tp] == why]
            ranks = "" if why == DOES_NOT_DIVIDE else f" ({', '.join(str(per_rank(split, tp)) for tp in tps)} per rank)"
            reasons.append(f"{why} at TP {', '.join(map(str, tps))}{ranks}")
        text = f"vLLM splits the {split.axis} size {split.size} of {modules} across tensor-parallel ranks"
        if reasons:
            text += ": " + "; ".join(reasons)
        if ok:
            text += f"; it loads at TP {', '.join(map(str, ok))}"
        if refined:
            text += f" (at TP {', '.join(map(str, refined))} only with smaller blocks on vLLM's Triton MoE kernels)"
        if experts and DOES_NOT_DIVIDE in failing.values():
            text += "; or use expert parallelism (vLLM's --enable-expert-parallel does not split experts)"
        elif scheme in (Scheme.BLOCK, Scheme.MXFP8, *FP4_SCHEMES) and failing:
            other = Scheme.CHANNEL if fmt == Format.COMPRESSED_TENSORS else Scheme.TENSOR
            text += f"; or use --scheme {other}, which vLLM splits at any size that divides"
        warnings.append(PlanWarning(Caveat.VLLM_TP_LIMITS if ok else Caveat.VLLM_CANNOT_LOAD, text))
    return warnings
