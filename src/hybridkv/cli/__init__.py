"""hybridkv.cli."""
