"""hybridkv.models."""
