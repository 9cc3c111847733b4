"""An embedded default model: a small random Llama-shaped BF16 checkpoint, built locally (no network),
so a fresh install can run a real conversion end to end."""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import FP8ConvertError

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_demo_model(path: str | Path, shards: int = 2) -> Path:
    """Write the demo checkpoint (random weights, real Llama names) in `shards` safetensors files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def weight(*shape):  # a norm's weight (one dimension) is ones
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (q, h)}
    layer |= {"self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q)}
    layer |= {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    tensors = {"model.embed_tokens.weight": weight(c["vocab_size"], h), "model.norm.weight": weight(h)}
    tensors["lm_head.weight"] = weight(c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        tensors |= {f"model.layers.{n}.{name}.weight": weight(*shape) for name, shape in layer.items()}
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    return path


def demo_source(path: Path) -> Path:
    """The demo checkpoint at `path`: written when `path` is new or empty, kept when it holds the demo
    already, else refused: the demo's file names are common ones (config.json, model-00001-of-00002...)."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return make_demo_model(path)
    if path.is_dir():
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".demo-") as fresh:
            demo = make_demo_model(Path(fresh) / "source")
            if file_bytes(path) == file_bytes(demo):
                return path
    raise FP8ConvertError(
        f"{path}: holds files that are not the demo model's; choose another folder for the demo "
        "(it writes DIR/source and DIR/fp8)"
    )


def file_bytes(path: Path) -> dict[str, bytes | None]:
    """Each entry's bytes by name (None for anything but a file)."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in path.iterdir()}


def next_steps(src: Path, out: Path, scheme: str, fmt: str) -> str:
    """What to try after the demo: verify the output, inspect a plan, load it in transformers."""
    from .output.card import TRANSFORMERS_NEEDS, transformers_support

    source, target = shlex.quote(str(src)), shlex.quote(str(out))
    lines = [
        "next:",
        f"  fp8convert verify {source} {target}    # compare every weight with the source",
        f"  fp8convert inspect {source} --scheme block    # what a conversion would do, from headers only",
    ]
    loads, why = transformers_support(fmt, scheme, None)
    if not loads:
        return "\n".join(lines + [f"  (not loadable in transformers: {why}; vLLM and SGLang serve it)"])
    lines += [
        f"  in Python (pip install {TRANSFORMERS_NEEDS[fmt]}):",
        "    import torch, transformers",
        f"    model = transformers.AutoModelForCausalLM.from_pretrained({json.dumps(str(out))})",
        "    print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8))",
    ]
    return "\n".join(lines)
