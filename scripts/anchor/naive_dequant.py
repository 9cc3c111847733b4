"""Naive whole-shard FP8 -> BF16 dequantizer, the logic of DeepSeek's fp8_cast_bf16.py written anew for the
benchmark: load each shard whole onto the device (GPU if present), replace every 1-byte weight by
float32(q) * its 128x128-block weight_scale_inv cast to BF16, drop the scales, save the shard; a scale in
another shard is found by loading that shard too (at most two shards held). No fsync, no resume, and
config.json is left alone (quantization_config included). A baseline, not a product."""

import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
dev = "cuda" if torch.cuda.is_available() else "cpu"
t0 = time.time()
where = json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"]
held = {}  # shard -> its tensors on the device, oldest first


def shard(f):
    if f not in held:
        held[f] = load_file(os.path.join(src, f), device=dev)
        while len(held) > 2:
            del held[next(iter(held))]
    return held[f]


def dequant(q, s):
    rows, cols = q.shape
    full = s.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (q.float() * full).to(torch.bfloat16)


wm = {}
for f in sorted(set(where.values())):
    o = {}
    for k, w in list(shard(f).items()):
        if k.endswith("_scale_inv"):
            continue
        if w.element_size() == 1:
            s = shard(where[k + "_scale_inv"])[k + "_scale_inv"]
            o[k] = dequant(shard(f)[k], s).cpu()
        else:
            o[k] = w.cpu()
    save_file(o, os.path.join(out, f), metadata={"format": "pt"})
    wm.update({k: f for k in o})
    del o
json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0
print(f"naive done {time.time() - t0:.1f}s peak_gpu={peak_gpu:.2f}GiB")
