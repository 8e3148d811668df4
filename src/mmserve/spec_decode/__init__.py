"""Speculative decoding: who drafts, the drafting loop over the target's K/V, verify rows
(engine-core process; the drafter's shards run in every tensor-parallel rank)."""
