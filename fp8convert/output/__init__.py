"""The output directory: its manifest, partial shards, lock, finalizing and model card."""
