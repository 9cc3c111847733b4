"""Independent, deliberately plain implementation of DESIGN.md's FP8 numerics.

Used only by the tests to compute expected outputs from the *source* tensors. It shares no code
with `fp8convert` on purpose: if both were wrong in the same way the tests could not notice.

Rules (DESIGN.md, "Numerics"):
- scale = float32(amax) / 448, computed in float32; amax over the whole tensor (tensor), each row
  (channel) or each 128x128 block (block; edge blocks are partial, the scale grid is ceil-div).
- codes = clamp(float32(w) / scale, -448, 448).to(float8_e4m3fn) (true division, RNE cast).
- amax == 0 -> scale 1.0 (finite and positive; the codes are then all 0).
- fused groups (per-tensor scheme only) share one scale: the one computed from max(amax of members).
- mxfp8 (README, "Schemes and formats"): each row is cut into groups of 32 consecutive inputs; a
  group's scale is 2^e with e the smallest integer such that amax <= 448 * 2^e (ceil(log2(amax/448))
  taken exactly), e kept in [-127, 127]; it is stored as the byte e + 127 (uint8 [out, in/32]); codes
  are w / 2^e rounded as above. amax == 0 -> byte 0. Weights whose input dim is not a multiple of 32
  stay in high precision.
- block scales with scale format ue8m0: 2^e with e the smallest integer such that
  max(amax, 1e-4) <= 448 * 2^e (1e-4 taken as a float32), stored as float32.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128
MX_GROUP = 32
UE8M0_MIN_AMAX = torch.tensor(1e-4, dtype=torch.float32).item()  # as float32, then exactly as a Python float


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 scalar tensor: amax / 448 in float32, or 1.0 when amax == 0."""
    amax = amax.to(torch.float32).reshape(())
    if amax.item() == 0.0:
        return torch.tensor(1.0, dtype=torch.float32)
    return amax / torch.tensor(FP8_MAX, dtype=torch.float32)


def amax_of(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.float32).abs().max()


def codes_with_scale(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize `w` (any float dtype) with a scale that broadcasts against it."""
    x = w.to(torch.float32) / scale.to(torch.float32)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ---------------------------------------------------------------- per-tensor


def tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """0-d float32 scale for the whole tensor."""
    return scale_from_amax(amax_of(w))


def group_tensor_scale(members: list[torch.Tensor]) -> torch.Tensor:
    """0-d float32 scale shared by a fused group: from the max of the members' amax."""
    amax = max(amax_of(m).item() for m in members)
    return scale_from_amax(torch.tensor(amax, dtype=torch.float32))


def quantize_tensor(w: torch.Tensor, scale: torch.Tensor | None = None):
    """(codes, 0-d scale). `scale` overrides the tensor's own (fused groups)."""
    if scale is None:
        scale = tensor_scale(w)
    return codes_with_scale(w, scale), scale


# ---------------------------------------------------------------- per-channel


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """[out, 1] float32: one scale per row, computed row by row."""
    rows = [scale_from_amax(amax_of(w[r])) for r in range(w.shape[0])]
    return torch.stack(rows).reshape(w.shape[0], 1)


def quantize_channel(w: torch.Tensor):
    s = channel_scales(w)
    codes = torch.empty(w.shape, dtype=FP8_DTYPE)
    for r in range(w.shape[0]):
        codes[r] = codes_with_scale(w[r], s[r, 0])
    return codes, s


# ---------------------------------------------------------------- 128x128 blocks


def block_grid(shape) -> tuple[int, int]:
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def per_block(w: torch.Tensor, scale_of) -> torch.Tensor:
    """[ceil(out/128), ceil(in/128)] float32, scale_of(block) for each 128x128 block; edge blocks are
    partial."""
    gr, gc = block_grid(w.shape)
    s = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            s[i, j] = scale_of(w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK])
    return s


def block_scales(w: torch.Tensor) -> torch.Tensor:
    return per_block(w, lambda blk: scale_from_amax(amax_of(blk)))


def quantize_block(w: torch.Tensor):
    s = block_scales(w)
    codes = torch.empty(w.shape, dtype=FP8_DTYPE)
    gr, gc = s.shape
    for i in range(gr):
        for j in range(gc):
            rs = slice(i * BLOCK, (i + 1) * BLOCK)
            cs = slice(j * BLOCK, (j + 1) * BLOCK)
            codes[rs, cs] = codes_with_scale(w[rs, cs], s[i, j])
    return codes, s


# ---------------------------------------------------------------- powers of two (MXFP8, UE8M0)


def smallest_exponent(amax: float) -> int:
    """The smallest integer e with amax <= 448 * 2**e, kept in [-127, 127]. Python floats hold every
    float32 amax and every 448 * 2**e here exactly, so the comparisons are exact; no log2 is trusted."""
    if amax == 0.0:
        return -127
    e = math.frexp(amax / FP8_MAX)[1]  # a guess within one of the answer
    while amax > FP8_MAX * 2.0**e:
        e += 1
    while amax <= FP8_MAX * 2.0 ** (e - 1):
        e -= 1
    return max(-127, min(127, e))


def pow2(e: int) -> torch.Tensor:
    """2**e as a float32 scalar tensor (2**-127 is a float32 subnormal, still exact)."""
    return torch.tensor(2.0**e, dtype=torch.float32)


def quantize_mx(w: torch.Tensor):
    """(codes, uint8 E8M0 bytes [out, in/32]), group by group."""
    rows, cols = w.shape
    assert cols % MX_GROUP == 0, w.shape
    codes = torch.empty(w.shape, dtype=FP8_DTYPE)
    exponents = torch.empty(rows, cols // MX_GROUP, dtype=torch.uint8)
    for r in range(rows):
        for g in range(cols // MX_GROUP):
            group = w[r, g * MX_GROUP : (g + 1) * MX_GROUP]
            e = smallest_exponent(amax_of(group).item())
            exponents[r, g] = e + 127
            codes[r, g * MX_GROUP : (g + 1) * MX_GROUP] = codes_with_scale(group, pow2(e))
    return codes, exponents


def ue8m0_block_scales(w: torch.Tensor) -> torch.Tensor:
    """Block scales rounded up to powers of two."""
    return per_block(w, lambda blk: pow2(smallest_exponent(max(amax_of(blk).item(), UE8M0_MIN_AMAX))))


# ---------------------------------------------------------------- dequant


def dequant(codes: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32 w' = float32(q) * scale, expanding block scales to the weight shape; MXFP8 scale bytes b
    mean 2**(b - 127)."""
    q = codes.to(torch.float32)
    if scheme == "tensor":
        return q * scale.reshape(())
    if scheme == "channel":
        return q * scale.reshape(-1, 1)
    if scheme == "mxfp8":
        out = torch.empty(q.shape, dtype=torch.float32)
        for r in range(q.shape[0]):
            for g in range(q.shape[1] // MX_GROUP):
                cols = slice(g * MX_GROUP, (g + 1) * MX_GROUP)
                out[r, cols] = q[r, cols] * pow2(int(scale[r, g]) - 127)
        return out
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q * full


def quantize(w: torch.Tensor, scheme: str, shared_scale: torch.Tensor | None = None, scale_format: str = "float"):
    """(codes, scale) for one 2D weight; scale is 0-d (tensor), [out,1] (channel), the block grid
    (float32, powers of two with scale_format "ue8m0") or uint8 E8M0 bytes [out, in/32] (mxfp8)."""
    assert w.dim() == 2, w.shape
    if scheme == "tensor":
        return quantize_tensor(w, shared_scale)
    assert shared_scale is None, "only the per-tensor scheme shares scales"
    if scheme == "channel":
        return quantize_channel(w)
    if scheme == "block" and scale_format == "ue8m0":
        s = ue8m0_block_scales(w)
        codes = torch.empty(w.shape, dtype=FP8_DTYPE)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                rs, cs = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
                codes[rs, cs] = codes_with_scale(w[rs, cs], s[i, j])
        return codes, s
    if scheme == "block":
        return quantize_block(w)
    if scheme == "mxfp8":
        return quantize_mx(w)
    raise ValueError(scheme)


# ================================================================ DESIGN's tensor rules
# Which tensors are quantized, which fused groups vLLM builds, and what the output looks like,
# written from DESIGN.md ("What stays in high precision", "Output formats") and vLLM's loaders.

import re  # noqa: E402

# MoE routers stay high precision (vLLM's Qwen3-MoE even builds `mlp.gate` with the quant config,
# so it must be listed in the ignore list). Vision/audio towers and projectors too.
TOWER_RE = r"^(model\.)?(visual|vision_tower|vision_model|multi_modal_projector|embed_vision)\."
ROUTER_RE = re.compile(r"(^|\.)(mlp\.gate|block_sparse_moe\.gate|mlp\.router|shared_expert_gate)$")

# vLLM's fused modules: (regex over module names with a `p` prefix group, members, vLLM's name).
FUSED_GROUP_PATTERNS = (
    (re.compile(r"^(?P<p>.+)\.(q_proj|k_proj|v_proj)$"), ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (
        re.compile(r"^(?P<p>.+\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa)$"),
        ("q_a_proj", "kv_a_proj_with_mqa"),
        "fused_qkv_a_proj",
    ),
    (re.compile(r"^(?P<p>.+)\.(gate_proj|up_proj)$"), ("gate_proj", "up_proj"), "gate_up_proj"),
    (re.compile(r"^(?P<p>.+\.experts\.\d+)\.(w1|w3)$"), ("w1", "w3"), "w13"),
    (re.compile(r"^(?P<p>.+\.linear_attn)\.(in_proj_qkv|in_proj_z)$"), ("in_proj_qkv", "in_proj_z"), "in_proj_qkvz"),
)


def module_of(tensor_name: str) -> str:
    assert tensor_name.endswith(".weight"), tensor_name
    return tensor_name[: -len(".weight")]


def is_embedding(module: str) -> bool:
    return "embed_tokens" in module or module.endswith((".wte", ".wpe", ".embeddings", ".word_embeddings"))


def default_keep_reason(tensor_name: str, shape, scheme: str, extra_keep: str | None = None) -> str | None:
    """Why DESIGN keeps this tensor in high precision by default, or None if it is quantized.
    `extra_keep`: a regex of modules an architecture keeps beyond these rules (ARCH_KEEPS)."""
    if len(shape) != 2 or not tensor_name.endswith(".weight"):
        return "not a 2D weight"
    mod = module_of(tensor_name)
    last = mod.rsplit(".", 1)[-1]
    if extra_keep and re.search(extra_keep, mod):
        return "kept by its architecture"
    if re.search(TOWER_RE, mod):
        return "vision/audio tower or projector"
    if is_embedding(mod):
        return "embedding"
    if mod == "lm_head" or last == "lm_head":
        return "lm_head"
    if "norm" in last:
        return "norm"
    if ROUTER_RE.search(mod):
        return "router"
    if shape[0] % 16 or shape[1] % 16:  # the README: the FP8 kernels cannot take them (any scheme)
        return "shape not divisible by 16"
    if scheme == "mxfp8" and shape[1] % MX_GROUP:  # rows must split into groups of 32
        return "input dim not divisible by 32"
    return None


def fused_groups(module_names) -> dict[str, list[str]]:
    """{vLLM fused module name: [member module names]} for groups whose members all exist."""
    names = set(module_names)
    groups: dict[str, list[str]] = {}
    for pat, members, fused in FUSED_GROUP_PATTERNS:
        for m in sorted(names):
            hit = pat.match(m)
            if not hit:
                continue
            full = [f"{hit.group('p')}.{x}" for x in members]
            if all(f in names for f in full):
                groups[f"{hit.group('p')}.{fused}"] = full
    return groups


def expected_quantized(shapes: dict, scheme: str, user_ignored=frozenset(), extra_keep: str | None = None) -> set[str]:
    """Tensor names DESIGN quantizes, given {tensor name: shape} of the source and the modules the
    user ignored. A fused group is quantized only if every member is (vLLM refuses mixed groups)."""
    quant = {
        n
        for n, s in shapes.items()
        if default_keep_reason(n, s, scheme, extra_keep) is None and module_of(n) not in user_ignored
    }
    modules = {module_of(n) for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2}
    for members in fused_groups(modules).values():
        if not all(m + ".weight" in quant for m in members):
            quant -= {m + ".weight" for m in members}
    # vLLM builds one FusedMoE per layer: its experts' weights are all FP8 or all kept.
    experts: dict[str, set[str]] = {}
    for n, s in shapes.items():
        hit = re.match(r"^(.+\.experts)\.\d+\.[^.]+\.weight$", n)
        if hit and len(s) == 2:
            experts.setdefault(hit.group(1), set()).add(n)
    for members in experts.values():
        if not members <= quant:
            quant -= members
    return quant


# How transformers 5.24 names checkpoint modules in memory, where it renames them when it loads
# (transformers/conversion_mapping.py: "mixtral" moves block_sparse_moe to mlp). compressed-tensors in
# transformers matches the ignore list against these in-memory names.
TRANSFORMERS_RENAMES = {
    "mixtral": ((r"\.block_sparse_moe\.", ".mlp."),),
}


def transformers_name(kind: str | None, module: str) -> str:
    for pattern, to in TRANSFORMERS_RENAMES.get(kind, ()):
        module = re.sub(pattern, to, module, count=1)
    return module


def expected_ignore_list(shapes: dict, quantized: set[str], kind: str | None = None) -> set[str]:
    """Every 2D linear weight's module left unquantized (embeddings are not linears), by its checkpoint
    name and its transformers in-memory name, plus lm_head."""
    out = {"lm_head"}
    for n, s in shapes.items():
        if n.endswith(".weight") and len(s) == 2 and n not in quantized and not is_embedding(module_of(n)):
            out |= {module_of(n), transformers_name(kind, module_of(n))}
    return out


def scale_name_and_shape(fmt: str, scheme: str, weight_shape) -> tuple[str, tuple]:
    """(suffix replacing `.weight`, shape) of the scale tensor DESIGN specifies for each format."""
    rows, cols = weight_shape
    if fmt == "compressed-tensors":
        shape = {
            "tensor": (1,),
            "channel": (rows, 1),
            "block": block_grid(weight_shape),
            "mxfp8": (rows, cols // MX_GROUP),
        }[scheme]
        return ".weight_scale", tuple(shape)
    if fmt == "fp8":
        if scheme == "tensor":
            return ".weight_scale", ()
        if scheme == "block":
            return ".weight_scale_inv", tuple(block_grid(weight_shape))
    raise ValueError(f"no {scheme} scheme in format {fmt}")


def expected_outputs(
    src_tensors: dict,
    fmt: str,
    scheme: str,
    user_ignored=frozenset(),
    arch: str | None = None,
    config: dict | None = None,
    scale_format: str = "float",
):
    """{output name: expected tensor} computed from the source tensors with this module's math.
    `arch` (a tests/support/zoo.py name) with its `config`: fused expert tensors become one nn.Linear weight
    per expert first (split_experts), and the architecture's own keeps apply (arch_keep). A fused expert
    tensor none of whose experts is quantized stays as released (the layout transformers reads), except
    Llama-4's under compressed-tensors (transformers splits those experts itself)."""
    original = src_tensors
    pieces = {n: split_experts(arch, {n: t}, config) for n, t in src_tensors.items()} if arch else {}
    if arch:
        src_tensors = {k: v for split in pieces.values() for k, v in split.items()}
    shapes = {n: tuple(t.shape) for n, t in src_tensors.items()}
    quant = expected_quantized(shapes, scheme, user_ignored, arch_keep(arch, fmt, scheme) if arch else None)
    if not (arch in ("llama4", "llama4_text") and fmt == "compressed-tensors"):
        for name, split in pieces.items():
            if list(split) != [name] and not set(split) & quant:
                src_tensors = {k: v for k, v in src_tensors.items() if k not in split}
                src_tensors[name] = original[name]
    shared = {}
    if scheme == "tensor":
        for members in fused_groups({module_of(n) for n in quant}).values():
            s = group_tensor_scale([src_tensors[m + ".weight"] for m in members])
            for m in members:
                shared[m + ".weight"] = s
    out = {}
    for n, t in src_tensors.items():
        if n not in quant:
            out[n] = t
            continue
        codes, scale = quantize(t, scheme, shared.get(n), scale_format)
        suffix, sshape = scale_name_and_shape(fmt, scheme, t.shape)
        out[n] = codes
        out[module_of(n) + suffix] = scale.reshape(sshape)
    return out, quant


# ================================================================ architectures of tests/support/zoo.py
# What each architecture keeps beyond DESIGN's generic rules and how its fused expert tensors are used,
# read from the model files: vLLM 0.33 `vllm/model_executor/models/<arch>.py` (modules built without
# the quant config, or that corrupt output in FP8) and transformers 5.24
# `transformers/models/<arch>/modeling_<arch>.py` (the experts' forward).

ARCH_KEEPS = {
    "deepseek_v3": r"\.(eh_proj|shared_head\.head)$",  # deepseek_mtp.py: eh_proj is a torch nn.Linear
    "glm4_moe": r"\.(eh_proj|shared_head\.head)$",  # glm4_moe_mtp.py: the same
    "qwen3_next": r"(\.linear_attn\.in_proj_ba|^mtp\.fc)$",  # in_proj_ba in FP8 corrupts output (vLLM #47445)
    "nemotron_h": r"\.mixer\.gate$",  # nemotron_h.py: the router (an fp32 GateLinear)
    "jamba": r"(\.mamba\.(in_proj|x_proj|dt_proj|out_proj)|\.feed_forward\.router)$",  # mamba_mixer.py: no quant_config
    "granitemoe": r"\.router\.layer$",  # granitemoe.py: router -> gate (GateLinear)
    "dbrx": r"\.ffn\.router\.layer$",  # dbrx.py: DbrxRouter.layer, a GateLinear
    "llama4": r"\.feed_forward\.router$",  # llama4.py: Llama4MoE.router, a GateLinear
    "gpt_oss": r"\.mlp\.router$",  # gpt_oss.py: MLPBlock.router
    "gpt2": r"\.(c_attn|c_proj|c_fc)$",  # modeling_gpt2.py: Conv1D, weight stored [in, out]
    "gemma4": r"(\.router\.proj|^model\.embed_vision\.embedding_projection)$",
    "llama4_text": r"\.feed_forward\.router$",
    "granitemoeshared": r"\.router\.layer$",
    "granitemoehybrid": r"\.router\.layer$",
    "qwen3_5": r"(\.linear_attn\.in_proj_[ab]|^mtp\.fc)$",  # qwen3_5.py: in_proj_b + in_proj_a -> in_proj_ba
    "qwen3_5_moe": r"(\.linear_attn\.in_proj_[ab]|^mtp\.fc)$",
}


def arch_keep(arch: str, fmt: str, scheme: str) -> str | None:
    keep = ARCH_KEEPS.get(arch)
    if arch in ("llama4", "llama4_text") and fmt == "compressed-tensors" and scheme == "block":
        # llama4.py permute_qk_weight_for_rotary permutes q/k weight_scale rows per head; 128x128 block
        # scales cannot be permuted that way, so the language model's q/k/v stay BF16.
        keep = rf"({keep}|^(language_model\.)?model\.layers\.\d+\.self_attn\.[qkv]_proj$)"
    if arch == "falcon" and scheme == "block":
        # falcon.py load_weights regroups query_key_value rows per KV head, block scales included
        keep = r"\.self_attention\.query_key_value$"
    return keep


def _experts(config: dict, *keys: str) -> int:
    text = config.get("text_config") or config
    return next(text[k] for k in keys if k in text)


def split_experts(arch: str, tensors: dict, config: dict) -> dict:
    """The source tensors with every fused expert tensor replaced by one nn.Linear weight [out, in]
    per expert, named as vLLM's per-expert loaders read them (`<experts>.<e>.<gate|up|down>_proj.weight`).
    gpt-oss and DBRX keep theirs fused (no FP8 expert path loads in vLLM or transformers)."""
    out = {}
    for name, w in tensors.items():
        m = re.fullmatch(r"(.+)\.experts\.(gate_up_proj|down_proj)", name)
        g = re.fullmatch(r"(.+\.block_sparse_moe)\.(input_linear|output_linear)\.weight", name)
        if arch in ("llama4", "llama4_text", "qwen3_vl_moe") and m:
            # Llama4TextExperts.forward: bmm(x, gate_up_proj[e]) with gate_up_proj [E, hidden, 2*inter], then
            # chunk(2, dim=-1): gate is columns [:I], up [I:]; down_proj [E, inter, hidden]. Released
            # Qwen3-VL-MoE checkpoints store theirs the same way (x @ W).
            inter = w.shape[-1] // 2 if m.group(2) == "gate_up_proj" else w.shape[1]
            for e in range(w.shape[0]):
                if m.group(2) == "gate_up_proj":
                    out[f"{m.group(1)}.experts.{e}.gate_proj.weight"] = w[e][:, :inter].T.contiguous()
                    out[f"{m.group(1)}.experts.{e}.up_proj.weight"] = w[e][:, inter:].T.contiguous()
                else:
                    out[f"{m.group(1)}.experts.{e}.down_proj.weight"] = w[e].T.contiguous()
        elif arch == "gemma4" and m:
            # Gemma4 experts: F.linear(x, gate_up_proj[e]) with [E, 2*inter, hidden], chunk(2, dim=-1)
            inter = _experts(config, "moe_intermediate_size")
            for e in range(w.shape[0]):
                if m.group(2) == "gate_up_proj":
                    out[f"{m.group(1)}.experts.{e}.gate_proj.weight"] = w[e][:inter].contiguous()
                    out[f"{m.group(1)}.experts.{e}.up_proj.weight"] = w[e][inter:].contiguous()
                else:
                    out[f"{m.group(1)}.experts.{e}.down_proj.weight"] = w[e].contiguous()
        elif arch.startswith("granitemoe") and g:
            # GraniteMoeParallelExperts: F.linear(x, input_linear[e]) [E, 2*inter, hidden], chunk(2): gate|up
            for e in range(w.shape[0]):
                if g.group(2) == "input_linear":
                    inter = w.shape[1] // 2
                    out[f"{g.group(1)}.experts.{e}.gate_proj.weight"] = w[e][:inter].contiguous()
                    out[f"{g.group(1)}.experts.{e}.up_proj.weight"] = w[e][inter:].contiguous()
                else:
                    out[f"{g.group(1)}.experts.{e}.down_proj.weight"] = w[e].contiguous()
        else:
            out[name] = w
    return out
