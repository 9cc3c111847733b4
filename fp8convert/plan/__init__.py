"""Stage 2, plan: what becomes of every tensor and where every output byte goes. Pure functions of the
headers, config.json and the options; no I/O.

rules.py    which tensors are quantized, which are kept (and why), which share a scale
plan.py     the Plan: units, output names, shard layout, ignore list, fingerprint
batches.py  units cut to the memory budget
summary.py  what `inspect` shows: the plan in numbers, memory estimate, where the output will not load
"""
