"""Sampling: the batched sampler, penalties and bias, log-probabilities (engine-core process)."""
