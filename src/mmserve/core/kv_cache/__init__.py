"""The paged KV cache's bookkeeping: block pools, prefix keys, the per-pool plan (engine-core process)."""
