"""Scheduling: request state, the chunked-prefill Scheduler, paged KV pools, and the per-step
metadata builder (request -> scheduler -> kv_cache_manager -> metadata, one idea per module)."""
