"""Several processes, one conversion (or many): docs/cluster.md."""
