"""One vLLM (CPU build) run of one model directory; run with the engine venv's python, not imported.

    python engine_child.py MODEL_DIR '[1, 17, 42, ...]' [--dtype bfloat16] [--emulate auto|always]

Loads MODEL_DIR with vLLM's own config parsing, weight loaders and post-load processing, greedily generates
one token after the prompt (with its top-2 candidates) and asks for the teacher-forced log-probability of
every prompt token. Prints one JSON line on stdout: {"ok": true, "token", "top", "prompt_logprobs", "margin",
"emulated", "emulated_layers", FP4} or {"ok": false, "stage", "error", "emulated", FP4}, where FP4 is
"emulated_kinds" (layers per emulated or replaced kernel kind), "replaced_because", "fused_nvfp4_layers"
and "split_global_scales" (below).

vLLM's CPU kernels for block-scaled FP8 (linear layers and MoE experts) need AMX. On a CPU without it
(or with --emulate always) this script adds one kernel of each kind that vLLM may choose only where
its own are unsupported on this CPU: it dequantizes the weight with its block scales once, then runs
BF16 matmuls, as vLLM's own AMX kernels do (W8A16: activations stay BF16). Everything else (which
kernel a layer needs, the shape checks of vLLM's own kernels, loading, fusing) stays vLLM's.

vLLM's CPU build has no FP4 kernel at all (compressed-tensors NVFP4A16 and MXFP4A16): it asks for its
weight-only Marlin kernels, which are CUDA-only. On any CPU this script lets vLLM choose first and, only
where that choice fails, hands back a stand-in for the Marlin class vLLM wanted (a subclass of it): the
scheme's own post-processing runs as in vLLM (for NVFP4: one global scale per fused layer, the
max, inverted), then the stand-in dequantizes the weight once with vLLM's own FP4 decoding and runs BF16
matmuls (W4A16, as Marlin; for MoE, Marlin's weight repacking is left out). The JSON gives vLLM's own
reasons for each replacement ("replaced_because"), how many fused NVFP4 layers (q/k/v, gate/up, each
expert's gate/up) vLLM loaded ("fused_nvfp4_layers"), and those it loaded with more than one global
scale before its post-processing kept the largest, with the values ("split_global_scales").
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# The engine core runs in this process, so the kernels registered below are the ones it sees.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EMULATED: list[str] = []  # one entry per layer that runs on an emulated kernel
REPLACED_BECAUSE: list[str] = []  # vLLM's own reasons for each FP4 kernel this script stood in for
FUSED_NVFP4: list[str] = []  # every fused NVFP4 layer (one per expert for MoE gate/up), as loaded
SPLIT_GLOBAL_SCALES: list[str] = []  # those of them whose members' global scales differ
COMPUTE_DTYPE = "bfloat16"  # the run's --dtype: what the FP4 stand-ins dequantize to


def dequantize_blocks(weight, scale, block: tuple[int, int]):
    """BF16 weight[..., N, K] = float(weight) * scale[..., ceil(N/bn), ceil(K/bk)] block by block."""
    import torch

    bn, bk = block
    n, k = weight.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * s).to(torch.bfloat16)


def silu_experts(output, x, w13, w2, topk_weights, topk_ids) -> None:
    """output = sum over each token's experts of router weight * (silu(x @ gate.T) * (x @ up.T)) @ down.T,
    expert by expert in the weights' dtype (w13 [E, 2I, H] gate then up, w2 [E, H, I])."""
    import torch
    import torch.nn.functional as F

    x = x.to(w13.dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    output.copy_(out.to(output.dtype))


def install_emulated_kernels() -> None:
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import PlatformEnum, current_platform

    class EmulatedFp8BlockLinear(CPUFp8BlockScaledMMKernel):
        """vLLM's CPU W8A16 block kernel with its AMX GEMM replaced by dequantize-once + BF16 matmul."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return current_platform.is_cpu(), "requires CPU platform."

        def process_weights_after_loading(self, layer) -> None:
            params = self._get_layer_params(layer)
            w = dequantize_blocks(params.weight.data, params.block_scale.data, tuple(self.weight_group_shape))
            replace_parameter(layer, params.WEIGHT, torch.nn.Parameter(w, requires_grad=False))
            EMULATED.append(f"fp8-block linear {tuple(w.shape)}")

        def apply_weights(self, layer, x, bias=None, **kwargs):
            return F.linear(x, self._get_layer_params(layer).weight, bias)

    class EmulatedFp8BlockExperts(cpu_moe.CPUExpertsFp8):
        """vLLM's CPU FP8 W8A16 block MoE experts with the AMX kernel replaced by dequantize-once +
        BF16 matmuls per expert (silu(x @ gate.T) * (x @ up.T) @ down.T, weighted by the router)."""

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        def apply(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            a1q_scale,
            a2_scale,
            workspace13,
            workspace2,
            expert_tokens_meta,
            apply_router_weight_on_input,
        ) -> None:
            if apply_router_weight_on_input:  # as vLLM's own CPUExpertsFp8
                raise NotImplementedError("CPUExpertsFp8 does not support apply_router_weight_on_input=True.")
            if getattr(self, "_bf16", None) is None:
                shape = self.quant_config._w1.shape  # where vLLM's CPUExpertsFp8.apply finds the block too
                block = tuple(self.quant_config.block_shape or (shape.row, shape.col))
                self._bf16 = (dequantize_blocks(w1, self.w1_scale, block), dequantize_blocks(w2, self.w2_scale, block))
                EMULATED.append(f"fp8-block moe {tuple(w1.shape)}")
            silu_experts(output, hidden_states, *self._bf16, topk_weights, topk_ids)

    # vLLM picks the first kernel whose checks pass: its own come first unless the run forces emulation.
    blocks = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    blocks.append(EmulatedFp8BlockLinear)
    cpu_moe.CPUExpertsFp8 = EmulatedFp8BlockExperts  # looked up by name when the backend is chosen
    cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)  # keep [E, N, K], no AMX packing


def dequantize_mxfp4(packed, scale_bytes, dtype):
    """W[..., N, K] = e2m1(codes) * 2^(byte - 127), one E8M0 byte per 32 inputs; the nibbles decoded by
    vLLM's own break_fp4_bytes (element 2j in the low nibble)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    values = break_fp4_bytes(packed.reshape(-1, packed.shape[-1]), torch.float32).reshape(*packed.shape[:-1], -1)
    scale = torch.exp2(scale_bytes.to(torch.float32) - 127.0)
    return (values.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_nvfp4(packed, scale, inverse_global_scale, dtype):
    """W[..., N, K] = e2m1(codes) * scale (e4m3, one per 16 inputs) * inverse_global_scale (a scalar, or
    one per expert), by vLLM's own dequantize_to_dtype (the checkpoint's unswizzled scale layout)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    return dequantize_to_dtype(packed, scale, inverse_global_scale, dtype, block_size=16, swizzle=False)


def _record_global_scales(name: str, values) -> None:
    """One fused NVFP4 layer's global scales as vLLM loaded them: one per member."""
    FUSED_NVFP4.append(name)
    if values.unique().numel() != 1:
        SPLIT_GLOBAL_SCALES.append(f"{name}: {[float(v) for v in values]}")


def install_fp4_kernels() -> None:
    """Stand-ins for vLLM's weight-only FP4 kernels, each returned only where vLLM's own choice fails
    on the CPU, plus the record of the global scales vLLM loads for fused NVFP4 layers."""
    import torch
    import torch.nn.functional as F
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.kernels.linear.mxfp4 import MxFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.mxfp4.marlin import MarlinMxFp4LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4 import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.marlin import MarlinNvFp4LinearKernel
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_moe_oracle
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_mxfp4 as mxfp4_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_mxfp4 as mxfp4_scheme,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as nvfp4_scheme,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static, kNvfp4Static
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    dtype = getattr(torch, COMPUTE_DTYPE)

    class EmulatedNvFp4A16Linear(MarlinNvFp4LinearKernel):
        """vLLM's NVFP4 W4A16 kernel (Marlin) with its GEMM replaced by dequantize-once + BF16 matmul. By
        the time it runs, the scheme has renamed weight_packed to weight and made weight_global_scale
        1 / max(the members' global scales)."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def process_weights_after_loading(self, layer) -> None:
            w = dequantize_nvfp4(layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data, dtype)
            replace_parameter(layer, "weight", torch.nn.Parameter(w, requires_grad=False))
            EMULATED.append(f"nvfp4 linear {tuple(w.shape)}")

        def apply_weights(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

    class EmulatedMxFp4A16Linear(MarlinMxFp4LinearKernel):
        """vLLM's MXFP4 W4A16 kernel (Marlin; like it, ignores the scheme's activation key: the checkpoint
        is weight-only) with its GEMM replaced by dequantize-once + BF16 matmul."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def process_weights_after_loading(self, layer) -> None:
            w = dequantize_mxfp4(layer.weight.data, layer.weight_scale.data, dtype)
            replace_parameter(layer, "weight", torch.nn.Parameter(w, requires_grad=False))
            EMULATED.append(f"mxfp4 linear {tuple(w.shape)}")

        def apply_weights(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

    def replaced(reason: str) -> None:
        if reason not in REPLACED_BECAUSE:
            REPLACED_BECAUSE.append(reason)

    def falls_back(vllm_init, stand_in):
        """vLLM's kernel choice; only where it raises, the stand-in (where there is one)."""

        def init(*args, **kwargs):
            try:
                return vllm_init(*args, **kwargs)
            except ValueError as e:
                kernel = stand_in(*args, **kwargs)
                if kernel is None:
                    raise
                replaced(_one_line(e))
                return kernel

        return init

    nvfp4_scheme.init_nvfp4_linear_kernel = falls_back(
        nvfp4_scheme.init_nvfp4_linear_kernel,  # vLLM's scheme asks for use_a16 (weight-only) or W4A4
        lambda use_a16=False: EmulatedNvFp4A16Linear(NvFp4LinearLayerConfig()) if use_a16 else None,
    )
    mxfp4_scheme.init_mxfp4_linear_kernel = falls_back(
        mxfp4_scheme.init_mxfp4_linear_kernel,
        lambda activation_quant_key=None: EmulatedMxFp4A16Linear(MxFp4LinearLayerConfig(activation_quant_key)),
    )

    VllmMarlinExperts = marlin_moe.MarlinExperts

    class EmulatedFp4Experts(VllmMarlinExperts):
        """vLLM's W4A16 FP4 MoE experts (Marlin, NVFP4 and MXFP4 only) with the GEMMs replaced: the
        experts' weights dequantized once after vLLM's own post-processing (for NVFP4, with the one
        global scale per expert it keeps: the gate's), then BF16 matmuls per expert
        (silu(x @ gate.T) * (x @ up.T) @ down.T, weighted by the router)."""

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return weight_key in (kNvfp4Static, kMxfp4Static) and activation_key is None

        def moe_problem_size(self, a1, w1, w2, topk_ids):  # Marlin's reads its repacked layout
            return mk.FusedMoEExpertsModular.moe_problem_size(self, a1, w1, w2, topk_ids)

        def process_weights_after_loading(self, layer) -> None:
            if self.quant_config.use_nvfp4_w4a16:  # g*_alphas: 1 / global scale, one per expert
                w13 = dequantize_nvfp4(layer.w13_weight.data, self.w1_scale, self.g1_alphas, dtype)
                w2 = dequantize_nvfp4(layer.w2_weight.data, self.w2_scale, self.g2_alphas, dtype)
            else:
                assert self.quant_config.use_mxfp4_w4a16
                w13 = dequantize_mxfp4(layer.w13_weight.data, self.w1_scale, dtype)
                w2 = dequantize_mxfp4(layer.w2_weight.data, self.w2_scale, dtype)
            replace_parameter(layer, "w13_weight", torch.nn.Parameter(w13, requires_grad=False))
            replace_parameter(layer, "w2_weight", torch.nn.Parameter(w2, requires_grad=False))
            kind = "nvfp4" if self.quant_config.use_nvfp4_w4a16 else "mxfp4"
            EMULATED.append(f"{kind} moe {tuple(w13.shape)}")

        def apply(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            a1q_scale,
            a2_scale,
            workspace13,
            workspace2,
            expert_tokens_meta,
            apply_router_weight_on_input,
        ) -> None:
            if apply_router_weight_on_input or activation != MoEActivation.SILU or expert_map is not None:
                raise NotImplementedError(
                    f"EmulatedFp4Experts: SiLU experts weighted on output, no expert map (got {activation}, "
                    f"apply_router_weight_on_input={apply_router_weight_on_input}, expert_map={expert_map})"
                )
            silu_experts(output, hidden_states, w1, w2, topk_weights, topk_ids)

    # NVFP4 MoE: vLLM's backend choice; only where none supports the CPU, again with the stand-in as
    # its Marlin backend (whose weight repacking is then left out: the stand-in reads the checkpoint's).
    vllm_select = nvfp4_moe.select_nvfp4_moe_backend

    def select_nvfp4_moe_backend(*args, **kwargs):
        try:
            return vllm_select(*args, **kwargs)
        except NotImplementedError as e:
            replaced(_one_line(e))
            marlin_moe.MarlinExperts = EmulatedFp4Experts  # where the oracle looks its Marlin class up
            try:
                return vllm_select(*args, **kwargs)
            finally:
                marlin_moe.MarlinExperts = VllmMarlinExperts

    def prepare_nvfp4_moe_layer_for_marlin(layer, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, **kw):
        return w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2  # on the CPU, Marlin is the stand-in

    nvfp4_moe.select_nvfp4_moe_backend = select_nvfp4_moe_backend
    nvfp4_moe_oracle.prepare_nvfp4_moe_layer_for_marlin = prepare_nvfp4_moe_layer_for_marlin

    # MXFP4 MoE: vLLM's compressed-tensors method takes MarlinExperts wherever CUTLASS and XPU are not,
    # without asking whether it runs; on the CPU its weight repacking then fails (the CPU build has no
    # gptq_marlin_repack). There the stand-in takes its place, with no repacking.
    vllm_mx_init = mxfp4_moe.CompressedTensorsW4A4Mxfp4MoEMethod.__init__

    def mx_init(self, moe):
        vllm_mx_init(self, moe)
        if self.experts_cls is VllmMarlinExperts:
            standard = mk.FusedMoEActivationFormat.Standard
            ok, why = VllmMarlinExperts.is_supported_config(VllmMarlinExperts, moe, kMxfp4Static, None, standard)
            if not ok:
                replaced(f"MarlinExperts for MXFP4 MoE: {why}")
                self.experts_cls = EmulatedFp4Experts

    mxfp4_moe.CompressedTensorsW4A4Mxfp4MoEMethod.__init__ = mx_init
    mxfp4_moe.prepare_moe_fp4_layer_for_marlin = lambda layer, *args, **kwargs: None  # as for NVFP4

    # The global scales of each fused NVFP4 layer as loaded: the schemes' post-processing keeps one.
    linear_pwal = nvfp4_scheme.CompressedTensorsW4A4Fp4.process_weights_after_loading
    moe_pwal = nvfp4_moe.CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading

    def linear_process_weights_after_loading(self, layer) -> None:
        scales = layer.weight_global_scale.detach().float().flatten()  # one per fused member
        if scales.numel() > 1:
            _record_global_scales(layer.prefix, scales)
        linear_pwal(self, layer)

    def moe_process_weights_after_loading(self, layer) -> None:
        if self.moe.is_act_and_mul:
            for e, scales in enumerate(layer.w13_weight_global_scale.detach().float()):  # [E, 2]: gate, up
                _record_global_scales(f"{layer.layer_name}.{e}.gate_up", scales)
        moe_pwal(self, layer)

    nvfp4_scheme.CompressedTensorsW4A4Fp4.process_weights_after_loading = linear_process_weights_after_loading
    nvfp4_moe.CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading = moe_process_weights_after_loading


def has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def force_emulation() -> None:
    """Make vLLM's own AMX block kernels unsupported, so the emulated ones run (a check of the emulation
    on an AMX machine)."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def text_only(model_dir: str) -> dict:
    """LLM arguments for the prompts' text-only inputs: a multimodal model's processors need a tokenizer,
    which the test models do not have, so vLLM builds its language model alone (the towers are neither
    built nor loaded)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return {"language_model_only": True} if "vision_config" in json.load(f) else {}


def run(model_dir: str, prompt: list[int], dtype: str, emulate: str) -> dict:
    global COMPUTE_DTYPE
    COMPUTE_DTYPE = dtype
    emulating = emulate == "always" or not has_amx()
    if emulating:
        if emulate == "always":
            force_emulation()
        install_emulated_kernels()
    install_fp4_kernels()  # no CPU has vLLM FP4 kernels
    stage = "load"
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=128,
            seed=0,
            **text_only(model_dir),
        )
        stage = "generate"
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=0, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    except Exception as e:  # the child reports; the test decides
        traceback.print_exc(file=sys.stderr)
        return {"ok": False, "stage": stage, "error": _one_line(e), "emulated": bool(EMULATED), **fp4_record()}
    completion = out.outputs[0]
    top = sorted(completion.logprobs[0].values(), key=lambda lp: -lp.logprob)
    prompt_lp = [None] + [pos[prompt[i + 1]].logprob for i, pos in enumerate(out.prompt_logprobs[1:])]
    return {
        "ok": True,
        "token": completion.token_ids[0],
        "prompt_logprobs": prompt_lp,
        "margin": top[0].logprob - top[1].logprob if len(top) > 1 else None,
        "top": [tok for tok, _ in sorted(completion.logprobs[0].items(), key=lambda kv: -kv[1].logprob)][:2],
        "emulated": bool(EMULATED),
        "emulated_layers": len(EMULATED),
        **fp4_record(),
    }


def fp4_record() -> dict:
    kinds: dict[str, int] = {}
    for entry in EMULATED:
        kind = " ".join(entry.split()[:2])
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "emulated_kinds": kinds,
        "replaced_because": REPLACED_BECAUSE,
        "fused_nvfp4_layers": len(FUSED_NVFP4),
        "split_global_scales": SPLIT_GLOBAL_SCALES,
    }


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:600]


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("prompt", help="JSON list of token ids")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--emulate", choices=("auto", "always"), default="auto")
    a = p.parse_args(argv)
    result = run(a.model_dir, json.loads(a.prompt), a.dtype, a.emulate)
    print("ENGINE_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
