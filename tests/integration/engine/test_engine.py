"""vLLM's CPU build loads and runs fp8convert's outputs, and they agree with the BF16 original.

For a representative set of families (dense, fused 3-D experts, gpt-oss, hybrid linear attention with
a shared-expert MoE, Falcon's per-head query_key_value, a multimodal family with a text-only prompt), the
engine-sized zoo model runs in vLLM first as BF16 (the control: a failure there is vLLM CPU's, not the
converter's; its distance from transformers in FP32 sets the bound, engine_harness.logprob_bound), then
as every output format vLLM's CPU build runs for that family. Each must give the control's first
generated token and teacher-forced prompt log-probs within the bound. scripts/engine_table.py runs every
registered family the same way.

Where the CPU has no AMX, vLLM has no block FP8 GEMM or MoE kernel, and the child emulates exactly
those (engine_child.py); the terminal summary lists the runs that were emulated.
"""

from __future__ import annotations

import engine_harness as H
import engine_models as M
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CT_CHANNEL, CT_BLOCK, FP8_BLOCK = M.FORMATS
# family -> the formats vLLM's CPU build runs for it (scripts/engine_table.py shows the others failing
# in vLLM CPU itself): per-channel FP8 MoE has no CPU kernel ("Unsupported FP8 MoE backend: NONE"), and
# the CPU's block FP8 GEMM fails on layers with a bias (gpt-oss attention: "expected scalar type Float
# but found BFloat16").
CI_FAMILIES = {
    "llama": (CT_CHANNEL, CT_BLOCK, FP8_BLOCK),  # dense
    "granitemoe": (CT_BLOCK, FP8_BLOCK),  # fused 3-D experts, split per expert
    "granitemoehybrid": (CT_BLOCK, FP8_BLOCK),  # Mamba2 mixer, named .mixer in vLLM; in_proj kept (1060 rows)
    "gpt_oss": (CT_CHANNEL,),  # experts kept BF16 and fused, attention with sinks
    "qwen3_next": (CT_BLOCK, FP8_BLOCK),  # gated DeltaNet + attention; MoE with a shared expert
    "falcon": (CT_CHANNEL, CT_BLOCK, FP8_BLOCK),  # query_key_value regrouped per KV head by vLLM
    "llava": (CT_CHANNEL, FP8_BLOCK),  # multimodal, legacy language_model.* names; text-only prompt
}
CASES = [
    pytest.param(family, fmt, scheme, id=f"{family}-{M.FORMAT_IDS[(fmt, scheme)]}")
    for family, formats in CI_FAMILIES.items()
    for fmt, scheme in formats
]


@pytest.mark.parametrize("model_type", list(CI_FAMILIES))
def test_bf16_control_runs_and_agrees_with_transformers(model_type, family):
    """The control itself: vLLM runs the BF16 model, and its greedy token is transformers' FP32 one
    (or the runner-up, where transformers' own top-2 margin is within the bound)."""
    _, control, reference, bound = family(model_type)
    assert control.ok, f"vLLM CPU cannot run the BF16 {model_type} model itself: {control.describe()}"
    assert len(control.prompt_logprobs) == len(H.PROMPT_IDS) - 1
    assert H.agreement(reference, control, bound) is None, H.agreement(reference, control, bound)


@pytest.mark.parametrize("model_type,fmt,scheme", CASES)
def test_output_agrees_with_control(model_type, fmt, scheme, family, converted_for_engine, engine_runs):
    _, control, _, bound = family(model_type)
    if not control.ok or bound is None:
        pytest.fail("no control to compare with (test_bf16_control_runs_and_agrees_with_transformers says why)")
    run = engine_runs.record(
        model_type, M.FORMAT_IDS[(fmt, scheme)], H.run_engine(converted_for_engine(model_type, fmt, scheme))
    )
    why = H.agreement(control, run, bound)
    assert why is None, f"{model_type} {fmt} {scheme}" + (" (emulated GEMM)" if run.emulated else "") + f": {why}"


@pytest.mark.parametrize("model_type", ["llama", "granitemoe"])
def test_emulated_block_kernels_agree_with_control(model_type, family, converted_for_engine, engine_runs):
    """The GEMM emulation used where the CPU has no AMX, forced on: it replaces something (the run
    says so) and agrees with the control like vLLM's own kernels. Covers the linear and the MoE one."""
    _, control, _, bound = family(model_type)
    run = engine_runs.record(
        model_type,
        "fp8-block, emulation forced",
        H.run_engine(converted_for_engine(model_type, "fp8", "block"), emulate="always"),
    )
    assert run.ok and run.emulated, run.describe()
    assert H.agreement(control, run, bound) is None, H.agreement(control, run, bound)


@pytest.fixture(scope="session")
def narrow_gate_llama(tmp_path_factory, engine_runs):
    """The engine llama with gate_proj/up_proj 192 rows wide, and its BF16 control."""
    src = M.make_engine_model("llama", tmp_path_factory.mktemp("engine-narrow") / "bf16", intermediate_size=192)
    return src, engine_runs.record("llama, gate 192", "BF16 control", H.run_engine(src))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_fused_group_that_ends_mid_block_is_refused_and_vllm_cannot_load_it(fmt, narrow_gate_llama, tmp_path):
    """gate_proj (192 rows) ends inside a 128-row block of the fused gate_up_proj: quantize refuses the
    block scheme, and what --write-unloadable writes fails to load in vLLM itself, where the BF16 model
    runs."""
    import fp8convert

    src, control = narrow_gate_llama
    out = tmp_path / "out"
    with pytest.raises(fp8convert.FP8ConvertError, match=r"vLLM cannot load model\.layers\.0\.mlp\.gate_proj/up_proj"):
        fp8convert.quantize(str(src), str(out), format=fmt, scheme="block", device="cpu", write_unloadable=False)
    fp8convert.quantize(str(src), str(out), format=fmt, scheme="block", device="cpu", write_unloadable=True)
    assert control.ok, control.describe()
    run = H.run_engine(out)
    assert not run.ok and run.stage == "load", run.describe()
