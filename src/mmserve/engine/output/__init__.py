"""Output processing in the front end: detokenise, stop strings, per-request state and timings."""
