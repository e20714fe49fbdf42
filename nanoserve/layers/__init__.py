"""Model layers; attention.py is the one that knows about batches and the paged KV cache (§5)."""
