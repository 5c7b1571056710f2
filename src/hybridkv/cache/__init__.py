"""hybridkv.cache."""
