"""Self-contained tiny checkpoints for the robustness tests (verify, bad inputs, resume).

Deliberately independent of transformers and of tiny_models.py: a checkpoint here is a few
safetensors files written with `safetensors.torch.save_file`, an index and a config.json, so each
test can build exactly the (broken) layout it needs in milliseconds. `write_raw` hand-writes a
safetensors file from a header dict for headers the library would refuse to produce.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8convert.cli import main
from fp8convert.output.lock import is_lock_file

INDEX = "model.safetensors.index.json"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 96,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def llama_tensors(
    layers: int = 2,
    hidden: int = 64,
    inter: int = 128,
    vocab: int = 96,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Llama-named random weights (linear dims multiples of 16, so every linear is quantized)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    t = {
        "model.embed_tokens.weight": rnd(vocab, hidden),
        "model.norm.weight": 1 + rnd(hidden),
        "lm_head.weight": rnd(vocab, hidden),
    }
    for n in range(layers):
        p = f"model.layers.{n}."
        t.update(
            {
                p + "input_layernorm.weight": 1 + rnd(hidden),
                p + "post_attention_layernorm.weight": 1 + rnd(hidden),
                p + "self_attn.q_proj.weight": rnd(hidden, hidden),
                p + "self_attn.k_proj.weight": rnd(32, hidden),
                p + "self_attn.v_proj.weight": rnd(32, hidden),
                p + "self_attn.o_proj.weight": rnd(hidden, hidden),
                p + "mlp.gate_proj.weight": rnd(inter, hidden),
                p + "mlp.up_proj.weight": rnd(inter, hidden),
                p + "mlp.down_proj.weight": rnd(hidden, inter),
            }
        )
    return t


def shard_by_layer(names) -> dict[str, list[str]]:
    """One file for the non-layer tensors, one per layer: model-0000i-of-0000N.safetensors."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "~rest"
        groups.setdefault(key, []).append(name)
    keys = sorted(groups)
    return {f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors": groups[k] for i, k in enumerate(keys)}


def write_checkpoint(
    root,
    tensors: dict[str, torch.Tensor] | None = None,
    config: dict | None = None,
    layout: dict[str, list[str]] | None = None,
    index: bool = True,
    extras: bool = True,
) -> Path:
    """Write `tensors` (default: llama_tensors()) as a sharded checkpoint in `root`. Returns root."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tensors = llama_tensors() if tensors is None else tensors
    layout = shard_by_layer(tensors) if layout is None else layout
    weight_map = {}
    for file, names in layout.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(root / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (root / "config.json").write_text(json.dumps(CONFIG if config is None else config, indent=2))
    if extras:
        (root / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
        (root / "generation_config.json").write_text('{"bos_token_id": 1}\n')
    return root


def write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file from a header dict and raw data (or a lying header length)."""
    raw = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return Path(path)


def rewrite_index(root, edit) -> None:
    path = Path(root) / INDEX
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def tree_bytes(root) -> dict[str, bytes]:
    """Every file under root (hidden ones included), by relative path, but the work folder's empty lock
    files: which of them exist says only how many workers wrote there."""
    root = Path(root)
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (p.parent.name == ".fp8convert" and is_lock_file(p.name))
    }


def looks_complete(out) -> bool:
    out = Path(out)
    return (out / "config.json").exists() and (out / INDEX).exists()


CLI = "import sys; from fp8convert.cli import run; run(sys.argv[1:])"
# The same, with every tensor write slowed by argv[1] seconds, so a test can stop a run of a tiny model at a
# chosen moment. The slowing lives here, in the tests, not in the product.
SLOW_CLI = (
    "import sys, time; from fp8convert.run.writer import ShardWriter; write = ShardWriter.write; "
    "delay = float(sys.argv.pop(1)); "
    "ShardWriter.write = lambda self, *a, **k: (time.sleep(delay), write(self, *a, **k))[1]; "
    "from fp8convert.cli import run; run(sys.argv[1:])"
)


def cli_subprocess(
    args: list[str], env_extra: dict | None = None, write_delay: float | None = None
) -> subprocess.Popen:
    """`fp8convert ARGS` in a child process, run from this checkout (its root first on sys.path).
    `write_delay`: seconds to sleep before each tensor write."""
    env = dict(os.environ, **(env_extra or {}))
    code = [SLOW_CLI, str(write_delay)] if write_delay else [CLI]
    return subprocess.Popen(
        [sys.executable, "-c", *code, *map(str, args)],
        env=env,
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def slow_writes(monkeypatch, delay: float) -> None:
    """In this process: sleep `delay` seconds before each tensor write (keeps batches in flight)."""
    from fp8convert.run.writer import ShardWriter

    write = ShardWriter.write

    def slow(self, *args, **kwargs):
        time.sleep(delay)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", slow)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 60) -> bool:
    """Poll until `condition()` or the process ends; True if the condition was met."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    pytest.fail("the conversion neither progressed nor ended")


def run_cli(capsys, *args) -> tuple[int, str]:
    """`fp8convert ARGS` in this process: its exit code and stderr."""
    rc = main([*map(str, args)])
    return rc, capsys.readouterr().err


def assert_refused(rc: int, err: str, out, *names: str, preflight: bool = True) -> str:
    """One error line that names every one of `names`; non-zero exit; no complete-looking output."""
    assert rc != 0, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in errors[0], (name, errors[0])
    assert not looks_complete(out)
    if preflight:
        assert not out.exists(), f"OUT was created before the input was validated: {sorted(tree_bytes(out))}"
    return errors[0]
