"""Stage 2, plan: what becomes of every tensor and where every output byte goes. Pure functions of the
headers, config.json and the options; no I/O.

build.py          build_plan, top-down: decisions, how each output is made, shards, ignore list, fingerprint
rules.py          which tensors are quantized, which are kept (and why), which share a scale
architectures.py  the registry of model families; family.py what an entry holds, and the warnings' Caveats
plan.py           the plan's records: tensors (and where one lies in a fused source), units, shards
batches.py        units cut to the memory budget, and the shard byte ranges (runs) a batch fills
summary.py        what `inspect` shows and where the output will not load; parallel.py: at which TP sizes
"""
