"""hybridkv.storage."""
