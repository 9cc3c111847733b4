"""Stage 2, plan: what becomes of every tensor and where every output byte goes. Pure functions of the
headers, config.json and the options; no I/O."""
