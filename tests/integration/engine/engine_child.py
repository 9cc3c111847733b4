"""One vLLM (CPU build) run of one model directory; run with the engine venv's python, not imported.

    python engine_child.py MODEL_DIR '[1, 17, 42, ...]' [--dtype bfloat16] [--emulate auto|always]

Loads MODEL_DIR with vLLM's own config parsing, weight loaders and post-load processing, greedily generates
one token after the prompt (with its top-2 candidates) and asks for the teacher-forced log-probability of
every prompt token. Prints one JSON line on stdout: {"ok": true, "token", "top", "prompt_logprobs", "margin",
"emulated", "emulated_layers"} or {"ok": false, "stage", "error"}.

vLLM's CPU kernels for block-scaled FP8 (linear layers and MoE experts) need AMX. On a CPU without it
(or with --emulate always) this script adds one kernel of each kind that vLLM may choose only where
its own are unsupported on this CPU: it dequantizes the weight with its block scales once, then runs
BF16 matmuls, as vLLM's own AMX kernels do (W8A16: activations stay BF16). Everything else (which
kernel a layer needs, the shape checks of vLLM's own kernels, loading, fusing) stays vLLM's.
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


def dequantize_blocks(weight, scale, block: tuple[int, int]):
    """BF16 weight[..., N, K] = float(weight) * scale[..., ceil(N/bn), ceil(K/bk)] block by block."""
    import torch

    bn, bk = block
    n, k = weight.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * s).to(torch.bfloat16)


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
            EMULATED.append(f"linear {tuple(w.shape)}")

        def apply_weights(self, layer, x, bias=None, **kwargs):
            return F.linear(x, self._get_layer_params(layer).weight, bias)

    class EmulatedFp8BlockExperts(cpu_moe.CPUExpertsFp8):
        """vLLM's CPU FP8 W8A16 block MoE experts with the AMX kernel replaced by dequantize-once +
        BF16 matmuls per expert (silu(x @ gate.T) * (x @ up.T) @ down.T, weighted by the router)."""

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

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
                EMULATED.append(f"moe {tuple(w1.shape)}")
            w13, w2_bf16 = self._bf16
            x = hidden_states.to(torch.bfloat16)
            out = torch.zeros(x.shape[0], w2_bf16.shape[1], dtype=torch.float32)
            for e in topk_ids.unique().tolist():
                rows, slot = (topk_ids == e).nonzero(as_tuple=True)
                gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, w2_bf16[e])
                out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
            output.copy_(out.to(output.dtype))

    # vLLM picks the first kernel whose checks pass: its own come first unless the run forces emulation.
    blocks = linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    blocks.append(EmulatedFp8BlockLinear)
    cpu_moe.CPUExpertsFp8 = EmulatedFp8BlockExperts  # looked up by name when the backend is chosen
    cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)  # keep [E, N, K], no AMX packing


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
    emulating = emulate == "always" or not has_amx()
    if emulating:
        if emulate == "always":
            force_emulation()
        install_emulated_kernels()
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
        return {"ok": False, "stage": stage, "error": _one_line(e), "emulated": bool(EMULATED)}
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
