"""The scheduler: token budget per step, chunked prefill that never splits a frame, preemption.
CPU policy over plain data (runs in the engine-core process)."""
