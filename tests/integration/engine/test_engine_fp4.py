"""vLLM's CPU build runs fp8convert's weight-only FP4 outputs (NVFP4A16, MXFP4A16, dense and MoE) and the
docs' two mixed recipes, with only the FP4 GEMMs it lacks replaced, and computes what the dequantized
checkpoint computes.

vLLM's CPU build has no FP4 kernel: for NVFP4A16 layers it forces its CUDA-only Marlin kernel ("Forced
NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"), for MXFP4A16 it finds
none, for NVFP4 MoE no backend ("No NvFp4 MoE backend supports the deployment configuration."), and for
MXFP4 MoE it takes Marlin's experts, whose weight repacking is not in the CPU build. engine_child.py
lets vLLM choose first and, only where that fails, stands in for the Marlin class vLLM wanted: loading,
fusing and the scheme's post-processing stay vLLM's; the stand-in dequantizes once and multiplies in
BF16 (W4A16, as Marlin). Each run must say so (which kernels were replaced, and vLLM's reasons).

FP4 rounding moves log-probs far more than FP8's, so the BF16 control is not the yardstick: each run is
compared with the same checkpoint dequantized to FP32 and run in transformers in FP32, within a bound
set by the control's own distance from its FP32 original (engine_harness.fp4_logprob_bound), and must
be far nearer it than what the checkpoint computes when decoded wrongly (nibbles swapped, a global scale
ignored, group scales on the wrong rows). vLLM must also have loaded one global scale per fused NVFP4
layer (q/k/v, gate/up, each expert's gate/up): it keeps only the largest, silently rescaling the others.

The MoE model is Qwen3-MoE (per-expert 2-D weights in the checkpoint, as the mixed recipes' pattern
`mlp.experts.*` expects) with 4 experts, all active: with the zoo's 16, each expert carries so little of
the output that group scales on the wrong rows of every expert move log-probs by about the bound only.
Granite-MoE's fused 3-D experts, which fp8convert writes split per expert,
would load in vLLM, but fp8convert's dequantized copy keeps them split, which transformers does not load
(it leaves GraniteMoe's experts randomly initialized), so it has no reference here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import engine_harness as H
import engine_models as M
import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CT = "compressed-tensors"
MOE = "qwen3_moe_4e"  # engine_models.VARIANTS: 4 experts, all active
FP4_CASES = [("llama", "nvfp4a16"), ("llama", "mxfp4a16"), (MOE, "nvfp4a16"), (MOE, "mxfp4a16")]
# The docs' examples: FP8 block attention + NVFP4A16 experts; FP8 channel dense + MXFP4A16 experts.
MIXED = {"block+nvfp4a16": ("block", "nvfp4a16"), "channel+mxfp4a16": ("channel", "mxfp4a16")}
EXPERT_NAMES = M.EXPERTS.removeprefix("re:")

# vLLM's own words where it has no FP4 kernel for a layer on the CPU (the child's replaced_because).
REFUSED = {
    ("nvfp4a16", "linear"): "ValueError: Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: "
    "Marlin FP4 not available",
    ("nvfp4a16", "moe"): "NotImplementedError: No NvFp4 MoE backend supports the deployment configuration.",
    ("mxfp4a16", "linear"): "ValueError: Failed to find a kernel that can implement the MXFP4 linear layer.",
    ("mxfp4a16", "moe"): "MarlinExperts for MXFP4 MoE: kernel does not support current device cpu",
}

# Wrong decodings the comparison must tell apart: (tensor suffix, change, schemes).
FAULTS = {
    "nibbles swapped": (".weight_packed", lambda t: (t & 0x0F) << 4 | t >> 4, ("nvfp4a16", "mxfp4a16")),
    "global scale ignored": (".weight_global_scale", torch.ones_like, ("nvfp4a16",)),
    "group scales one row down": (".weight_scale", lambda t: torch.roll(t, 1, dims=0), ("nvfp4a16", "mxfp4a16")),
}


def rewrite(out: Path, change, names: str = ".*") -> list[str]:
    """Apply change(name, tensor) -> tensor or None (unchanged) to every tensor of `out` whose name matches
    `names`, in place. Returns the names changed."""
    changed = []
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        new = {k: change(k, t) if re.fullmatch(names, k) else None for k, t in tensors.items()}
        if any(t is not None for t in new.values()):
            changed += [k for k, t in new.items() if t is not None]
            save_file(
                {k: t if new[k] is None else new[k] for k, t in tensors.items()}, shard, metadata={"format": "pt"}
            )
    return changed


@pytest.fixture(scope="session")
def dequantized(tmp_path_factory, converted_for_engine):
    """dequantized(model_type, scheme, fault=None) -> the one-scheme output dequantized to FP32 by
    fp8convert (with `fault`: of a copy of the FP4 output whose tensors were changed first)."""
    import fp8convert

    cache: dict = {}

    def get(model_type: str, scheme: str, fault: str | None = None) -> Path:
        if (model_type, scheme, fault) not in cache:
            work = tmp_path_factory.mktemp(f"deq-{model_type}-{scheme}-{(fault or 'as-written').replace(' ', '-')}")
            src = converted_for_engine(model_type, CT, scheme)
            if fault:
                suffix, change, _ = FAULTS[fault]
                shutil.copytree(src, work / "faulty")
                assert rewrite(work / "faulty", lambda k, t: change(t) if k.endswith(suffix) else None)
                src = work / "faulty"
            fp8convert.dequantize(str(src), str(work / "fp32"), dtype="fp32", device="cpu")
            cache[model_type, scheme, fault] = work / "fp32"
        return cache[model_type, scheme, fault]

    return get


@pytest.fixture(scope="session")
def fp4_reference(tmp_path_factory, dequantized):
    """fp4_reference(model_type, scheme, experts=None, fault=None) -> transformers in FP32 on the output
    dequantized to FP32. fp8convert's dequantize reads one scheme per checkpoint, so a mixed recipe's
    reference splices the one-scheme outputs' dequantized weights: the experts' from the all-`experts`
    output, the rest from the all-`scheme` one (tests/integration/test_mixed_recipes.py checks that a
    recipe writes exactly those bytes; were it not so, the engine would disagree here). `fault` goes to
    the FP4 weights."""
    cache: dict = {}

    def get(model_type: str, scheme: str, experts: str | None = None, fault: str | None = None) -> H.EngineRun:
        key = (model_type, scheme, experts, fault)
        if key not in cache:
            if experts is None:
                model = dequantized(model_type, scheme, fault)
            else:
                model = tmp_path_factory.mktemp(f"ref-{model_type}-{scheme}+{experts}") / "fp32"
                shutil.copytree(dequantized(model_type, scheme), model)
                fp4 = {}
                for shard in dequantized(model_type, experts, fault).glob("*.safetensors"):
                    fp4.update(load_file(shard))
                assert rewrite(model, lambda k, t: fp4[k], EXPERT_NAMES)
            cache[key] = H.transformers_reference(model)
            assert cache[key].ok, cache[key].describe()
        return cache[key]

    return get


def fp4_kinds(model_type: str, scheme: str, experts_only: bool = False) -> set[str]:
    """The FP4 layer kinds the child stands in for: every FP4 linear and MoE."""
    kind = scheme.removesuffix("a16")
    return ({f"{kind} moe"} if model_type == MOE else set()) | (set() if experts_only else {f"{kind} linear"})


def run_and_check(
    engine_runs, model_type: str, what: str, out: Path, bound: float, reference, faulty: dict, refused, kinds
):
    """Run `out` in vLLM and check it: vLLM refused its own FP4 kernels in its own words, the stand-ins
    took (only) those layers, the run agrees with the FP4 reference within `bound`, and it is at least
    twice as far from what each wrong decoding computes as from the reference (had vLLM decoded that way,
    it would be nearer that one: the wrong decodings move log-probs by 0.5 to 5 nats here). The summary
    line gives the distances."""
    run = H.run_engine(out)
    if run.ok:
        right = H.max_logprob_gap(reference, run)
        nearest = min(((H.max_logprob_gap(w, run), f) for f, w in faulty.items()), default=(float("nan"), ""))
        what += f" ({right:.4f} from the FP4 reference, bound {bound:.4f}; {nearest[0]:.3f} from {nearest[1]})"
    engine_runs.record(model_type, what, run)
    assert run.ok, run.describe()
    assert {why.removesuffix(" Reasons:") for why in run.replaced_because} == refused, run.replaced_because
    assert {kind for kind, _ in run.emulated_kinds if "fp4" in kind} == kinds, run.emulated_kinds
    why = H.agreement(reference, run, bound)
    assert why is None, f"{why} (FP4 reference)"
    for fault, wrong in faulty.items():
        assert H.max_logprob_gap(wrong, run) > 2 * right, (
            f"the run is {H.max_logprob_gap(wrong, run):.4f} from the checkpoint decoded with {fault}, "
            f"{right:.4f} from it decoded right: the comparison cannot tell them apart"
        )
    return run


@pytest.mark.parametrize("model_type,scheme", FP4_CASES, ids=[f"{m}-{s}" for m, s in FP4_CASES])
def test_fp4_output_runs_and_computes_the_dequantized_checkpoint(
    model_type, scheme, family, converted_for_engine, fp4_reference, engine_runs
):
    _, control, original, _ = family(model_type)
    assert control.ok, f"vLLM CPU cannot run the BF16 {model_type} model itself: {control.describe()}"
    bound = H.fp4_logprob_bound(control, original)
    refused = {REFUSED[scheme, "linear"]} | ({REFUSED[scheme, "moe"]} if model_type == MOE else set())
    faulty = {f: fp4_reference(model_type, scheme, fault=f) for f, (*_, schemes) in FAULTS.items() if scheme in schemes}
    out = converted_for_engine(model_type, CT, scheme)
    reference = fp4_reference(model_type, scheme)
    run = run_and_check(
        engine_runs, model_type, scheme, out, bound, reference, faulty, refused, fp4_kinds(model_type, scheme)
    )
    if scheme == "nvfp4a16":  # llama: q/k/v and gate/up per layer; Qwen3-MoE: q/k/v and 4 experts' gate/up
        assert run.fused_nvfp4_layers == {"llama": 2 * 2, MOE: 2 * (1 + 4)}[model_type], run.fused_nvfp4_layers
        assert run.split_global_scales == (), run.split_global_scales


@pytest.mark.parametrize(("default", "experts"), MIXED.values(), ids=MIXED.keys())
def test_mixed_recipe_runs_and_computes_the_dequantized_checkpoint(
    default, experts, family, converted_for_engine, fp4_reference, engine_runs
):
    """The docs' two recipes on the MoE model: FP8 dense layers on vLLM's own CPU kernels (the block one
    emulated where the CPU has no AMX), FP4 experts on the stand-in."""
    _, control, original, _ = family(MOE)
    assert control.ok, f"vLLM CPU cannot run the BF16 {MOE} model itself: {control.describe()}"
    bound = H.fp4_logprob_bound(control, original, fp8_activations=default == "channel")
    faulty = {f: fp4_reference(MOE, default, experts, f) for f, (*_, schemes) in FAULTS.items() if experts in schemes}
    out = converted_for_engine(MOE, CT, default, experts)
    reference = fp4_reference(MOE, default, experts)
    kinds = fp4_kinds(MOE, experts, experts_only=True)
    what = f"{default} + {experts} experts"
    run = run_and_check(engine_runs, MOE, what, out, bound, reference, faulty, {REFUSED[experts, "moe"]}, kinds)
    if experts == "nvfp4a16":
        assert run.fused_nvfp4_layers == 2 * 4 and run.split_global_scales == (), run.split_global_scales


def test_a_fused_layer_loaded_with_two_global_scales_is_reported(converted_for_engine, tmp_path, engine_runs):
    """The global-scale check can fail: an output with a second global scale planted in one member of a
    fused q/k/v and in one expert's up_proj is reported for exactly those two layers (with the values
    vLLM loaded), and nothing else; vLLM itself only warns and runs it."""
    out = tmp_path / "out"
    shutil.copytree(converted_for_engine(MOE, CT, "nvfp4a16"), out)
    planted = [
        "model.layers.0.self_attn.k_proj.weight_global_scale",
        "model.layers.1.mlp.experts.3.up_proj.weight_global_scale",
    ]
    assert sorted(rewrite(out, lambda k, t: t / 2 if k in planted else None)) == planted
    run = engine_runs.record(MOE, "nvfp4a16, two global scales planted", H.run_engine(out))
    assert run.ok, run.describe()
    assert run.fused_nvfp4_layers == 2 * (1 + 4)
    names = [entry.partition(":")[0] for entry in run.split_global_scales]
    assert names == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.experts.3.gate_up"], (
        run.split_global_scales
    )
    for entry in run.split_global_scales:  # the planted member's value is half its partners'
        values = sorted(float(v) for v in entry.partition(": ")[2].strip("[]").split(","))
        assert values[0] * 2 == pytest.approx(values[-1]), entry
